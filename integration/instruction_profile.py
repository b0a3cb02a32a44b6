"""Where a pipeline step's time goes: seconds per schedule instruction, per rank.

Set ``SPOTLINE_INSTRUCTION_PROFILE`` to a folder and every pipeline engine of the process
(Spotline's, and the stock ``PipelineEngine`` of ``spotline bench profile``) times each
instruction it executes (``ForwardPass``, ``ReduceGrads``, ``ReplicaStep``, ...) and writes
``<folder>/<name>.json``: seconds and calls by instruction, and the steps measured. A
waiting instruction (``RecvActivations``) holds the time its peer made it wait: the
pipeline's bubbles show there. Unset, nothing is wrapped. Pure: no torch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_ENV = "SPOTLINE_INSTRUCTION_PROFILE"


@dataclass
class InstructionProfile:
    """Seconds and calls by instruction name, summed over the steps of one process."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """Optimizer steps run: one ``OptimizerStep`` instruction each."""
        return self.calls.get("OptimizerStep", 0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "calls": self.calls, "steps": self.steps}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> InstructionProfile:
        return cls(dict(raw["seconds"]), dict(raw["calls"]))

    def per_step(self) -> dict[str, float]:
        """Seconds per step by instruction (the steps measured, at least one)."""
        return {k: v / max(1, self.steps) for k, v in self.seconds.items()}


def profile_dir() -> Path | None:
    value = os.environ.get(PROFILE_ENV)
    return Path(value) if value else None


def timed_map(
    instruction_map: Mapping[type, Callable[..., Any]], profile: InstructionProfile
) -> dict[type, Callable[..., Any]]:
    """``instruction_map`` with every handler timed into ``profile`` by instruction name."""

    def timed(name: str, handler: Callable[..., Any]) -> Callable[..., Any]:
        def run(engine: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return handler(engine, **kwargs)
            finally:
                profile.add(name, time.perf_counter() - t0)

        return run

    return {cls: timed(cls.__name__, handler) for cls, handler in instruction_map.items()}


def instrument(engine: Any, profile: InstructionProfile) -> None:
    """Time ``engine``'s instructions into ``profile`` (on the instance's own map: the
    class's map and every other engine stay as they are)."""
    engine._INSTRUCTION_MAP = timed_map(type(engine)._INSTRUCTION_MAP, profile)


def write_profile(profile: InstructionProfile, name: str) -> None:
    """``<folder>/<name>.json`` (replaced whole: a later generation adds to the figures)."""
    from spotline.tracking import write_json_atomic

    folder = profile_dir()
    assert folder is not None, "write_profile without SPOTLINE_INSTRUCTION_PROFILE"
    write_json_atomic(folder / f"{name}.json", profile.to_json())
