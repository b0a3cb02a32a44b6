"""Evaluation: the eval set, its exact loss on the pipeline and on a plain model, the best model.

``spotline.evaluation`` in the config names an eval set: a file or folder read like
``--data`` (:func:`prepare_eval_set`), or a fraction of the training rows held out with the
run's seed (``spotline.plan.evaluation.holdout_split``; those rows are removed from what
the sampler draws from). It is evaluated every ``interval_steps`` steps and after the last
(:class:`Evaluator`, which both entry points run at those step boundaries).

The loss is exact (the same bits on any number of processes, stages, pipelines, logical
worker placements, and after any recovery): the eval rows are cut into micro-batches by
index (``EvalBatches``); whichever pipeline runs one computes its summed token loss and
token count (:func:`token_loss_sum`) from the same inputs with the same kernels; the table
of every micro-batch's pair is gathered with an all-reduce in which each entry is non-zero
on one rank only (adding zeros is exact) and reduced by ``math.fsum``
(``spotline.plan.evaluation.reduce_losses``), whose result does not depend on the order.
The reference (``spotline.reference``) computes the same numbers with a plain
``transformers`` model (:func:`evaluate_model`).

An evaluation that beats every earlier one saves the model (and its tokenizer) as the run's
best: ``best`` in the output directory is a symbolic link to a complete ``save_pretrained``
directory under ``eval-models/``, swapped atomically (:func:`publish_best`), so a crash at
any moment leaves the previous best or the new one, never a part of one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from spotline.config import RunConfig
from spotline.data.inputs import EvalSet as EvalSet  # re-exported: where evaluation is
from spotline.data.inputs import prepare_eval_set as prepare_eval_set
from spotline.data.instructions import IGNORE_INDEX
from spotline.plan.evaluation import (
    LossSum,
    improves,
    is_due,
    perplexity,
    reduce_losses,
)
from spotline.run_dir import BEST_MODEL
from spotline.run_dir import EVAL_MODELS as EVAL_MODELS
from spotline.wire.protocol import EvalResult
from spotline.worker.export import gather_hf_parameters, save_model

if TYPE_CHECKING:
    import transformers

    from spotline.pipeline.engine import SpotlinePipelineEngine

Batch = tuple[torch.Tensor, torch.Tensor]


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[sum of the counted tokens' cross-entropy, tokens counted]`` of one micro-batch, as
    float64 (the sum is cross_entropy's float32 sum, converted exactly). Labels
    :data:`IGNORE_INDEX` add nothing to either."""
    flat = labels.reshape(-1)
    loss_sum = F.cross_entropy(
        # fp32 whatever the compute precision (bf16 logits under autocast), as in training.
        logits.reshape(-1, logits.shape[-1]).float(),
        flat,
        reduction="sum",
        ignore_index=IGNORE_INDEX,
    )
    counted = (flat != IGNORE_INDEX).sum()
    return torch.stack([loss_sum.double(), counted.double()])


def evaluate_pipeline(engine: SpotlinePipelineEngine, eval_set: EvalSet) -> tuple[float, int]:
    """The eval set's mean token loss and token count, the same on every rank. Collective
    over the job: every rank calls it."""
    batches = eval_set.batches
    grid = engine.grid
    mine = batches.of_pipeline(grid.data_parallel_id, grid.get_data_parallel_world_size())
    outputs = engine.evaluate((eval_set.batch(m) for m in mine), len(mine), token_loss_sum)
    table = torch.zeros(batches.num_micro_batches, 2, dtype=torch.float64)
    if engine.is_last_stage():
        for micro_batch, pair in zip(mine, outputs, strict=True):
            table[micro_batch] = pair
    # Each row is non-zero on one rank only (the last stage of the pipeline that ran it):
    # adding zeros is exact, so every rank gets every pair bit for bit.
    dist.all_reduce(table)
    return reduce_losses(_loss_sums(table), batches.num_micro_batches)


