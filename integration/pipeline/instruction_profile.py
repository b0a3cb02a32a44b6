"""Where a pipeline step's time goes: seconds per schedule instruction, per rank.

Set ``SPOTLINE_INSTRUCTION_PROFILE`` to a folder and every pipeline engine of the process
(Spotline's, and the stock ``PipelineEngine`` of ``spotline bench profile``) times each
instruction it executes (``ForwardPass``, ``ReduceGrads``, ``ReplicaStep``, ...) and writes
``<folder>/<name>.json``: seconds and calls by instruction, and the steps measured. A
waiting instruction (``RecvActivations``) holds the time its peer made it wait: the
pipeline's bubbles show there. Unset, nothing is wrapped. Pure: no torch.

Each instruction is timed three ways: on the wall clock, in the process's CPU time (every
thread: gloo's collectives and socket writes run on threads of their own) and in the CPU
time of the thread that runs the schedule. Wall less process CPU is waiting, so a profile
tells the work a variant adds from the waits it causes; with more processes than cores, the
step is the CPU summed over the ranks. Process CPU less the schedule thread's is what the
other threads did meanwhile (the transfers' copies). CPU time stands still while the
process is stopped (SIGSTOP), so CPU figures hold for runs that take turns on the host.
The process's first optimizer step is left out (its one-off costs: allocations, first
collectives), and the time between two
optimizer steps' ends is counted as the step, so what a step spends outside the schedule
(the loop, the loss, the store) is measured, not inferred.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_ENV = "SPOTLINE_INSTRUCTION_PROFILE"


STEP = "OptimizerStep"
# The whole step (from one optimizer step's end to the next's), wall and CPU: the key in
# ``seconds`` and ``cpu_seconds`` beside the instructions'.
WHOLE_STEP = "step"

Clocks = tuple[float, float, float]

# Events a profile keeps for its timeline: a step of 2 stages x 4 micro-batches runs about
# 25 instructions and 3 parts, so this covers the hundreds of steps of a bench round whose
# jobs take turns (its idle account needs the steps of every turn, the last ones too);
# bounded (a few MB) so that a long run holds no more than this.
TIMELINE_EVENTS = 20_000


@dataclass(frozen=True)
class InstructionSpan:
    """One instruction run: its name, the step it belongs to (counted from the profile's
    first measured step) and its start and end on the host's wall clock (``time.time``:
    comparable across the processes of a host), so the ranks' timelines line up."""

    name: str
    step: int
    start: float
    end: float


def _clocks() -> Clocks:
    """The three clocks an instruction is timed on: wall, the process's CPU, and the CPU of
    the calling thread (the schedule's)."""
    return time.perf_counter(), time.process_time(), time.thread_time()


@dataclass
class InstructionProfile:
    """Seconds (wall and CPU) and calls by instruction name, summed over the steps of one
    process after its first."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    # The CPU of the thread that ran the instructions (the schedule's thread) alone.
    thread_cpu_seconds: dict[str, float] = field(default_factory=dict)
    # The first TIMELINE_EVENTS instructions measured, in order.
    events: list[InstructionSpan] = field(default_factory=list)
    # The pipeline stage of the engine last instrumented (None: not a pipeline engine's):
    # which ranks are a stage's data-parallel peers.
    stage: int | None = None
    # (wall, process CPU, thread CPU) clocks at the end of the last optimizer step; None
    # before the first.
    _mark: Clocks | None = field(default=None, repr=False, compare=False)

    @property
    def steps(self) -> int:
        """Optimizer steps measured: one ``OptimizerStep`` instruction each."""
        return self.calls.get(STEP, 0)

    def add(
        self,
        name: str,
        seconds: float,
        cpu_seconds: float = 0.0,
        thread_cpu_seconds: float = 0.0,
        span: tuple[float, float] | None = None,
    ) -> None:
        """One instruction's ``seconds`` on the wall clock, ``cpu_seconds`` of the process's
        CPU and ``thread_cpu_seconds`` of the calling thread's; the calling thread must be
        the one that runs the schedule (its clock marks the whole step). ``span``: its
        start and end in ``time.time``, for the timeline (None: not on it)."""
        if self._mark is None:
            # Before the first optimizer step's end: one-off costs, not counted.
            if name == STEP:
                self._mark = _clocks()
            return
        if span is not None:
            self.add_part(name, *span)
        totals = (self.seconds, self.cpu_seconds, self.thread_cpu_seconds)
        for into, value in zip(totals, (seconds, cpu_seconds, thread_cpu_seconds), strict=True):
            into[name] = into.get(name, 0.0) + value
        self.calls[name] = self.calls.get(name, 0) + 1
        if name == STEP:
            now = _clocks()
            for into, end, start in zip(totals, now, self._mark, strict=True):
                into[WHOLE_STEP] = into.get(WHOLE_STEP, 0.0) + end - start
            self._mark = now

    def add_part(self, name: str, start: float, end: float) -> None:
        """``name`` from ``start`` to ``end`` (``time.time``) on the timeline only: a part of
        an instruction, whose time is its instruction's already (and :meth:`add`'s event)."""
        if self._mark is not None and len(self.events) < TIMELINE_EVENTS:
            self.events.append(InstructionSpan(name, self.steps, start, end))

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "thread_cpu_seconds": self.thread_cpu_seconds,
            "calls": self.calls,
            "steps": self.steps,
            "events": [[e.name, e.step, e.start, e.end] for e in self.events],
            "stage": self.stage,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> InstructionProfile:
        return cls(
            dict(raw["seconds"]),
            dict(raw["calls"]),
            dict(raw.get("cpu_seconds", {})),
            # Profiles written before the schedule thread's CPU was kept have none.
            dict(raw.get("thread_cpu_seconds", {})),
            # Profiles written before the timeline have none.
            [
                InstructionSpan(str(n), int(k), float(a), float(b))
                for n, k, a, b in raw.get("events", [])
            ],
            # Profiles written before the stage was kept have none.
            raw.get("stage"),
        )

    def per_step(self) -> dict[str, float]:
        """Wall seconds per step by instruction (the steps measured, at least one); the
        whole step under ``WHOLE_STEP``."""
        return self._per_step(self.seconds)

    def cpu_per_step(self) -> dict[str, float]:
        """CPU seconds per step by instruction; the whole step under ``WHOLE_STEP``."""
        return self._per_step(self.cpu_seconds)

    def thread_cpu_per_step(self) -> dict[str, float]:
        """The schedule thread's CPU seconds per step by instruction (``WHOLE_STEP``: the
        whole step's)."""
        return self._per_step(self.thread_cpu_seconds)

    def _per_step(self, totals: Mapping[str, float]) -> dict[str, float]:
        # Over the steps measured, at least one.
        return {k: v / max(1, self.steps) for k, v in totals.items()}


