"""The job as the coordinator's parts share it: what was published, and how far it got.

:class:`JobState` is what the coordinator has told the workers: the generation in flight,
its plan's layout and resume step, which workers were given an entry generation, and when
the last generation's first member reported. The planner
(:class:`~spotline.launch.control.recovery.GenerationPlanner`) writes the plan's fields, the
generation loop the number and the end; every other part only reads them.

:class:`Progress` reads how far the members of the generation in flight got (the highest
step one has started), once per watch turn when asked to, and asks them to stop at a step
boundary a little ahead of it (an arrival, a departure).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.supervisor import Supervisor
from spotline.plan.grid import Layout
from spotline.wire.auth import AuthStore
from spotline.wire.protocol import progress_key, stop_key


@dataclass
class JobState:
    """What the coordinator has told the workers (see the module docstring)."""

    generation: int = 0
    # When the last generation's first member reported (the clock of a change without a
    # failure starts there); None: no generation has ended yet.
    generation_end_t: float | None = None
    layout: Layout | None = None  # the current plan's (None: nothing trains)
    resume_step: int = 0  # the step the current plan resumes from
    included: set[str] = field(default_factory=set)  # workers given an entry generation

    def members(self) -> list[str]:
        return [] if self.layout is None else list(self.layout.members)


class Progress:
    """The members' progress as the store holds it (``progress/<g>/<w>``)."""

    def __init__(
        self, store: AuthStore, supervisor: Supervisor, metrics: RunMetrics, state: JobState
    ) -> None:
        self.store = store
        self.supervisor = supervisor
        self.metrics = metrics
        self.state = state
        # The progress read at the start of a watch turn (None: between turns, where every
        # max_progress() reads the store).
        self._turn: int | None = None

    def max_progress(self) -> int:
        """The highest step a member of the current generation has started.

        Within a watch turn (:meth:`turn`) the value read at its start: a turn asks for it
        five times, and each read is two store round trips a worker, 50 times a second (on
        a small host the coordinator's polling took CPU from the workers)."""
        if self._turn is not None:
            return self._turn
        return self.read()

    def read(self) -> int:
        """The progress as the store holds it now (the plan's resume step before any)."""
        best = self.state.resume_step
        for w in self.supervisor.live_ids():
            value = self.store.read(progress_key(self.state.generation, w))
            if value is not None:
                best = max(best, int(value.decode()))
                if self.metrics.first_step_t is None:
                    self.metrics.first_step_t = time.monotonic()
        return best

    @contextmanager
    def turn(self) -> Iterator[int]:
        """A watch turn: the progress read once at its start, and kept until it ends."""
        self._turn = None
        self._turn = progress = self.read()
        try:
            yield progress
        finally:
            self._turn = None

    def request_boundary(self, at_step: int | None = None) -> None:
        """Ask the members to stop at a step boundary (``at_step``, or a little ahead so that
        every member sees it in time)."""
        key = stop_key(self.state.generation)
        if not self.store.check([key]):
            ahead = self.max_progress() + 2
            self.store.set(key, str(ahead if at_step is None else max(at_step, ahead)))

    def placement(self) -> dict[str, str]:
        """What each live worker does now, for the timeline ("p0:s1", "standby", "joining")."""
        placement = {}
        layout = self.state.layout
        if layout is not None:
            for w in self.supervisor.live_ids():
                placement[w] = (
                    layout.describe(w) if w in layout.members or w in layout.standby else "joining"
                )
        return placement

    def snapshot(self) -> tuple[int, int, dict[str, str]]:
        """The metrics' view of the run now: progress, live workers, placement."""
        return self.max_progress(), len(self.supervisor.live_ids()), self.placement()
