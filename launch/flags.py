"""Command-line flags that set config keys, generated from one table, and the commands' parser.

:data:`FLAGS` lists each flag once: its name, the dotted config key it sets (a key of the
``spotline`` section, or a DeepSpeed key) and its help. Its argparse type comes from the
key's field in ``spotline.config``'s dataclasses (or the DeepSpeed default's type), and a flag
value goes through the same strict parser as the file (``spotline.config.with_overrides``),
so a flag is checked exactly like the key it sets. :data:`CONFIG_ONLY` names each config key
that has no flag on purpose, with the reason; ``tests/test_flags.py`` checks that every
config key is in exactly one of the two.

Flags that are not config keys (``--config``, ``--output``, ``--resume``, ``--listen``)
stay with the commands that take them.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, Union

from spotline.config import DEFAULT_DEEPSPEED, SpotlineConfig
from spotline.errors import UserError

Scope = Literal["workers", "run", "recovery"]
"""Which commands take a flag: ``workers`` and ``run`` both Spotline's commands and
DeepSpeed's launcher (``launch/train.py``, whose world size is the number of workers, so
it takes no ``workers`` flag); ``recovery`` only Spotline's commands (they need its
coordinator)."""


@dataclass(frozen=True)
class Flag:
    """``name`` (``--seq-len``) sets config key ``key`` (``spotline.model.seq_len``)."""

    name: str
    key: str
    help: str
    metavar: str | None = None
    scope: Scope = "run"

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value under (``seq_len``)."""
        return self.name.removeprefix("--").replace("-", "_")


