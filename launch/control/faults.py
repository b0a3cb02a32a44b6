"""Fault delivery: what happens to the workers, and when.

Preemptions and arrivals come from a replayed trace (``recovery.trace``, on the wall clock
or the step clock), from random preemptions (``recovery.preempt_rate``), from ``--inject``
flags (``kill|term|stop:STEP:WORKER[:PHASE]``, ``add:STEP``) and from ``--rescale STEP:M``
(STEP counted from 1 as the progress lines count; :mod:`spotline.plan.chaos` holds it
0-based, the index compared here with the members' progress, and their events' ``from_step``
is the flag's: the first step trained with the change).
Warm workers (``recovery.warm_workers``) are started ahead of a trace's arrivals, because a
local process start-up (seconds of imports) is not compressed by ``time_scale`` as the
trace's clock is. An arrival is awaited when its start-up must not decide at which step it
trains: the members stop at a boundary a little ahead and the next plan waits for it
(:attr:`FaultDelivery.awaited_joiners`).

What it needs of the job is :class:`JobView` (the members' progress,
:class:`~spotline.launch.control.job_state.Progress`): the step reached, what was published
(the current generation and layout), and a way to ask the members to stop at a boundary.
"""

from __future__ import annotations

import random
import time
from typing import Protocol

from spotline.config import RunConfig
from spotline.launch.control.job_state import JobState
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.supervisor import Supervisor
from spotline.plan.chaos import (
    Injection,
    ScaleTo,
    TimedEvent,
    TraceReplay,
    parse_injections,
    parse_rescales,
    random_preemptions,
    replay_trace,
    trace_cycle,
)
from spotline.plan.traces import load_trace
from spotline.wire.protocol import Store, ready_key, stop_key


class JobView(Protocol):
    """What fault delivery reads of the job, and the one thing it asks of it."""

    @property
    def state(self) -> JobState:
        """What was published: the current generation, its layout and members."""
        ...

    def max_progress(self) -> int:
        """The highest step a member of the current generation has started."""
        ...

    def request_boundary(self, at_step: int | None = None) -> None:
        """Ask the members to stop at a step boundary (``at_step`` or a little ahead)."""
        ...


