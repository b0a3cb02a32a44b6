"""A single-process transformers reference for the pipeline's training math.

The plain Hugging Face model, the same initial weights, the same batches from the global
sampler, and the same arithmetic DeepSpeed's pipeline engine performs, written out in the
order DeepSpeed performs it:

- each micro-batch's loss is divided by the number of micro-batches before its backward
  (DeepSpeed's ``_scale_loss_by_gas``), and gradients accumulate in micro-batch order;
- with tied embeddings (a family's: a whole model keeps its tie shared, as its one pipeline
  layer does), the embedding's and the LM head's gradients accumulate separately
  over the micro-batches (on the pipeline they live on different stages) and are added
  once at the end (``ReduceTiedGrads``); so the reference unties the two parameters and
  adds their gradients itself;
- the data-parallel reduction is Spotline's exact one (``spotline.exact.reduction.LogicalGradients``,
  here without communication) over the logical pipelines' gradients, then scaled by
  1/pipelines; the reported loss is each pipeline's mean, added in pipeline order, divided
  by their number;
- torch's AdamW with the config's hyper-parameters;
- the evaluations (``spotline.worker.validator.evaluate_model``: the same micro-batches, token
  loss sums and exact reduction as the pipeline's) at the same steps, and the parameters
  of the best one.

With dropout off and the determinism switch this is bitwise what the pipeline computes,
so tests compare with ``torch.equal`` and exact hashes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from spotline.config import RunConfig
from spotline.exact.reduction import LogicalGradients
from spotline.models import layers as models
from spotline.pipeline.clipping import apply_clip, clip_coefficient, per_layer_sq_norms
from spotline.plan.evaluation import improves, is_due, perplexity
from spotline.reports.tracking import eval_fields
from spotline.runtime import configure_process, param_sha256, seed_everything
from spotline.wire.protocol import EvalResult
from spotline.worker.engine_builder import global_sampler
from spotline.worker.validator import EvalSet, evaluate_model

if TYPE_CHECKING:
    import transformers


class _Evaluations:
    """The reference's evaluations, as the pipeline's ``spotline.worker.validator.Evaluator`` makes
    them, and the parameters of the best one."""

    def __init__(self, cfg: RunConfig, eval_set: EvalSet | None, hf_names: set[str]) -> None:
        self.cfg = cfg
        self.eval_set = eval_set
        self.hf_names = hf_names
        self.results: dict[int, EvalResult] = {}
        self.best_parameters: dict[str, torch.Tensor] | None = None

    def after(self, step: int, model: transformers.PreTrainedModel) -> None:
        """Evaluate ``model`` if the run evaluates once ``step`` steps are applied."""
        ev = self.cfg.spotline.evaluation
        if self.eval_set is None or not is_due(
            step, ev.interval_steps, self.cfg.spotline.training.steps
        ):
            return
        loss, tokens = evaluate_model(model, self.eval_set)
        best = improves(loss, step, {s: r.loss for s, r in self.results.items()})
        self.results[step] = EvalResult(step, loss, perplexity(loss), tokens, best)
        if best:
            self.best_parameters = {
                k: v.detach().clone() for k, v in model.named_parameters() if k in self.hf_names
            }


def train_reference(cfg: RunConfig) -> dict[str, Any]:
    """Train ``cfg`` in this process; returns ``losses``, ``param_sha256``, ``eval`` and
    ``best_eval`` like summary.json, the final ``parameters`` and the best evaluation's
    (``best_parameters``, None without evaluations)."""
    from spotline.data.inputs import prepare_inputs
    from spotline.worker.engine_builder import pretrained_dir_of

    sl = cfg.spotline
    configure_process(
        intra_op_threads=sl.determinism.intra_op_threads, deterministic=sl.determinism.enabled
    )
    seed_everything(sl.training.seed)
    inputs = prepare_inputs(cfg)
    hf_config, corpus = inputs.hf_config, inputs.corpus
    model = models.reference_model(hf_config, sl.training.seed, pretrained_dir_of(sl.model.name))
    model.train()
    hf_names = set(dict(model.named_parameters()))  # tied aliases appear once
    evaluations = _Evaluations(cfg, inputs.eval_set, hf_names)

    embedding = cast(torch.Tensor, model.get_input_embeddings().weight)
    # transformers leaves get_output_embeddings unannotated
    head_module = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    # Untied as a family's pipeline keeps them (two parameters); a whole model's pipeline
    # layer shares the tied weight as transformers does, so the reference leaves it shared.
    tied = (
        models.is_family(hf_config) and head_module is not None and head_module.weight is embedding
    )
    if tied:
        head_module.weight = torch.nn.Parameter(embedding.detach().clone())
    head = head_module.weight if head_module is not None else None

    params = [p for p in model.parameters()]
    opt_cfg = cfg.deepspeed["optimizer"]
    assert opt_cfg["type"] == "AdamW", "the reference implements AdamW only"
    hp = {k: v for k, v in opt_cfg["params"].items() if k != "torch_adam"}
    optimizer = torch.optim.AdamW(
        params,
        lr=hp["lr"],
        betas=tuple(hp["betas"]),
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
    )

    num_logical_workers = cfg.num_logical_workers
    num_micro_batches = cfg.num_micro_batches
    sampler = global_sampler(cfg, len(corpus))
    # DeepSpeed's default is 1.0 when the key is absent.
    max_norm = float(cfg.deepspeed.get("gradient_clipping", 1.0))
    losses: list[float] = []
    exact = LogicalGradients(params, num_logical_workers)
    for step in range(sl.training.steps):
        per_pipeline_loss: list[torch.Tensor] = []
        for pipeline in range(num_logical_workers):
            optimizer.zero_grad(set_to_none=True)
            total = None
            for micro_batch in range(num_micro_batches):
                input_ids, labels = corpus.batch(sampler.indices(step, pipeline, micro_batch))
                logits = model(input_ids=input_ids).logits
                loss = models.causal_lm_loss(logits, labels)
                total = torch.zeros_like(loss) if total is None else total
                total += loss.detach()
                # torch leaves Tensor.backward unannotated
                (loss / num_micro_batches).backward()  # type: ignore[no-untyped-call]
            if tied:
                assert head is not None and embedding.grad is not None and head.grad is not None
                summed = embedding.grad + head.grad
                embedding.grad.copy_(summed)
                head.grad.copy_(summed)
            exact.keep(pipeline)
            assert total is not None
            per_pipeline_loss.append(total / num_micro_batches)
        exact.reduce(local=True)
        loss_sum = per_pipeline_loss[0]
        for pipeline in range(1, num_logical_workers):
            loss_sum = loss_sum + per_pipeline_loss[pipeline]
        losses.append(
            float(loss_sum / num_logical_workers if num_logical_workers > 1 else loss_sum)
        )
        if max_norm > 0:
            # The same placement-independent norm as the pipeline engine (spotline.pipeline.clipping).
            named_grads = models.hf_to_layer_names(
                # A missing gradient counts as nothing, as a None one does in per_layer_sq_norms.
                {
                    n: p.grad
                    for n, p in model.named_parameters()
                    if n in hf_names and p.grad is not None
                },
                hf_config,
            )
            values = per_layer_sq_norms(
                named_grads.items(),
                num_layers=models.num_layers(hf_config),
                owned_layers=range(models.num_layers(hf_config)),
                skip=set(models.tied_copies(hf_config)),
            )
            apply_clip((p.grad for p in params), clip_coefficient(values, max_norm))
        optimizer.step()
        evaluations.after(step + 1, model)

    named = {k: v for k, v in model.named_parameters() if k in hf_names}
    return {
        "losses": losses,
        "param_sha256": param_sha256(named),
        "parameters": named,
        **eval_fields(evaluations.results),
        "best_parameters": evaluations.best_parameters,
    }