def profile_dir() -> Path | None:
    value = os.environ.get(PROFILE_ENV)
    return Path(value) if value else None


def timed_map(
    instruction_map: Mapping[type, Callable[..., Any]], profile: InstructionProfile
) -> dict[type, Callable[..., Any]]:
    """``instruction_map`` with every handler timed into ``profile`` by instruction name."""

    def timed(name: str, handler: Callable[..., Any]) -> Callable[..., Any]:
        def run(engine: Any, **kwargs: Any) -> Any:
            began, start = time.time(), _clocks()
            try:
                return handler(engine, **kwargs)
            finally:
                wall, cpu, thread = (end - s for end, s in zip(_clocks(), start, strict=True))
                profile.add(name, wall, cpu, thread, span=(began, time.time()))

        return run

    return {cls: timed(cls.__name__, handler) for cls, handler in instruction_map.items()}


# Parts of an instruction put on the timeline as their own events, where an engine has
# them: the attribute a callable is under -> its event's name.
TIMELINE_PARTS = {
    "commit_barrier": "CommitBarrier",
    "aggregate_loss_before_commit": "LossBeforeCommit",
    # DeepSpeed's, after the schedule (Spotline's returns the loss computed before the commit).
    "_aggregate_total_loss": "LossAfterSchedule",
}


def instrument(engine: Any, profile: InstructionProfile) -> None:
    """Time ``engine``'s instructions into ``profile`` (on the instance's own map: the
    class's map and every other engine stay as they are), put the parts of TIMELINE_PARTS
    it has on the timeline, and note its pipeline stage. The map timed is the one the
    engine dispatches through: its own where it built one (Spotline's engines), else its
    class's (DeepSpeed's)."""
    engine._INSTRUCTION_MAP = timed_map(engine._INSTRUCTION_MAP, profile)
    stage = getattr(engine, "stage_id", None)
    profile.stage = None if stage is None else int(stage)
    for attribute, name in TIMELINE_PARTS.items():
        part = getattr(engine, attribute, None)
        if part is not None:
            setattr(engine, attribute, _on_timeline(part, name, profile))


def _on_timeline(
    part: Callable[[], Any], name: str, profile: InstructionProfile
) -> Callable[[], Any]:
    def run() -> Any:
        start = time.time()
        try:
            return part()
        finally:
            profile.add_part(name, start, time.time())

    return run


def write_profile(profile: InstructionProfile, name: str) -> None:
    """``<folder>/<name>.json`` (replaced whole: a later generation adds to the figures)."""
    from spotline.atomic_files import write_json_atomic

    folder = profile_dir()
    assert folder is not None, "write_profile without SPOTLINE_INSTRUCTION_PROFILE"
    write_json_atomic(folder / f"{name}.json", profile.to_json())
