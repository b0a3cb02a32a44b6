"""One rank of the exact data-parallel engine tests (tests/test_dp_engine.py).

``dp_worker.py OUT_DIR GROUPS [--poison-worker W] [--oracle]``: a tiny GPT-2 (dropout on)
trained with spotline.exact.dp_engine for ``STEPS`` steps by ``NUM_LOGICAL_WORKERS`` logical
workers, ``GROUPS`` saying which ones each rank hosts ("0,1;2,3": rank 0 hosts 0 and 1).
Writes ``OUT_DIR/rank{r}.json``: every step's loss, the final parameters' SHA-256 and the
gradient norm before clipping. With ``--poison-worker W`` one more step follows in which
logical worker W's loss (so its gradient) is NaN: the NonFiniteGradient it raises is
recorded, and the step is then run again unpoisoned. With ``--oracle`` (one rank only) the
same training is then run again without DeepSpeed: plain torch AdamW over the same
batches, the logical workers' gradients combined with LogicalGradients in this process.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

# Minutes; read when DeepSpeed is imported: a peer that hangs fails the run instead of
# stalling it for DeepSpeed's default 10 minutes.
os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from spotline.data.corpus import PackedCorpus
from spotline.data.loader import load_corpus
from spotline.exact.reduction import LogicalGradients, NonFiniteGradient
from spotline.models import layers as models
from spotline.plan.sampler import GlobalSampler
from spotline.runtime import configure_process, derive_seed, param_sha256

NUM_LOGICAL_WORKERS = 4
STEPS = 3
SEED = 11
SEQ_LEN = 32
MICRO_BATCH = 2
MICRO_BATCHES = 2  # per logical worker and step
ADAMW: dict[str, Any] = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
CLIP = 1.0
CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": MICRO_BATCHES,
    "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}},
    "gradient_clipping": CLIP,
    "steps_per_print": 1_000_000,
}

Batch = tuple[torch.Tensor, torch.Tensor]


def hf_config() -> Any:
    config = models.load_hf_config("gpt2-tiny")
    assert config.resid_pdrop > 0 and config.attn_pdrop > 0 and config.embd_pdrop > 0
    return config


def corpus_and_sampler() -> tuple[PackedCorpus, GlobalSampler]:
    samples_per_step = NUM_LOGICAL_WORKERS * MICRO_BATCHES * MICRO_BATCH
    corpus = load_corpus(None, None, SEQ_LEN, min_sequences=samples_per_step)
    sampler = GlobalSampler(
        num_samples=len(corpus),
        num_logical_workers=NUM_LOGICAL_WORKERS,
        micro_batch_size=MICRO_BATCH,
        num_micro_batches=MICRO_BATCHES,
        seed=SEED,
    )
    return corpus, sampler


def step_batches(
    corpus: PackedCorpus, sampler: GlobalSampler, step: int, workers: list[int]
) -> dict[int, list[Batch]]:
    return {
        w: [corpus.batch(sampler.indices(step, w, mb)) for mb in range(MICRO_BATCHES)]
        for w in workers
    }


def micro_batch_loss(model: Any, batch: Batch) -> torch.Tensor:
    input_ids, labels = batch
    return models.causal_lm_loss(model(input_ids=input_ids).logits, labels)


def train_deepspeed(hosted: list[int], poison_worker: int | None) -> dict[str, Any]:
    from spotline.exact import dp_engine

    model = models.reference_model(hf_config(), SEED)
    engine = dp_engine.initialize(
        model,
        CONFIG,
        num_logical_workers=NUM_LOGICAL_WORKERS,
        hosted_logical_workers=hosted,
    )
    corpus, sampler = corpus_and_sampler()
    poisoned: list[int | None] = [None]

    def loss_fn(eng: Any, batch: Batch) -> torch.Tensor:
        loss = micro_batch_loss(eng, batch)
        if poisoned[0] is not None and eng.current_logical_worker == poisoned[0]:
            loss = loss * float("nan")
        return loss

    result: dict[str, Any] = {"losses": [], "grad_norms": []}
    for step in range(STEPS):
        batches = step_batches(corpus, sampler, step, hosted)
        result["losses"].append(engine.train_logical_step(step, SEED, batches, loss_fn))
        result["grad_norms"].append(float(engine.get_global_grad_norm()))
    result["sha256"] = param_sha256(dict(engine.module.named_parameters()))
    result["global_steps"] = engine.global_steps
    result["global_samples"] = engine.global_samples
    result["gradient_accumulation_steps"] = engine.gradient_accumulation_steps()
    if poison_worker is not None:
        batches = step_batches(corpus, sampler, STEPS, hosted)
        poisoned[0] = poison_worker
        try:
            engine.train_logical_step(STEPS, SEED, batches, loss_fn)
            result["non_finite"] = None
        except NonFiniteGradient as exc:
            result["non_finite"] = list(exc.logical_workers)
        result["sha256_after_refused_step"] = param_sha256(dict(engine.module.named_parameters()))
        poisoned[0] = None
        result["retry_loss"] = engine.train_logical_step(STEPS, SEED, batches, loss_fn)
        result["sha256_after_retry"] = param_sha256(dict(engine.module.named_parameters()))
        result["global_steps"] = engine.global_steps
    return result


def train_oracle() -> dict[str, Any]:
    """The same training without DeepSpeed, every logical worker in this process."""
    model = models.reference_model(hf_config(), SEED)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        params,
        lr=ADAMW["lr"],
        betas=(ADAMW["betas"][0], ADAMW["betas"][1]),
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
    )
    logical = LogicalGradients([p for p in params if p.requires_grad], NUM_LOGICAL_WORKERS)
    corpus, sampler = corpus_and_sampler()
    workers = list(range(NUM_LOGICAL_WORKERS))
    result: dict[str, Any] = {"losses": [], "grad_norms": []}
    for step in range(STEPS):
        batches = step_batches(corpus, sampler, step, workers)
        losses = torch.zeros(NUM_LOGICAL_WORKERS, dtype=torch.float32)
        for w in workers:
            total = None
            for mb, batch in enumerate(batches[w]):
                torch.manual_seed(derive_seed(SEED, step, w, mb))
                loss = micro_batch_loss(model, batch)
                value = loss.detach().float()
                total = value if total is None else total + value
                (loss / MICRO_BATCHES).backward()
            assert total is not None
            logical.keep(w)
            losses[w] = total / MICRO_BATCHES
        logical.reduce(local=True)  # every logical worker is here: no communication
        # Clipping by the global norm of the reduced gradients.
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.stack([g.float().norm(2.0) for g in grads]).pow(2.0).sum().pow(0.5)
        coef = torch.min(torch.tensor([1.0]), torch.tensor([CLIP]) / (norm + 1e-6))
        for g in grads:
            g.mul_(coef)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = losses[0].clone()
        for w in workers[1:]:
            mean = mean + losses[w]
        result["losses"].append(float(mean / NUM_LOGICAL_WORKERS))
        result["grad_norms"].append(float(norm))
    result["sha256"] = param_sha256(dict(model.named_parameters()))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("groups")
    parser.add_argument("--poison-worker", type=int, default=None)
    parser.add_argument("--oracle", action="store_true")
    args = parser.parse_args()
    configure_process(intra_op_threads=1, deterministic=True)
    rank = int(os.environ["RANK"])
    hosted = [int(w) for w in args.groups.split(";")[rank].split(",")]
    result = train_deepspeed(hosted, args.poison_worker)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if args.oracle:
        result["oracle"] = train_oracle()
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
