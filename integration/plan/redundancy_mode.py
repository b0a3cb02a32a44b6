"""The redundancy modes: the one declaration of what ``spotline.redundancy.mode`` may say.

``off`` keeps no replica; ``lazy`` keeps each stage's replica on its predecessor and what a
replay of it needs; ``eager`` also runs the replica's forward passes in the pipeline's
bubbles (``spotline.plan.schedule.add_redundancy`` builds each mode's schedule). The config
(``spotline.config.RedundancySection``), the schedule and the engine all take this type.

Pure: no torch or DeepSpeed import.
"""

from __future__ import annotations

from typing import Literal, get_args

RedundancyMode = Literal["off", "lazy", "eager"]
REDUNDANCY_MODES: tuple[RedundancyMode, ...] = get_args(RedundancyMode)


def redundancy_on(mode: RedundancyMode) -> bool:
    """Whether ``mode`` keeps replicas (every mode but ``off``)."""
    return mode != "off"
