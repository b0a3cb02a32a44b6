"""Whether a config may continue a stopped run (``--resume``): every key that decides the
math must be the one the stopped run had. Pure."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from spotline.config import RunConfig

# DeepSpeed keys that change what is printed or profiled, never the parameters.
_DEEPSPEED_NOT_MATH = frozenset(
    {
        "steps_per_print",
        "wall_clock_breakdown",
        "memory_breakdown",
        "dump_state",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "flops_profiler",
    }
)


def _first_difference(path: str, old: Any, new: Any) -> str | None:
    """The dotted path of the first (sorted) key where two JSON values differ, or None."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if key not in old or key not in new:
                return f"{path}.{key}" if path else key
            found = _first_difference(f"{path}.{key}" if path else key, old[key], new[key])
            if found is not None:
                return found
        return None
    return None if old == new else path


def _lookup(raw: Mapping[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def resume_mismatch(stopped: RunConfig, resumed: RunConfig) -> str | None:
    """Why ``resumed`` cannot continue the run ``stopped`` was (None: it can).

    Everything that decides the math must be equal: every DeepSpeed key but printing and
    profiling ones (micro-batch size, gradient accumulation, optimizer, scheduler, clipping,
    precision), the model, the data, the evaluation (a held-out fraction decides the rows
    trained on; the rest, what the evaluations of the stopped run were), the seed, the
    logical topology (stages and logical workers) and determinism. Placement, redundancy, recovery, checkpointing and tracking may
    change; the number of steps may only grow. The answer is one line naming the key.
    """
    old_ds = {k: v for k, v in stopped.deepspeed.items() if k not in _DEEPSPEED_NOT_MATH}
    new_ds = {k: v for k, v in resumed.deepspeed.items() if k not in _DEEPSPEED_NOT_MATH}
    old_json, new_json = stopped.to_json(), resumed.to_json()
    key = _first_difference("", old_ds, new_ds)
    if key is None:
        old_sl = old_json["spotline"]
        new_sl = new_json["spotline"]
        for section in ("model", "data", "evaluation", "determinism"):
            key = _first_difference(f"spotline.{section}", old_sl[section], new_sl[section])
            if key is not None:
                break
    if key is None:
        for dotted in ("spotline.training.seed", "spotline.topology.stages"):
            if _lookup(old_json, dotted) != _lookup(new_json, dotted):
                key = dotted
                break
    if key is None and stopped.num_logical_workers != resumed.num_logical_workers:
        return (
            f"spotline.elasticity.logical_workers is {resumed.num_logical_workers} here but "
            f"{stopped.num_logical_workers} in the stopped run; it decides the math and must match "
            f"(pass --logical-workers {stopped.num_logical_workers})"
        )
    if key is not None:
        old_value, new_value = _lookup(old_json, key), _lookup(new_json, key)
        return (
            f"{key} is {json.dumps(new_value)} here but {json.dumps(old_value)} in the stopped "
            "run; it decides the math and must match"
        )
    if resumed.spotline.training.steps < stopped.spotline.training.steps:
        return (
            f"spotline.training.steps is {resumed.spotline.training.steps} here but "
            f"{stopped.spotline.training.steps} in the stopped run; a resume may only extend a run"
        )
    return None
