"""The watch over a running generation: one turn after another until every member reported.

:meth:`Watch.collect_reports` runs generation ``g`` until every expected worker has
reported or is gone; each :meth:`Watch.turn` checks, in order:

- the local agent (it must outlive the job), and whether the turn may be quiet
  (:class:`QuietTurns`: no key added to the store since the last full turn, which is under
  FULL_TURN_S old, and nothing due from this side): a quiet turn only checks the
  heartbeats;
- exits and lost machines (:class:`Losses`: a lost member aborts its generation's
  collectives and starts the recovery clock), machines that joined;
- the members' progress (read once a turn, :meth:`~.job_state.Progress.turn`), the
  workers' heartbeats (:class:`HeartbeatPacer`: a hung worker is killed), the no-progress
  limit (:class:`StallWatch`), faults due, arrivals, a requested stop, checkpoint errors and
  commits, progress lines, evaluations, and departures (a worker that wrote ``leaving``).

A member hung while its peers reported long ago is killed (``unresponsive``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from spotline.launch.control.admission import Admitter
from spotline.launch.control.checkpoints import CheckpointCommits
from spotline.launch.control.faults import FaultDelivery
from spotline.launch.control.job_state import JobState, Progress
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.recovery import POLL_S
from spotline.launch.control.stopping import StopProtocol
from spotline.launch.control.supervisor import Supervisor
from spotline.wire.auth import AuthStore
from spotline.wire.protocol import Report, abort_entries, leaving_key, report_key

# How often the watch reads the workers' heartbeats (a tenth of the timeout when shorter).
HEARTBEAT_CHECK_S = 0.25
# The longest pause between two turns of a generation's watch while nothing happens.
IDLE_POLL_S = 0.1
# The longest a quiet watch turn defers a full one.
FULL_TURN_S = 0.5
# A worker that has not reported this long after the generation's first member (past the
# collectives' timeout) is hung: its peers reported long ago.
UNRESPONSIVE_AFTER_S = 5.0
# Checkpoints are committed while a generation runs, at most this often.
COMMIT_CHECK_S = 0.5


class KeyCount(Protocol):
    def num_keys(self) -> int: ...


class QuietTurns:
    """Which watch turns may be quiet: those that find the store's key count as the last
    full turn left it, within FULL_TURN_S of that turn."""

    def __init__(self, store: KeyCount, full_turn_s: float = FULL_TURN_S) -> None:
        self.store = store
        self.full_turn_s = full_turn_s
        self._count = -1  # the key count the last full turn started from
        self._full_t = -float("inf")

    def quiet(self, now: float) -> bool:
        count = self.store.num_keys()
        if count == self._count and now - self._full_t < self.full_turn_s:
            return True
        # Counted before the full turn's reads: a key added during them is seen next turn.
        self._count, self._full_t = count, now
        return False


class HeartbeatChecks(Protocol):
    def check_heartbeats(self, limit_s: float) -> None: ...


class HeartbeatPacer:
    """The workers' heartbeats, checked a few times a second (every turn asks)."""

    def __init__(
        self,
        supervisor: HeartbeatChecks,
        limit_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.supervisor = supervisor
        self.limit_s = limit_s
        self.clock = clock
        self.last = 0.0

    def check(self) -> None:
        if self.clock() - self.last >= min(HEARTBEAT_CHECK_S, self.limit_s / 10):
            # A heartbeat is seconds old before it counts as missed: a few checks a second
            # see it in time, at a tenth of the store traffic of one every turn.
            self.last = self.clock()
            self.supervisor.check_heartbeats(self.limit_s)


def no_progress_message(limit_s: float, preempted: int, started: int, *, clock: str) -> str:
    """One line: the run stalls because preemptions outpace start-ups, and what to change."""
    advice = (
        "replay on the step clock (--trace-clock steps), lower --time-scale, or start more "
        "warm workers (--warm-workers)"
        if clock == "wall"
        else "lower --time-scale or --preempt-rate, or start more warm workers (--warm-workers)"
    )
    return (
        f"no step committed in {limit_s:g} s while {preempted} worker(s) were preempted and "
        f"{started} started: preemptions outpace start-ups, so the run would never progress; "
        f"{advice} (recovery.no_progress_timeout_s sets the limit)"
    )


class StallWatch:
    """The no-progress limit (``recovery.no_progress_timeout_s``): a run that committed no
    step for that long while workers were preempted (on the wall clock, faster than they
    start and join) cannot progress, and stops.

    ``read``: the members' progress, the preemptions so far and the workers ever started."""

    def __init__(
        self,
        limit_s: float,
        trace_clock: str,
        read: Callable[[], tuple[int, int, int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit_s = limit_s
        self.trace_clock = trace_clock
        self.read = read
        self.clock = clock
        self.progress = 0  # the last progress seen
        self.since = clock()  # when a step last committed
        self.marks = (0, 0)  # the preemption and start counts at that moment

    def observe(self, progress: int, preemptions: int, started: int, now: float) -> str | None:
        """Note the counts at ``now``; why the run stalls (None: it does not)."""
        if progress > self.progress:
            # Starting a step means the one before it committed (a redone one too).
            self.since, self.marks = now, (preemptions, started)
        self.progress = progress  # after a fallback progress goes back: from there
        preempted = preemptions - self.marks[0]
        if self.limit_s <= 0 or now - self.since < self.limit_s or preempted == 0:
            return None
        return no_progress_message(
            self.limit_s, preempted, started - self.marks[1], clock=self.trace_clock
        )

    def check(self) -> None:
        """RuntimeError if the run stalls."""
        message = self.observe(*self.read(), self.clock())
        if message is not None:
            raise RuntimeError(message)


class Losses:
    """Workers that exited, and those of a machine lost: a member's loss aborts its
    generation's collectives at once and starts the recovery clock."""

    def __init__(
        self,
        store: AuthStore,
        supervisor: Supervisor,
        metrics: RunMetrics,
        state: JobState,
        *,
        machine_timeout_s: float | None,
    ) -> None:
        """``machine_timeout_s``: a cluster's machine is lost when its agent is quiet this
        long (None: the one local machine, whose agent is the coordinator's child)."""
        self.store = store
        self.supervisor = supervisor
        self.metrics = metrics
        self.state = state
        self.machine_timeout_s = machine_timeout_s

    def poll(self) -> list[str]:
        """The workers that exited since the last call, and those of a machine lost."""
        sup = self.supervisor
        died = sup.poll(machine_timeout_s=self.machine_timeout_s)
        members = self.state.members()
        for w in died:
            if sup[w].fate in ("killed", "crashed") and w in members:
                self.metrics.pending_failure_t = (
                    self.metrics.pending_failure_t or self.metrics.now()
                )
                # Members waiting in the commit barrier (or blocked on a machine gone
                # silent) leave it at once: their abort watches wait on these keys.
                for key, value in abort_entries(self.state.generation, members, w):
                    self.store.set(key, value)
        return died


class Watch:
    """A generation's watch (see the module docstring)."""

    def __init__(
        self,
        *,
        store: AuthStore,
        supervisor: Supervisor,
        metrics: RunMetrics,
        state: JobState,
        progress: Progress,
        losses: Losses,
        heartbeats: HeartbeatPacer,
        stall: StallWatch,
        faults: FaultDelivery,
        admission: Admitter,
        stop: StopProtocol,
        checkpoints: CheckpointCommits,
        check_agent: Callable[[], None],
        collective_timeout_s: float,
    ) -> None:
        """``check_agent``: raises if the local agent is gone (a no-op on a cluster)."""
        self.store = store
        self.supervisor = supervisor
        self.metrics = metrics
        self.state = state
        self.progress = progress
        self.losses = losses
        self.heartbeats = heartbeats
        self.stall = stall
        self.faults = faults
        self.admission = admission
        self.stop = stop
        self.checkpoints = checkpoints
        self.check_agent = check_agent
        self.collective_timeout_s = collective_timeout_s
        self.quiet_turns = QuietTurns(store)
        self.last_commit_check = 0.0
        self._last_turn_progress = -1

    def collect_reports(self, g: int, expected: set[str]) -> dict[str, Report]:
        """Run generation ``g`` until every expected worker has reported or is gone; its
        reports. Notes when its first member reported (``state.generation_end_t``)."""
        first_report_t: float | None = None
        reports: dict[str, Report] = {}
        sup = self.supervisor
        pause = POLL_S
        while True:
            changed = self.turn()
            # A quiet turn (None) saw no key added: no report either.
            if changed is not None and self._read_reports(g, expected, reports):
                # Only a member's report means the generation has ended: a standby reports
                # at once and must not start the clock on the members, who may rightly
                # train for hours.
                first_report_t = first_report_t or self.metrics.now()
            waiting_on = [w for w in expected if sup[w].alive and w not in reports]
            if not waiting_on and expected:
                break
            if (
                first_report_t is not None
                and waiting_on
                and self.metrics.now() - first_report_t
                > self.collective_timeout_s + UNRESPONSIVE_AFTER_S
            ):
                for w in waiting_on:  # hung: its peers reported long ago
                    if sup[w].fate != "killed":  # told once; its agent reports the exit
                        self.metrics.event("unresponsive", worker=w)
                        sup.kill(w, "killed")
            time.sleep(pause)
            # While nothing happens and nothing is due, the pause doubles up to
            # IDLE_POLL_S: a turn costs store round trips for every worker, CPU time the
            # workers of a small host lose. A lost worker's peers fail their collectives
            # and abort on their own; an exit or a new step brings the pause back down.
            quiet = not changed and first_report_t is None and self.faults.quiet()
            pause = min(IDLE_POLL_S, 2 * pause) if quiet else POLL_S
        self.state.generation_end_t = first_report_t
        return reports

    def turn(self) -> bool | None:
        """One turn: whether a worker exited or a new step started since the last one; None
        for a quiet turn (:meth:`quiet`), which only checks the heartbeats."""
        self.check_agent()
        if self.quiet():
            self.heartbeats.check()
            return None
        self.admission.use_new_machines()
        died = self.losses.poll()
        with self.progress.turn() as progress:
            self._full_turn()
        changed = bool(died) or progress != self._last_turn_progress
        self._last_turn_progress = progress
        return changed

    def quiet(self) -> bool:
        """Whether this turn may skip everything but the heartbeats: no key was added to
        the store since the last full turn (every event a turn looks for adds one: an exit,
        a report, an abort, a departure, an arrival, a machine, a loss, an evaluation, a
        checkpoint error), the last full turn is under FULL_TURN_S old (progress, stalls
        and commits are read from overwritten keys), and nothing is due from this side (an
        injected fault, a stop). One round trip instead of some 25: during steady training
        most turns are quiet, and the workers of a small host get the CPU back."""
        if not self.faults.quiet() or self.stop.requested:
            return False
        return self.quiet_turns.quiet(time.monotonic())

    def _full_turn(self) -> None:
        """The rest of a full turn, with the members' progress read once."""
        self.heartbeats.check()
        self.stall.check()
        self.faults.deliver()
        self.admission.admit_joiners()
        self.stop.apply(self.progress.max_progress())
        self.checkpoints.poll_errors()
        # A step's loss line before its evaluation's: rank 0 writes the loss first.
        self.metrics.show_progress(done=self.progress.max_progress())
        self.metrics.collect_evaluations()
        self.metrics.record_throughput()
        if time.monotonic() - self.last_commit_check > COMMIT_CHECK_S:
            # Checkpoints are committed while a generation runs, not only when it ends.
            self.last_commit_check = time.monotonic()
            self.checkpoints.commit(last=self.progress.max_progress() + 1)
        self._departures()

    def _departures(self) -> None:
        """Workers that said they are leaving (a preemption notice): the members stop at
        the next boundary without them."""
        sup = self.supervisor
        for w in sup.live_ids():
            if self.store.check([leaving_key(w)]) and sup[w].fate in ("running", "terminated"):
                if sup[w].fate == "running":
                    self.metrics.preemptions += 1  # a SIGTERM the worker delivered to itself
                sup[w].fate = "left"
                self.metrics.event("leaving", worker=w)
                self.progress.request_boundary()

    def _read_reports(self, g: int, expected: set[str], reports: dict[str, Report]) -> bool:
        """Add generation ``g``'s new reports to ``reports``; whether a member's is among them."""
        member_reported = False
        members = self.state.members()
        for w in list(expected | set(self.supervisor.live_ids())):
            key = report_key(g, w)
            if w not in reports and self.store.check([key]):
                reports[w] = Report.decode(self.store.get(key))
                member_reported = member_reported or w in members
        return member_reported