class FaultDelivery:
    """Delivers a run's timed events, injections and rescales, and keeps workers warm."""

    def __init__(
        self,
        cfg: RunConfig,
        store: Store,
        supervisor: Supervisor,
        metrics: RunMetrics,
        job: JobView,
    ) -> None:
        self.cfg = cfg
        self.rec = cfg.spotline.recovery
        self.store = store
        self.supervisor = supervisor
        self.metrics = metrics
        self.job = job
        self.injections: list[Injection] = list(parse_injections(self.rec.inject))
        self.done_injections: set[int] = set()  # id() of the injections delivered
        self.rescales: list[ScaleTo] = list(parse_rescales(cfg.spotline.elasticity.rescale))
        self.rng = random.Random(self.preempt_seed())
        self.replay: TraceReplay | None = None
        self.replay_cycle = 0
        self.trace_initial: int | None = None  # a trace's initial workers
        self.timed: list[TimedEvent] = self._timed_events()
        # Arrivals the next plan waits for (started ahead of the step they train from).
        self.awaited_joiners: set[str] = set()
        self.initial_ids: list[str] = []  # the workers the run starts with (the trace's clock)
        self.clock_t: float | None = None  # monotonic time trace time 0 began
        self.clock_steps = 0  # step clock (recovery.trace_clock "steps"): steps started
        self.clock_progress: int | None = None
        self.clock_skip_s = 0.0

    def preempt_seed(self) -> int:
        seed = self.rec.preempt_seed
        return self.cfg.spotline.training.seed if seed is None else seed

    def _timed_events(self) -> list[TimedEvent]:
        rec = self.rec
        cap = rec.max_workers or self.cfg.num_workers
        if rec.trace:
            replay = replay_trace(
                load_trace(rec.trace),
                max_workers=cap,
                time_scale=rec.time_scale,
                removal=rec.trace_removal,
            )
            self.trace_initial = replay.initial_workers
            self.replay = replay
            return list(replay.events)
        if rec.preempt_rate > 0:
            # A horizon long enough for the run; events past the end are never reached.
            return random_preemptions(
                rec.preempt_rate,
                self.cfg.num_workers,
                3600.0 * 24,
                self.preempt_seed(),
                rec.time_scale,
                rec.replace_after_s,
                removal=rec.trace_removal,
            )
        return []

    def initial_workers(self) -> int:
        """How many workers the run starts with: the trace's initial nodes, or the config's
        (``topology.start_workers``, else ``topology.workers``)."""
        topology = self.cfg.spotline.topology
        initial = self.trace_initial or topology.start_workers or self.cfg.num_workers
        return min(initial, self.rec.max_workers or self.cfg.num_workers)

    def mtbf_s(self) -> float | None:
        """Wall seconds between preemptions: of the replayed trace, or of the random rate
        (None: this run has no preemptions to expect)."""
        removals = [e for e in self.timed if e.kind == "remove"]
        if removals:
            span = max(e.at_s for e in removals)
            return span / max(1, len(removals))
        if self.rec.preempt_rate > 0:
            return 3600.0 / (self.rec.preempt_rate * self.cfg.num_workers) / self.rec.time_scale
        return None

    def quiet(self) -> bool:
        """Whether nothing is due at a step or a time (no injection, rescale, trace event or
        random preemption left): then the coordinator's watch may poll less often."""
        return (
            all(id(i) in self.done_injections for i in self.injections)
            and not self.rescales
            and not self.timed
            and self.replay is None
            and self.rec.preempt_rate <= 0
        )

    def more_to_come(self) -> bool:
        """Whether timed events (arrivals among them) remain."""
        return bool(self.timed)

    # -- warm workers and arrivals --------------------------------------------------------
    def keep_warm(self) -> None:
        """Keep ``recovery.warm_workers`` processes started ahead of timed arrivals.

        A trace records when a cloud node became available, and its clock is compressed by
        ``time_scale``; a local process start-up (seconds of imports) is not. Without warm
        workers a replay at a high time scale kills arrivals before they finish starting and
        the run makes no progress."""
        if not self.timed and self.replay is None:
            return
        for _ in range(self.rec.warm_workers - len(self.supervisor.warm_ids())):
            self.supervisor.spawn(warm=True)

    def arrival(self, *, awaited: bool = False, at_step: int | None = None) -> None:
        warm = self.supervisor.warm_ids()
        # A warm worker that has finished starting first; else the oldest still starting.
        joined = [w for w in warm if self.supervisor.has_joined(w)]
        if joined or warm:
            wid = (joined or warm)[0]
            self.supervisor[wid].warm = False
        else:
            wid = self.supervisor.spawn()
        self.metrics.event("arrived", worker=wid)
        if awaited or self.rec.trace_clock == "steps":
            # Members stop a little ahead and wait for it, as for "--inject add:STEP": its
            # start-up must not decide at which step it trains.
            self.awaited_joiners.add(wid)
            self.job.request_boundary(at_step)
        self.keep_warm()

    # -- the trace's clock ------------------------------------------------------------------
    def deliver_timed_events(self) -> None:
        # Trace time 0 is when the initial workers have started up (start-up is not part of
        # the trace), or the first training step, whichever comes first.
        if self.clock_t is None:
            self.job.max_progress()  # notes the first step's time, if one has started
            started = all(
                self.supervisor.has_joined(w) or not self.supervisor[w].alive
                for w in self.initial_ids
            )
            if self.metrics.first_step_t is None and not started:
                return
            self.clock_t = self.metrics.first_step_t or time.monotonic()
        elapsed = self._trace_elapsed()
        if self.replay is not None and not self.timed and self.replay.duration_s > 0:
            # The run outlasts the trace: replay it again (spotline.plan.chaos.trace_cycle).
            self.replay_cycle += 1
            self.timed = list(trace_cycle(self.replay, self.replay_cycle))
            self.metrics.event("trace-repeated", cycle=self.replay_cycle)
        while self.timed and self.timed[0].at_s <= elapsed:
            ev = self.timed.pop(0)
            if ev.kind == "remove":
                members = [
                    w for w in self.supervisor.live_ids() if self.supervisor[w].fate == "running"
                ]
                for wid in self.rng.sample(members, min(ev.count, max(0, len(members)))):
                    self.supervisor.preempt(wid, ev.how or "kill")
            else:
                cap = self.rec.max_workers or self.cfg.num_workers
                for _ in range(ev.count):
                    if len(self.supervisor.live_ids()) < cap:
                        self.arrival()

    def _trace_elapsed(self) -> float:
        """Seconds of replay (wall seconds; trace seconds are these times ``time_scale``).

        With ``recovery.trace_clock`` "wall" it is the wall time since the clock started. With
        "steps" each training step started counts ``step_time_estimate_s`` (redone steps too,
        they are training time), and time spent unable to train is skipped: the events then
        land on the same steps on any machine, so a replay is reproducible event for event.
        """
        assert self.clock_t is not None
        if self.rec.trace_clock == "wall":
            return time.monotonic() - self.clock_t
        progress = self.job.max_progress()
        if self.clock_progress is not None and progress > self.clock_progress:
            self.clock_steps += progress - self.clock_progress
        # After a checkpoint fallback progress goes back; the redone steps count again.
        self.clock_progress = progress
        return self.clock_steps * self.rec.step_time_estimate_s + self.clock_skip_s

    def skip_idle_time(self) -> None:
        """Step clock: nothing can train and nobody is starting, so jump to the next event."""
        if self.rec.trace_clock != "steps" or self.clock_t is None or not self.timed:
            return
        self.clock_skip_s += max(0.0, self.timed[0].at_s - self._trace_elapsed())

    # -- injections and rescales -------------------------------------------------------------
    def deliver_step_injections(self) -> None:
        """``add:STEP`` and phase-less ``kill|term:STEP:WORKER`` (delivered together when a
        member starts that step); injections with a phase, and ``stop`` (a hang), are
        delivered by the worker itself."""
        progress = self.job.max_progress()
        for inj in self.injections:
            if inj.signal == "add" and id(inj) not in self.done_injections:
                # Started ahead of time; members stop at the step and wait for it to join,
                # so "add:STEP" means: trains from STEP on (inj.step: the boundary before it).
                self.done_injections.add(id(inj))
                wid = self.supervisor.spawn()
                self.awaited_joiners.add(wid)
                self.metrics.event("arrived", worker=wid, from_step=inj.number)
                key = stop_key(self.job.state.generation)
                if not self.store.check([key]):
                    self.store.set(key, str(max(inj.step, progress + 2)))
                continue
            if inj.step > progress or id(inj) in self.done_injections:
                continue
            if inj.phase is None and inj.signal != "stop":  # a worker stops itself
                self.done_injections.add(id(inj))
                wid = f"w{inj.worker}"
                if wid in self.supervisor and self.supervisor[wid].alive:
                    self.supervisor.preempt(wid, inj.signal)

    def deliver_rescales(self) -> None:
        """``--rescale STEP:M``: from step STEP on (counted from 1), M worker processes train.

        Growth starts the new processes a little ahead (as ``--inject add:STEP`` does): the
        members stop at STEP and wait for them to join. A removal waits until the last
        growth's processes have joined, then SIGKILLs, once a member has started STEP, what
        costs least first: processes outside the layout (standby), then whole pipelines
        from the last one."""
        if not self.rescales:
            return
        due = self.rescales[0]
        progress = self.job.max_progress()
        live = [w for w in self.supervisor.live_ids() if self.supervisor[w].fate == "running"]
        if due.num_workers > len(live):
            # Not while the last change is still being recovered from: its generation must
            # train before this one replaces it.
            if progress < due.step - 2 or self.metrics.pending_failure_t is not None:
                return
            self.rescales.pop(0)
            self.metrics.event(
                "rescale", from_step=due.number, workers=due.num_workers, live=len(live)
            )
            for _ in range(due.num_workers - len(live)):
                self.arrival(awaited=True, at_step=due.step)
            return
        if progress < due.step or self.awaited_joiners:
            return
        generation = self.job.state.generation
        if not all(self.store.check([ready_key(generation, w)]) for w in self.job.state.members()):
            return  # the generation is still being set up: remove from a training one
        self.rescales.pop(0)
        self.metrics.event("rescale", from_step=due.number, workers=due.num_workers, live=len(live))
        layout = self.job.state.layout

        def loss_cost(w: str) -> tuple[int, int, int]:
            if layout is None or w not in layout.members:
                return (0, 0, 0)
            pipeline, stage = layout.slot_of(w)
            return (1, -pipeline, -stage)

        for w in sorted(live, key=loss_cost)[: len(live) - due.num_workers]:
            self.supervisor.preempt(w, "kill")

    def deliver(self) -> None:
        """Everything due now: timed events, step injections, rescales."""
        self.deliver_timed_events()
        self.deliver_step_injections()
        self.deliver_rescales()