FLAGS: tuple[Flag, ...] = (
    Flag(
        "--workers",
        "spotline.topology.workers",
        "worker processes to start (a multiple of --stages)",
        scope="workers",
    ),
    Flag(
        "--start-workers",
        "spotline.topology.start_workers",
        "start training with this many (default: --workers); a coordinator's later "
        "machines join at step boundaries up to --workers",
        scope="workers",
    ),
    Flag("--stages", "spotline.topology.stages", "pipeline stages (logical)"),
    Flag(
        "--memory-per-slot-gb",
        "spotline.topology.memory_per_slot_gb",
        "GiB a worker may hold: a plan whose memory estimate exceeds it is refused at start",
        metavar="GIB",
    ),
    Flag("--steps", "spotline.training.steps", "optimizer steps to train"),
    Flag("--seed", "spotline.training.seed", "seed of the run (data order, init, dropout)"),
    Flag(
        "--model",
        "spotline.model.name",
        "a preset (gpt2-tiny, llama-tiny, ...) or a save_pretrained directory",
    ),
    Flag("--seq-len", "spotline.model.seq_len", "tokens per training sequence"),
    Flag(
        "--data",
        "spotline.data.path",
        "a .txt/.json/.jsonl file, a directory of them, or a saved dataset",
    ),
    Flag(
        "--tokenizer",
        "spotline.data.tokenizer",
        "a tokenizer directory (default: built-in byte-level)",
    ),
    Flag(
        "--instruction-layout",
        "spotline.data.instruction_layout",
        "instruction records: pack (default: whole examples share a row) or pad (one a row)",
    ),
    Flag(
        "--eval-data",
        "spotline.evaluation.data",
        "evaluate on this file or folder (read like --data, same tokenizer and --seq-len)",
    ),
    Flag(
        "--eval-holdout",
        "spotline.evaluation.holdout_fraction",
        "evaluate on this share of --data's rows (chosen by --seed, never trained on)",
        metavar="FRACTION",
    ),
    Flag(
        "--eval-every",
        "spotline.evaluation.interval_steps",
        "evaluate every K steps (and after the last; default: after the last only)",
        metavar="K",
    ),
    Flag(
        "--eval-max-samples",
        "spotline.evaluation.max_samples",
        "evaluate on the eval set's first N rows only (default: all)",
        metavar="N",
    ),
    Flag(
        "--redundancy",
        "spotline.redundancy.mode",
        "off, lazy or eager (Bamboo redundant computation)",
    ),
    Flag(
        "--replica",
        "spotline.redundancy.replica",
        "full (default) or sharded: each of D pipelines' replica holders keeps 1/D of "
        "its successor's state (lazy only)",
    ),
    Flag(
        "--logical-workers",
        "spotline.elasticity.logical_workers",
        "logical data-parallel pipelines N (EasyScale): the math of N pipelines whatever "
        "the number of processes (default: workers / stages)",
    ),
    Flag("--micro-batch-size", "train_micro_batch_size_per_gpu", "sequences per micro-batch"),
    Flag("--micro-batches", "gradient_accumulation_steps", "micro-batches per pipeline per step"),
    Flag("--wandb", "spotline.tracking.wandb", "offline (default), online or disabled"),
    Flag(
        "--deterministic",
        "spotline.determinism.enabled",
        "deterministic kernels, fixed threads, seeds owned by the logical worker (default: "
        "on; --no-deterministic turns them off, and the run says it is not bitwise "
        "reproducible)",
    ),
    Flag(
        "--recovery",
        "spotline.recovery.mode",
        "failover (default: in-memory takeover) or checkpoint-restart",
        scope="recovery",
    ),
    Flag(
        "--trace",
        "spotline.recovery.trace",
        "replay a spot trace (formats: integration/assets/traces/README.md, which ships "
        "public ones)",
        scope="recovery",
    ),
    Flag(
        "--time-scale",
        "spotline.recovery.time_scale",
        "trace seconds played per wall second",
        scope="recovery",
    ),
    Flag(
        "--trace-clock",
        "spotline.recovery.trace_clock",
        "wall (default), or steps: each step is recovery.step_time_estimate_s, idle skipped",
        scope="recovery",
    ),
    Flag(
        "--preempt-rate",
        "spotline.recovery.preempt_rate",
        "random preemptions per worker-hour (seeded by --seed)",
        scope="recovery",
    ),
    Flag(
        "--max-workers",
        "spotline.recovery.max_workers",
        "local cap on workers for trace replay",
        scope="recovery",
    ),
    Flag(
        "--warm-workers",
        "spotline.recovery.warm_workers",
        "processes started ahead of trace arrivals (default 1; 0: arrivals start cold)",
        scope="recovery",
    ),
    Flag(
        "--checkpoint-interval",
        "spotline.checkpoints.interval_steps",
        "steps between checkpoints (0: never)",
        scope="recovery",
    ),
    Flag(
        "--store",
        "spotline.recovery.store",
        "membership store: tcp (hosted by the coordinator) or etcd",
        scope="recovery",
    ),
    Flag(
        "--etcd-endpoint",
        "spotline.recovery.etcd_endpoint",
        "host:port of an etcd cluster (its v3 API; etcd 3.4 or later) for --store etcd",
        scope="recovery",
    ),
    Flag(
        "--rescale",
        "spotline.elasticity.rescale",
        "from step STEP on (counted from 1), train on M worker processes (removals by SIGKILL)",
        metavar="STEP:M[,STEP:M...]",
        scope="recovery",
    ),
    Flag(
        "--inject",
        "spotline.recovery.inject",
        "during step STEP (counted from 1: kill:10:... hits the step of 'step 10/N'), "
        "SIGKILL (kill), SIGTERM (term, a preemption notice) or SIGSTOP (stop, a hang) local "
        "worker WORKER (in PHASE: forward, backward, send, recv, optimizer, committed); or "
        "add a worker that trains from step STEP on; repeatable",
        metavar="SIGNAL:STEP:WORKER[:PHASE]|add:STEP",
        scope="recovery",
    ),
)

_TUNING = "a tuning knob whose default suits most runs: set in the config file"
_TIMEOUT = "a timeout of the recovery machinery: set in the config file"
_DEMO = "for tests and demos: set in the config file"
_SITE = "where and how this site keeps its records: set in the config file"

