"""How often to checkpoint: Young and Daly's interval, the one formula the runtime, the
exposure report and the simulator all use."""

from __future__ import annotations

import math


def young_daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """The Young/Daly checkpoint interval ``sqrt(2 * C * MTBF)`` in seconds: the period that
    minimises checkpoint cost plus expected lost work, for a checkpoint that costs
    ``checkpoint_cost_s`` and fatal losses ``mtbf_s`` apart on average."""
    for name, value in (("checkpoint_cost_s", checkpoint_cost_s), ("mtbf_s", mtbf_s)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be finite and > 0, got {value}")
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def interval_steps(step_time_s: float, checkpoint_cost_s: float, mtbf_s: float) -> int:
    """The Young/Daly interval in whole steps: ``floor(interval / step_time_s)``, at least 1
    (rounding down checkpoints no later than the optimum)."""
    if not math.isfinite(step_time_s) or step_time_s <= 0:
        raise ValueError(f"step_time_s must be finite and > 0, got {step_time_s}")
    return max(1, math.floor(young_daly_interval_s(checkpoint_cost_s, mtbf_s) / step_time_s))


def modelled_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """The simulator's interval: Young/Daly's, except that a checkpoint that costs nothing (a
    calibration without a save time) is modelled as taken at every chance, 0 s apart. The
    runtime never asks for that: a real checkpoint always costs something."""
    if checkpoint_cost_s == 0:
        return 0.0
    return young_daly_interval_s(checkpoint_cost_s, mtbf_s)
