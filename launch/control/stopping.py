"""The stop a first Ctrl-C asks for: at the next step boundary that has a checkpoint.

The protocol, in the order it runs:

1. :meth:`StopProtocol.request` (from the SIGINT handler: it only sets a flag).
2. :meth:`StopProtocol.apply`, at the coordinator's next full watch turn: the stop's step
   is chosen (:func:`stop_target`: a little ahead of the members' progress, so that every
   member sees it in time, rounded up to the checkpoint interval, never past the run's
   last step) and said on one line; the generation in flight is told.
3. :meth:`StopProtocol.stop_keys`, for that generation and every one planned after it
   (before its plan is published): ``stop-checkpoint/<g>`` (the members checkpoint the
   stop's step) and then ``stop/<g>`` (they stop there; a later boundary asked for by an
   arrival moves to the stop). A stop at or past the run's end writes nothing: the run
   finishes as usual.
4. The generation ends with every member at the boundary (:func:`~spotline.launch.control.
   outcomes.classify` tells it ``STOPPED``); the coordinator commits the stop's checkpoint
   and raises :class:`~spotline.launch.coordinator.Stopped`. A second Ctrl-C is the
   caller's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from spotline.launch.control.checkpoints import CheckpointCommits
from spotline.launch.control.job_state import JobState
from spotline.wire.protocol import Store, stop_checkpoint_key, stop_key


def stop_target(progress: int, interval_steps: int, steps: int) -> int:
    """Where a stop asked for at ``progress`` lands: the first checkpointed boundary two
    steps ahead or more (every member sees it in time), or the run's last step first."""
    ahead = progress + 2
    target = -(-ahead // interval_steps) * interval_steps if interval_steps > 0 else ahead
    return min(target, steps)


def _say(line: str) -> None:
    print(f"spotline: {line}", file=sys.stderr, flush=True)


class StopProtocol:
    """The stop of one job (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        checkpoints: CheckpointCommits,
        state: JobState,
        *,
        steps: int,
        say: Callable[[str], None] = _say,
    ) -> None:
        self.store = store
        self.checkpoints = checkpoints
        self.state = state
        self.steps = steps  # the run's last step
        self.say = say
        self.requested = False
        self.target: int | None = None  # chosen by apply()
        self.applied: set[int] = set()  # generations told about the stop

    def request(self) -> None:
        """A first Ctrl-C (called from a signal handler: it only sets a flag)."""
        self.requested = True

    def apply(self, progress: int) -> None:
        """After :meth:`request`: choose where the job stops, from the members' ``progress``,
        and tell the current generation (once)."""
        if not self.requested or self.target is not None:
            return
        self.target = stop_target(progress, self.checkpoints.interval_steps, self.steps)
        if self.target < self.steps:
            line = f"stopping at step {self.target} after its checkpoint"
        else:
            line = f"the run ends at step {self.target} before a checkpoint would: finishing"
        self.say(f"{line} (Ctrl-C again to stop at once)")
        self.stop_keys(self.state.generation)

    def stop_keys(self, generation: int) -> None:
        """``stop-checkpoint/<g>`` and ``stop/<g>`` for the stop chosen (generations planned
        after it get them before their plan is published); once a generation."""
        if self.target is None or generation in self.applied:
            return
        self.applied.add(generation)
        target = max(self.target, self.state.resume_step)
        if target >= self.steps:
            return  # the run ends first: it finishes as usual
        # Always: an exposed plan's schedule (spotline.plan.exposure) may skip the interval's
        # steps, and a step written by both is committed once.
        self.checkpoints.extra.add(target)
        # Set before stop/<g>: a member that sees the stop must see where to checkpoint.
        self.store.set(stop_checkpoint_key(generation), str(target))
        key = stop_key(generation)
        if not self.store.check([key]) or int(self.store.get(key).decode()) > target:
            # An arrival's boundary that comes later moves to the stop (no member has
            # passed it: the target is ahead of every member).
            self.store.set(key, str(target))
