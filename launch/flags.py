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
    "stages": "spotline.topology.stages",
    "steps": "spotline.training.steps",
    "seed": "spotline.training.seed",
    "model": "spotline.model.name",
    "seq_len": "spotline.model.seq_len",
    "data": "spotline.data.path",
    "tokenizer": "spotline.data.tokenizer",
    "redundancy": "spotline.redundancy.mode",
    "wandb": "spotline.tracking.wandb",
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "micro_batches": "gradient_accumulation_steps",
}


def add_run_flags(parser: argparse.ArgumentParser, *, with_workers: bool) -> None:
    if with_workers:
        parser.add_argument(
            "--workers", type=int, help="worker processes to start (a multiple of --stages)"
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
    parser.add_argument("--redundancy", help="off, lazy or eager (Bamboo redundant computation)")
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
    return out