CONFIG_ONLY: Mapping[str, str] = {
    "spotline.model.overrides": "an object of transformers config attributes: a file's",
    "spotline.model.activation_checkpoint_interval": _TUNING,
    "spotline.export.dtype": "how the finished model is stored, set once a run: a file's",
    "spotline.redundancy.replica_device": _TUNING,
    "spotline.redundancy.verify_replicas": "a correctness check of replicas: " + _DEMO,
    "spotline.redundancy.stages_per_worker": _TUNING,
    "spotline.elasticity.rebalance_every": _TUNING,
    "spotline.elasticity.slow_worker": _DEMO,
    "spotline.elasticity.slow_factor": _DEMO,
    "spotline.checkpoints.dir": _SITE,
    "spotline.checkpoints.keep": _SITE,
    "spotline.checkpoints.on_write_error": _SITE,
    "spotline.recovery.heartbeat_timeout_s": _TIMEOUT,
    "spotline.recovery.term_grace_s": _TIMEOUT,
    "spotline.recovery.collective_timeout_s": _TIMEOUT,
    "spotline.recovery.no_progress_timeout_s": _TIMEOUT,
    "spotline.recovery.trace_removal": "how a trace's removals land: " + _DEMO,
    "spotline.recovery.preempt_seed": "--seed seeds the preemptions unless the file says",
    "spotline.recovery.replace_after_s": _TUNING,
    "spotline.recovery.checkpoint_cost_s": "an estimate for the Young/Daly interval: " + _TUNING,
    "spotline.recovery.step_time_estimate_s": "an estimate for the Young/Daly interval: " + _TUNING,
    "spotline.tracking.project": _SITE,
    "spotline.tracking.run_name": _SITE,
    "spotline.tracking.progress": "the console's progress lines: set in the config file",
    "spotline.tracking.timeline_png": _SITE,
    "spotline.determinism.intra_op_threads": _TUNING,
}
"""Config keys without a flag, on purpose (the value: why); every other key has one."""

FLAG_KEYS: Mapping[str, str] = {flag.dest: flag.key for flag in FLAGS}
"""Flag dest -> the dotted config key it sets."""


def key_type(key: str) -> Any:
    """The type of config key ``key``'s value, ``None`` taken out of an optional one: its
    field's in the ``spotline`` section's dataclasses, its default's for a DeepSpeed key."""
    head, *path = key.split(".")
    if head != "spotline":
        assert not path and key in DEFAULT_DEEPSPEED, f"{key} is no DeepSpeed key Spotline sets"
        return type(DEFAULT_DEEPSPEED[key])
    tp: Any = SpotlineConfig
    for part in path:
        hints = typing.get_type_hints(tp)
        assert part in hints, f"{key} is no config key"
        tp = hints[part]
    if typing.get_origin(tp) in (Union, types.UnionType):
        (tp,) = [arm for arm in typing.get_args(tp) if arm is not type(None)]
    return tp


def _add(parser: argparse.ArgumentParser, flag: Flag) -> None:
    tp = key_type(flag.key)
    kwargs: dict[str, Any] = {"help": flag.help}
    if flag.metavar is not None:
        kwargs["metavar"] = flag.metavar
    if tp is bool:
        # --flag and --no-flag; absent (None), the file's value stands.
        kwargs.update(action=argparse.BooleanOptionalAction, default=None)
    elif typing.get_origin(tp) is list:
        assert typing.get_args(tp) == (str,), f"{flag.key}: a list flag takes strings"
        kwargs["action"] = "append"  # repeatable: each use adds one item
    elif tp in (int, float):
        kwargs["type"] = tp
    else:
        # No argparse choices for a string or a Literal: the config parser refuses a wrong
        # value with the key's name and what it expects, as it does for the file.
        assert tp is str or typing.get_origin(tp) is Literal, f"{flag.key}: {tp!r}"
    parser.add_argument(flag.name, **kwargs)


def add_run_flags(parser: argparse.ArgumentParser, *, with_workers: bool) -> None:
    """The flags both Spotline's commands and DeepSpeed's launcher take (``with_workers``:
    the worker counts too, which DeepSpeed's launcher decides itself)."""
    scopes = ("workers", "run") if with_workers else ("run",)
    for flag in FLAGS:
        if flag.scope in scopes:
            _add(parser, flag)


def add_recovery_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of the local launcher only: they need Spotline's coordinator."""
    for flag in FLAGS:
        if flag.scope == "recovery":
            _add(parser, flag)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``{config key: value}`` of the flags given (a flag not given, or not taken by the
    command that parsed ``args``, is absent)."""
    out: dict[str, Any] = {}
    for flag in FLAGS:
        value = getattr(args, flag.dest, None)
        if value is not None:
            out[flag.key] = list(value) if isinstance(value, list) else value
    return out


class UsageErrorParser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as a UserError (the command prints it as one
    ``spotline: error:`` line and exits 2) instead of printing its usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; see {self.prog} --help")
