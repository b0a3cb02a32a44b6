"""Command-line flags shared by ``spotline train`` and ``launch/train.py``.

Flags override the config file; each maps to one key of the ``spotline`` section (or a
DeepSpeed key), and goes through the same strict parser as the file.
"""

from __future__ import annotations

import argparse
from typing import Any

# flag dest -> dotted config key
FLAG_KEYS: dict[str, str] = {
    "workers": "spotline.topology.workers",
    "start_workers": "spotline.topology.start_workers",
    "stages": "spotline.topology.stages",
    "steps": "spotline.training.steps",
    "seed": "spotline.training.seed",
    "model": "spotline.model.name",
    "seq_len": "spotline.model.seq_len",
    "data": "spotline.data.path",
    "tokenizer": "spotline.data.tokenizer",
    "instruction_layout": "spotline.data.instruction_layout",
    "eval_data": "spotline.evaluation.data",
    "eval_holdout": "spotline.evaluation.holdout_fraction",
    "eval_every": "spotline.evaluation.interval_steps",
    "eval_max_samples": "spotline.evaluation.max_samples",
    "redundancy": "spotline.redundancy.mode",
    "replica": "spotline.redundancy.replica",
    "wandb": "spotline.tracking.wandb",
    "recovery": "spotline.recovery.mode",
    "trace": "spotline.recovery.trace",
    "time_scale": "spotline.recovery.time_scale",
    "trace_clock": "spotline.recovery.trace_clock",
    "preempt_rate": "spotline.recovery.preempt_rate",
    "max_workers": "spotline.recovery.max_workers",
    "warm_workers": "spotline.recovery.warm_workers",
    "checkpoint_interval": "spotline.checkpoints.interval_steps",
    "store": "spotline.recovery.store",
    "etcd_endpoint": "spotline.recovery.etcd_endpoint",
    "logical_workers": "spotline.elasticity.logical_workers",
    "rescale": "spotline.elasticity.rescale",
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "micro_batches": "gradient_accumulation_steps",
}


def add_run_flags(parser: argparse.ArgumentParser, *, with_workers: bool) -> None:
    if with_workers:
        parser.add_argument(
            "--workers", type=int, help="worker processes to start (a multiple of --stages)"
        )
        parser.add_argument(
            "--start-workers",
            type=int,
            help="start training with this many (default: --workers); a coordinator's later "
            "machines join at step boundaries up to --workers",
        )
    parser.add_argument("--stages", type=int, help="pipeline stages (logical)")
    parser.add_argument("--steps", type=int, help="optimizer steps to train")
    parser.add_argument("--seed", type=int, help="seed of the run (data order, init, dropout)")
    parser.add_argument(
        "--model", help="a preset (gpt2-tiny, llama-tiny, ...) or a save_pretrained directory"
    )
    parser.add_argument("--seq-len", type=int, help="tokens per training sequence")
    parser.add_argument(
        "--data", help="a .txt/.json/.jsonl file, a directory of them, or a saved dataset"
    )
    parser.add_argument("--tokenizer", help="a tokenizer directory (default: built-in byte-level)")
    parser.add_argument(
        "--instruction-layout",
        help="instruction records: pack (default: whole examples share a row) or pad (one a row)",
    )
    parser.add_argument(
        "--eval-data",
        help="evaluate on this file or folder (read like --data, same tokenizer and --seq-len)",
    )
    parser.add_argument(
        "--eval-holdout",
        type=float,
        metavar="FRACTION",
        help="evaluate on this share of --data's rows (chosen by --seed, never trained on)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        metavar="K",
        help="evaluate every K steps (and after the last; default: after the last only)",
    )
    parser.add_argument(
        "--eval-max-samples",
        type=int,
        metavar="N",
        help="evaluate on the eval set's first N rows only (default: all)",
    )
    parser.add_argument("--redundancy", help="off, lazy or eager (Bamboo redundant computation)")
    parser.add_argument(
        "--replica",
        help="full (default) or sharded: each of D pipelines' replica holders keeps 1/D of "
        "its successor's state (lazy only)",
    )
    parser.add_argument(
        "--logical-workers",
        type=int,
        help="logical data-parallel pipelines N (EasyScale): the math of N pipelines whatever "
        "the number of processes (default: workers / stages)",
    )
    parser.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, help="micro-batches per pipeline per step")
    parser.add_argument("--wandb", help="offline (default), online or disabled")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="deterministic kernels, fixed threads, seeds owned by the logical worker",
    )


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dest, key in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            out[key] = value
    if getattr(args, "deterministic", None):
        out["spotline.determinism.enabled"] = True
    if getattr(args, "inject", None):
        out["spotline.recovery.inject"] = list(args.inject)
    return out


def add_recovery_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of the local launcher only: they need Spotline's coordinator."""
    parser.add_argument(
        "--recovery", help="failover (default: in-memory takeover) or checkpoint-restart"
    )
    parser.add_argument(
        "--trace",
        help="replay a spot trace (formats: integration/assets/traces/README.md, which ships "
        "public ones)",
    )
    parser.add_argument("--time-scale", type=float, help="trace seconds played per wall second")
    parser.add_argument(
        "--trace-clock",
        help="wall (default), or steps: each step is recovery.step_time_estimate_s, idle skipped",
    )
    parser.add_argument(
        "--preempt-rate", type=float, help="random preemptions per worker-hour (seeded by --seed)"
    )
    parser.add_argument("--max-workers", type=int, help="local cap on workers for trace replay")
    parser.add_argument(
        "--warm-workers",
        type=int,
        help="processes started ahead of trace arrivals (default 1; 0: arrivals start cold)",
    )
    parser.add_argument(
        "--checkpoint-interval", type=int, help="steps between checkpoints (0: never)"
    )
    parser.add_argument("--store", help="membership store: tcp (hosted by the coordinator) or etcd")
    parser.add_argument(
        "--etcd-endpoint",
        help="host:port of an etcd cluster (its v3 API; etcd 3.4 or later) for --store etcd",
    )
    parser.add_argument(
        "--rescale",
        metavar="STEP:M[,STEP:M...]",
        help="from step STEP on (counted from 1), train on M worker processes (removals by "
        "SIGKILL)",
    )
    parser.add_argument(
        "--inject",
        action="append",
        metavar="SIGNAL:STEP:WORKER[:PHASE]|add:STEP",
        help="during step STEP (counted from 1: kill:10:... hits the step of 'step 10/N'), "
        "SIGKILL (kill), SIGTERM (term, a preemption notice) or SIGSTOP (stop, a hang) local "
        "worker WORKER (in PHASE: forward, backward, send, recv, optimizer, committed); or "
        "add a worker that trains from step STEP on; repeatable",
    )
