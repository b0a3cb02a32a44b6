"""From the live workers' reports to the next generation's plan.

:class:`GenerationPlanner` writes what the coordinator has told the workers (the current layout, the
step it resumes from, which workers have been given an entry generation: the
:class:`~spotline.launch.control.job_state.JobState` every part reads) and publishes each
generation's :class:`~spotline.wire.protocol.PlanMessage`:

- :meth:`GenerationPlanner.start`: generation 0, from step 0 or from a ``--resume``'s checkpoint.
- :meth:`GenerationPlanner.replan`: the committed step and a layout from what the workers hold
  (:func:`spotline.plan.layout.plan_generation`), state moved in memory; a first start if
  nothing was trained yet; a fatal loss (a stage held by nobody) reads the last checkpoint.
- :meth:`GenerationPlanner.restore`: every member reads the last complete checkpoint (or starts
  over from step 0 without one).
- :meth:`GenerationPlanner.restart_all`: every worker is replaced, then :meth:`GenerationPlanner.restore`.

A recovery policy (:mod:`spotline.sim.recovery_policies`, beside the simulator's model of it)
decides what a *failure* (a member lost) leads to, with these methods, and the checkpoint
interval it needs; arrivals and departures at a step boundary are a :meth:`GenerationPlanner.replan`
whatever the policy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from spotline.config import RunConfig
from spotline.launch.control.checkpoints import CheckpointCommits
from spotline.launch.control.job_state import JobState
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.supervisor import Supervisor
from spotline.plan.exposure import (
    exposed_interval_s,
    exposed_stages,
    first_exposure,
    is_burst,
    observed_mtbf_s,
)
from spotline.plan.grid import Layout, pipeline_name
from spotline.plan.layout import (
    FatalLoss,
    ShardSource,
    WaitForCapacity,
    WorkerReport,
    choose_layout,
    initial_layout,
    plan_generation,
)
from spotline.plan.logical import assign_logical_workers, worth_moving
from spotline.plan.placement import (
    exposures,
)
from spotline.sim.recovery_policies import RECOVERY_POLICIES as POLICIES
from spotline.wire.protocol import PlanAction, PlanMessage, Store, entry_key, plan_key, report_key

POLL_S = 0.02
RECOVERY_WAIT_S = 120  # longest wait for a first committed step after a change


@dataclass(frozen=True)
class LoopHooks:
    """What the planner asks of the generation loop's other parts (their methods, handed
    to it: it holds no reference to the coordinator)."""

    max_progress: Callable[[], int]
    """The highest step a member of the current generation has started
    (:meth:`~spotline.launch.control.job_state.Progress.max_progress`)."""
    wait_for_joiners: Callable[[], object]
    """Block until a started worker has joined, or raise: none can come
    (:meth:`~spotline.launch.control.admission.Admitter.wait_for_joiners`)."""
    poll_workers: Callable[[], list[str]]
    """The workers that exited or whose machine was lost since the last call, each handled:
    a member's loss aborts its generation's collectives and starts the recovery clock
    (:meth:`~spotline.launch.control.watch.Losses.poll`)."""
    stop_keys: Callable[[int], None]
    """Tell a generation where a requested stop is, before its plan is published
    (:meth:`~spotline.launch.control.stopping.StopProtocol.stop_keys`)."""


class GenerationPlanner:
    """The plans of one job: what was published, and how the next one is chosen."""

    def __init__(
        self,
        cfg: RunConfig,
        store: Store,
        supervisor: Supervisor,
        metrics: RunMetrics,
        checkpoints: CheckpointCommits,
        state: JobState,
        loop: LoopHooks,
        *,
        cluster: bool = False,
    ) -> None:
        """``state``: what was published, which the planner writes (the layout, the resume
        step, the workers included) and reads (the generation in flight and when the last
        one ended); ``cluster``: the workers run on joined machines, a preemption takes a
        machine (False: ``spotline train``, whose faults take single workers)."""
        self.cfg = cfg
        self.store = store
        self.supervisor = supervisor
        self.metrics = metrics
        self.checkpoints = checkpoints
        self.state = state
        self.loop = loop
        # Exposure checkpoints (spotline.plan.exposure): a failure domain is what one
        # preemption takes, a machine of a cluster or a worker of ``spotline train``.
        self.cluster = cluster
        self.exposed = False  # whether the last plan with a layout was exposed
        self.exposure_from = 0  # the step the exposed interval counts from
        self.bursts = 0  # failures that took members on two domains or more at once
        # Sharded replicas: a stage's replica holders are one copy between them.
        redundancy = cfg.spotline.redundancy
        self.sharded = redundancy.on and redundancy.replica == "sharded"

    # -- what was published ------------------------------------------------------------------
    @property
    def layout(self) -> Layout | None:
        return self.state.layout

    @layout.setter
    def layout(self, layout: Layout | None) -> None:
        self.state.layout = layout

    @property
    def resume_step(self) -> int:
        return self.state.resume_step

    @resume_step.setter
    def resume_step(self, step: int) -> None:
        self.state.resume_step = step

    @property
    def included(self) -> set[str]:
        """Workers given an entry generation."""
        return self.state.included

    # -- publishing ---------------------------------------------------------------------------
    def include(self, wid: str, generation: int) -> None:
        """Tell a worker the first generation it reads (it is in that plan, or standby)."""
        self.included.add(wid)
        self.store.set(entry_key(wid), str(generation))

    def members(self) -> list[str]:
        return self.state.members()

    def publish(self, generation: int, plan: PlanMessage) -> None:
        if plan.action != "finish":
            self.loop.stop_keys(generation)  # a stop chosen earlier holds for this one too
        if plan.layout is not None:
            on = {w: self.supervisor.machine_of(w) for w in plan.layout.members}
            exposed = exposures(plan.layout, on, sharded=self.sharded)
            self.metrics.note_exposure(generation, exposed, machines=len(set(on.values())))
        self.store.set(plan_key(generation), plan.encode())

    def plan(
        self,
        action: PlanAction,
        layout: Layout | None,
        resume: int,
        holders: Mapping[int, Sequence[str]],
        sources: Sequence[tuple[int, str]],
        *,
        checkpoint_step: int | None = None,
        shard_sources: Sequence[ShardSource] = (),
    ) -> PlanMessage:
        restarted = action == "restore" or not any(holders.values())
        interval, start = self._checkpoint_schedule(layout, resume, restarted=restarted)
        return PlanMessage(
            action=action,
            layout=layout,
            logical=self._logical_assignment(layout),
            resume_step=resume,
            holders={s: tuple(ws) for s, ws in holders.items()},
            sources=tuple(sources),
            checkpoint_interval=interval,
            checkpoint_step=checkpoint_step,
            checkpoint_from=start,
            shard_sources=tuple(shard_sources),
        )

    def start(self, workers: list[str], resume_from: int | None) -> None:
        """Generation 0 on the run's first ``workers``: from step 0, or every member reads
        the checkpoint at ``resume_from`` (no transfers)."""
        S, P = self.cfg.num_stages, self.cfg.num_logical_workers
        self.layout = initial_layout(
            S,
            P,
            workers,
            elastic=True,
            machines={w: self.supervisor.machine_of(w) for w in workers},
            capacity=self.cfg.capacity,
            sharded=self.sharded,
        )
        if self.layout is None:
            # Fewer starting workers than the model needs within redundancy.stages_per_worker
            # (a trace's first nodes): they stand by, and the next generation waits for more.
            self.note_short(len(workers))
        if resume_from is None:
            self.publish(0, self.plan("train", self.layout, 0, {}, []))
            return
        self.resume_step = resume_from
        holders = {s: list(workers) for s in range(S)}
        self.publish(
            0,
            self.plan(
                "restore", self.layout, resume_from, holders, [], checkpoint_step=resume_from
            ),
        )

    def domain(self, worker: str) -> str:
        """What one preemption takes with ``worker``: its machine in a cluster, itself in
        ``spotline train`` (one local machine, whose faults and traces take workers)."""
        return self.supervisor.machine_of(worker) if self.cluster else worker

    def _checkpoint_schedule(
        self, layout: Layout | None, resume: int, *, restarted: bool
    ) -> tuple[int, int]:
        """``(checkpoint_interval, checkpoint_from)`` of a plan resuming at ``resume``: the
        policy's interval, or, for an exposed layout of a policy that keeps state in memory
        (spotline.plan.exposure, the simulator's rule), its first committed step when it
        is the first exposed one, then Young/Daly of the bursts seen, in steps. Recorded
        with the checkpoint commits, which commit those steps too."""
        base = self.checkpoints.interval_steps
        if layout is None:
            return base, 0
        replicas = self.cfg.spotline.redundancy.on
        exposed = bool(exposed_stages(layout, self.domain, replicas=replicas, sharded=self.sharded))
        policy = POLICIES[self.cfg.spotline.recovery.mode]
        # base 0: checkpoints are off (the user's choice), exposed or not.
        if not (exposed and base > 0 and policy.exposure_checkpoints):
            self.exposed = exposed
            self.checkpoints.schedule(resume, 0, base, exposed=False)
            return base, 0
        rec = self.cfg.spotline.recovery
        step_s = rec.step_time_estimate_s
        interval = base  # before the first burst: no rate observed
        if observed_mtbf_s(self.metrics.now(), self.bursts) is not None:
            seconds = exposed_interval_s(
                base * step_s, rec.checkpoint_cost_s, self.metrics.now(), self.bursts
            )
            # Whole steps, rounded down as interval_steps rounds, never above the base.
            interval = min(base, max(1, math.floor(seconds / step_s)))
        if first_exposure(exposed, self.exposed, restarted=restarted):
            self.exposure_from = resume + 1  # its first committed step
        elif restarted:
            self.exposure_from = resume  # the checkpoint it read, or the start
        self.exposed = True
        self.checkpoints.schedule(resume, self.exposure_from, interval, exposed=True)
        return interval, self.exposure_from

    def _logical_assignment(self, layout: Layout | None) -> dict[str, tuple[int, ...]] | None:
        """Which logical pipelines each physical pipeline of ``layout`` runs, in proportion to
        the speeds its members measured (a pipeline is as fast as its slowest member; one
        never measured counts as the median). Nothing moves with them but their ids: every
        pipeline holds all the state of its stages. The workers rebalance as they measure."""
        if layout is None:
            return None
        seconds: dict[str, float] = {}
        for w, stats in self.metrics.worker_stats.items():
            measured = stats.seconds_per_logical_worker
            if measured:
                seconds[w] = float(measured)
        known = sorted(seconds.values())
        typical = known[len(known) // 2] if known else 1.0
        speeds = {
            pipeline_name(p): 1.0 / max(seconds.get(w, typical) for w in row)
            for p, row in enumerate(layout.slots)
        }
        even = assign_logical_workers(self.cfg.num_logical_workers, dict.fromkeys(speeds, 1.0))
        assignment = assign_logical_workers(self.cfg.num_logical_workers, speeds)
        if not worth_moving(even, assignment, speeds):
            # Measurements are noisy: an even split unless speeds clearly differ.
            assignment = even
        self.metrics.placements.append(layout.logical_placement(self.state.generation, assignment))
        return {p: tuple(ws) for p, ws in assignment.items()}

    # -- the next generation ----------------------------------------------------------------
    def replan(
        self, reports: list[WorkerReport], *, failure: bool, reached: int, ready_t: float
    ) -> None:
        """Plan generation ``state.generation`` from what the live workers hold.

        ``reached``: the step in flight when the last generation ended; ``ready_t``: when
        everyone had stopped (a change without a failure is timed from there)."""
        S, P = self.cfg.num_stages, self.cfg.num_logical_workers
        g = self.state.generation
        if failure and self.layout is not None:
            # The members the failure took, by failure domain: a burst or a single loss.
            live = {r.worker for r in reports}
            lost = [self.domain(w) for w in self.layout.members if w not in live]
            self.bursts += is_burst(lost)
        capacity = self.cfg.capacity
        result = plan_generation(
            g, S, P, reports, elastic=True, capacity=capacity, sharded=self.sharded
        )
        never_trained = (
            self.resume_step == 0
            and not any(r.holdings for r in reports)
            and not self.checkpoints.committed
        )
        if isinstance(result, FatalLoss) and never_trained:
            # Nothing was trained yet: every worker builds the initial weights itself.
            layout = choose_layout(
                S, P, reports, usable={}, elastic=True, capacity=capacity, sharded=self.sharded
            )
            self._include_all(reports, g)
            self.layout = layout
            self.publish(g, self.plan("train", layout, 0, {}, []))
            self.metrics.event("plan", generation=g, stages="fresh start" if layout else "waiting")
            if layout is None:
                self.note_short(len(reports))
                self.loop.wait_for_joiners()
            return
        if isinstance(result, FatalLoss):
            self.metrics.event("fatal-loss", stages=list(result.lost_stages))
            self.restore(reports, g, reached)
            return
        self._include_all(reports, g)
        holders: dict[int, list[str]] = {s: [] for s in range(S)}
        for r in reports:
            for h in r.holdings:
                # Holders hold the whole stage: a shard is only a source with every other
                # shard (the plan's shard_sources).
                if h.whole and (
                    h.version == result.resume_step
                    or (h.version == result.resume_step - 1 and h.ready)
                ):
                    holders[h.stage].append(r.worker)
        if isinstance(result, WaitForCapacity) or result.layout is None:
            if isinstance(result, WaitForCapacity):
                self.note_short(len(reports))
            else:
                self.metrics.event("waiting-for-workers", live=len(reports))
            self.layout = None
            self.publish(g, self.plan("train", None, result.resume_step, holders, ()))
            # Nothing trains until a worker arrives and joins: wait for one. The state
            # stays in the survivors' memory meanwhile (no fallback).
            self.loop.wait_for_joiners()
            return
        layout = result.layout
        if failure:
            self.metrics.steps_redone += max(0, reached - result.resume_step)
        self.layout = layout
        self.resume_step = result.resume_step
        self.publish(
            g,
            self.plan(
                "train",
                layout,
                result.resume_step,
                holders,
                result.sources,
                shard_sources=result.shard_sources,
            ),
        )
        self.metrics.event(
            "plan",
            generation=g,
            stages="/".join("+".join(map(str, gr)) for gr in layout.groups),
            resume=result.resume_step,
        )
        generation_end_t = self.state.generation_end_t
        # This change's clock is read now: a loss while it is awaited starts the next one's.
        started = self.metrics.pending_failure_t or self.metrics.now()
        self.metrics.pending_failure_t = None
        if failure:
            self._await_recovered(g, started)
        elif generation_end_t is not None:
            self._await_recovered(g, max(ready_t, generation_end_t), failure=False)

    def note_short(self, live: int) -> None:
        """Say (one line, and an event in summary.json) that ``live`` workers are too few to
        hold the model within ``redundancy.stages_per_worker``: the job waits for arrivals."""
        capacity = self.cfg.capacity
        needed = capacity.fewest_workers(
            self.cfg.num_stages, self.cfg.num_logical_workers, elastic=True
        )
        if live >= needed:
            return  # too few for another reason (none so far in the elastic mode)
        self.metrics.event(
            "waiting-for-capacity",
            live=live,
            needed=needed,
            stages=self.cfg.num_stages,
            stages_per_worker=capacity.stages_per_worker,
        )

    def _include_all(self, reports: list[WorkerReport], generation: int) -> None:
        for r in reports:
            if r.worker not in self.included:
                self.include(r.worker, generation)

    def _await_recovered(
        self, g: int, started: float, *, failure: bool = True, in_memory: bool = True
    ) -> None:
        """Recovery time: from the preemption to the first step committed after it. For a
        change without a failure (an arrival, a departure at a boundary): from the end of
        the last generation to the first step the new one commits."""
        target = self.resume_step + 1
        deadline = time.monotonic() + RECOVERY_WAIT_S
        while time.monotonic() < deadline:
            # A loss now (a machine gone silent while the generation sets up) is handled at
            # once, as while it trains: its peers must not wait on it.
            if self.loop.poll_workers():
                break
            if self.loop.max_progress() >= target or all(
                self.store.check([report_key(g, w)]) for w in self.members()
            ):
                break
            time.sleep(POLL_S)
        seconds = self.metrics.now() - started
        if not failure:
            self.metrics.reconfigured(g, self.resume_step, seconds)
            return
        self.metrics.recovered(g, self.resume_step, seconds, in_memory=in_memory)

    def restore(self, reports: list[WorkerReport], g: int, reached: int = 0) -> None:
        """Every member reads the last complete checkpoint (a fatal loss, a restart)."""
        step = self.checkpoints.latest()
        S, P = self.cfg.num_stages, self.cfg.num_logical_workers
        everyone = [WorkerReport(r.worker, (), r.previous_slot, r.machine) for r in reports]
        self._include_all(reports, g)
        if not everyone:
            self.layout = None
            # Without a checkpoint resume_step stays where training was, so that once workers
            # arrive this is a restart from scratch (steps redone counted), not a first start.
            if step is not None:
                self.resume_step = step
            self.publish(g, self.plan("train", None, self.resume_step, {}, ()))
            return
        if step is None:
            # No checkpoint yet: the only consistent state is the start.
            layout = choose_layout(
                S,
                P,
                everyone,
                usable={},
                elastic=True,
                capacity=self.cfg.capacity,
                sharded=self.sharded,
            )
            self.metrics.steps_redone += reached
            self.layout, self.resume_step = layout, 0
            self.publish(g, self.plan("train", layout, 0, {}, []))
            # Counted where a layout is published: a total loss with nobody left to restore
            # onto comes back here once workers have arrived, and is one fallback.
            self.metrics.fallbacks += 1
            self.metrics.event("restart-from-scratch")
            if layout is None:
                self.note_short(len(everyone))
                self.loop.wait_for_joiners()
                return
        else:
            usable = {s: [r.worker for r in reports] for s in range(S)}
            layout = choose_layout(
                S,
                P,
                everyone,
                usable=usable,
                elastic=True,
                capacity=self.cfg.capacity,
                sharded=self.sharded,
            )
            self.metrics.steps_redone += max(0, reached - step)
            self.layout, self.resume_step = layout, step
            holders = {s: list(usable[s]) for s in range(S)}
            sources = [(s, layout.members[0]) for s in range(S)] if layout else []
            self.publish(
                g, self.plan("restore", layout, step, holders, sources, checkpoint_step=step)
            )
            self.metrics.fallbacks += 1
            self.metrics.event("checkpoint-fallback", step=step)
            if layout is None:
                self.note_short(len(everyone))
                self.loop.wait_for_joiners()
                return
        self._await_recovered(
            g, self.metrics.pending_failure_t or self.metrics.now(), in_memory=False
        )
        self.metrics.pending_failure_t = None

    def restart_all(self, reports: list[WorkerReport], reached: int) -> None:
        """Every surviving worker is replaced by a fresh one, which reads the checkpoint."""
        survivors = [r.worker for r in reports]
        for w in survivors:
            self.supervisor.kill(w, "restarted")
        for w in survivors:
            self.supervisor[w].proc.wait()
            self.supervisor[w].alive = False
        g = self.state.generation
        fresh = []
        for _ in survivors:
            wid = self.supervisor.spawn()
            self.include(wid, g)
            fresh.append(wid)
        self.metrics.event("restart-all", workers=len(fresh))
        self.restore(
            [WorkerReport(w, machine=self.supervisor.machine_of(w)) for w in fresh], g, reached
        )