def evaluate_model(model: transformers.PreTrainedModel, eval_set: EvalSet) -> tuple[float, int]:
    """:func:`evaluate_pipeline` on a plain ``transformers`` model in this process (the
    reference's): the same micro-batches, loss and reduction. The model is left in the mode
    it was in."""
    was_training = model.training
    model.train(False)  # dropout off (eval(), which transformers leaves unannotated)
    batches = eval_set.batches
    table = torch.zeros(batches.num_micro_batches, 2, dtype=torch.float64)
    with torch.no_grad():
        for micro_batch in range(batches.num_micro_batches):
            input_ids, labels = eval_set.batch(micro_batch)
            table[micro_batch] = token_loss_sum(model(input_ids=input_ids).logits, labels)
    model.train(was_training)
    return reduce_losses(_loss_sums(table), batches.num_micro_batches)


def _loss_sums(table: torch.Tensor) -> list[LossSum]:
    return [
        LossSum(micro_batch, float(row[0]), int(row[1]))
        for micro_batch, row in enumerate(table.tolist())
    ]


def publish_best(output: Path, write: Callable[[Path], None], step: int) -> Path:
    """Make ``output/best`` name a new model directory, atomically.

    ``write(directory)`` creates the directory (complete, flushed, renamed into place:
    ``spotline.models.layers.save_pretrained``); then the link is swapped with ``os.replace``: a
    reader, or a run that crashed at any point, sees the previous best or the new one.
    Every other entry of ``eval-models`` (earlier bests, what a crash left) is removed
    after the swap. Returns the new directory."""
    root = output / EVAL_MODELS
    root.mkdir(parents=True, exist_ok=True)
    # A fresh name each time: a replayed evaluation never overwrites the directory the link
    # may be naming at that moment.
    directory = root / f"step-{step}-{uuid.uuid4().hex[:8]}"
    write(directory)
    link = output / BEST_MODEL
    staged = output / f".{BEST_MODEL}.{uuid.uuid4().hex}.tmp"
    os.symlink(os.path.relpath(directory, output), staged)
    os.replace(staged, link)
    fd = os.open(output, os.O_RDONLY)
    try:
        os.fsync(fd)  # the swap itself survives a power loss
    finally:
        os.close(fd)
    for entry in root.iterdir():
        if entry != directory:
            shutil.rmtree(entry, ignore_errors=True)
    return directory


class Evaluator:
    """What both entry points run at an evaluation step: the exact loss, the best model, the
    report. ``earlier()`` gives the evaluations before this one (step -> loss: the store's
    for ``spotline train``, which a recovery keeps; this process's for the launcher);
    ``report(result)`` is called on rank 0 once the result (and its best model) is done."""

    def __init__(
        self,
        cfg: RunConfig,
        eval_set: EvalSet,
        hf_config: Any,
        output: Path,
        *,
        earlier: Callable[[], Mapping[int, float]],
        report: Callable[[EvalResult], None],
    ) -> None:
        self.cfg = cfg
        self.eval_set = eval_set
        self.hf_config = hf_config
        self.output = output
        self.earlier = earlier
        self.report = report

    def due(self, step: int) -> bool:
        """Whether the run evaluates once ``step`` optimizer steps are applied."""
        ev = self.cfg.spotline.evaluation
        return is_due(step, ev.interval_steps, self.cfg.spotline.training.steps)

    def run(self, engine: SpotlinePipelineEngine, step: int) -> EvalResult:
        """Evaluate the engine's model at ``step`` (collective: every rank calls it)."""
        loss, tokens = evaluate_pipeline(engine, self.eval_set)
        # Rank 0 decides from the earlier evaluations (what it alone reads) and tells every
        # rank, which must all take part in the export.
        best = torch.tensor([0], dtype=torch.int64)
        if dist.get_rank() == 0:
            best[0] = int(improves(loss, step, self.earlier()))
        dist.broadcast(best, src=0)
        result = EvalResult(step, loss, perplexity(loss), tokens, best=bool(best[0]))
        if result.best:
            self._save_best(engine, result)
        if dist.get_rank() == 0:
            self.report(result)
        return result

    def _save_best(self, engine: SpotlinePipelineEngine, result: EvalResult) -> None:
        hf_params = gather_hf_parameters(engine, self.hf_config)
        if hf_params is None:
            return  # not rank 0: its part is gathered
        note = json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n"

        def write(directory: Path) -> None:
            save_model(hf_params, self.hf_config, directory, self.cfg, note=note)

        publish_best(self.output, write, result.step)
