"""The training state machine every simulated policy drives (:class:`TrainingRun`): time
buckets, the step ledger, the checkpoint timer, and the :class:`PolicyResult` it adds up to.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Literal

from spotline.plan.grid import Layout
from spotline.sim.results import PlannedLayout, PolicyResult, TimelinePoint
from spotline.sim.sim_config import PolicyName, SimConfig, layout_step_time_s

_Status = Literal["waiting", "paused", "running", "checkpointing"]
_PauseKind = Literal["restart", "reconfigure"]


class TrainingRun:
    """The training state machine shared by the policies: time buckets, the step ledger and
    the checkpoint timer. Policies drive it through pause, rollback and set_layout."""

    def __init__(self, config: SimConfig, checkpoint_interval_s: float) -> None:
        self.config = config
        self.samples_per_step = config.model.samples_per_step
        self.checkpoint_save_s = config.model.checkpoint_save_s
        # The policy's interval (Spotline's: the long one until a fatal loss, then Young/Daly)
        # and the one in force (shorter while the plan is exposed: spotline.plan.exposure).
        self.base_interval_s = checkpoint_interval_s
        self.interval_s = checkpoint_interval_s
        # Exposure-triggered checkpoints: whether the running layout is exposed, whether a
        # checkpoint is due at the next committed step (a first exposure), whether the one
        # being written counts as one, and how many completed.
        self.exposed = False
        self.checkpoint_on_commit = False
        self.pending_exposure = False
        self.exposure_checkpoints = 0
        self.rollbacks: list[tuple[float, int]] = []  # (when, steps rolled back)
        self.now = 0.0
        self.status: _Status = "waiting"
        self.pause_end = 0.0
        self.pause_kind: _PauseKind = "restart"
        self.checkpoint_end = 0.0
        self.pending_checkpoint_steps = 0
        self.step_time_s = math.inf
        self.degraded = False
        # Whether the step time is a calibration bound (pipeline count outside its rows).
        self.uncalibrated = False
        self.num_active_pipelines = 0
        self.progress = 0.0
        self.committed_steps = 0
        self.trained_steps = 0
        self.redone_steps = 0
        self.checkpoint_steps = 0
        self.since_checkpoint_s = 0.0
        self.started = False
        self.running_s = 0.0
        self.degraded_s = 0.0
        self.uncalibrated_s = 0.0
        self.restart_s = 0.0
        self.reconfigure_s = 0.0
        self.checkpoint_s = 0.0
        self.waiting_s = 0.0
        self.num_ready = 0
        self.timeline: list[TimelinePoint] | None = [] if config.record_timeline else None
        self.on_checkpoint: Callable[[], None] | None = None

    # -- bookkeeping -------------------------------------------------------------------
    def record(self) -> None:
        if self.timeline is None:
            return
        rate = self.samples_per_step / self.step_time_s if self.status == "running" else 0.0
        point = TimelinePoint(
            self.now,
            rate,
            self.committed_steps * self.samples_per_step,
            self.num_ready,
            self.num_active_pipelines if self.status != "waiting" else 0,
        )
        if self.timeline and self.timeline[-1].t_s == self.now:
            self.timeline[-1] = point
        else:
            self.timeline.append(point)

    def _train(self, duration_s: float) -> None:
        self.running_s += duration_s
        self.since_checkpoint_s += duration_s
        if self.degraded:
            self.degraded_s += duration_s
        if self.uncalibrated:
            self.uncalibrated_s += duration_s
        self.progress += duration_s / self.step_time_s
        whole = int(self.progress)
        if whole:
            self.committed_steps += whole
            self.trained_steps += whole
            self.progress -= whole

    def _end_step(self) -> None:
        """Training stopped exactly at a step's end: commit it (the float sum of the
        fractions may fall an ulp short of 1 or land an ulp past it)."""
        if self.progress > 0.5:
            self.committed_steps += 1
            self.trained_steps += 1
        self.progress = 0.0

    def advance(self, t_s: float) -> None:
        """Run the state machine up to ``t_s``, calling ``on_checkpoint`` at the moment each
        checkpoint completes (the checkpoint-restart policy grows the job there)."""
        while self.now < t_s:
            status = self.status
            if status == "running":
                due = self.now + (self.interval_s - self.since_checkpoint_s)
                at_commit = self.checkpoint_on_commit or due < self.now
                if at_commit:
                    # At the next committed step (workers save a committed step): the first
                    # of an exposed generation, or the first after the interval shrank below
                    # the time since the last checkpoint (spotline.plan.exposure). The step
                    # under way carries over from the last generation: what is left of it.
                    due = self.now + (1.0 - self.progress) * self.step_time_s
                if due <= t_s:
                    self._train(due - self.now)
                    if at_commit:
                        self._end_step()
                    self.now = due
                    self.status = "checkpointing"
                    self.checkpoint_end = due + self.checkpoint_save_s
                    self.pending_checkpoint_steps = self.committed_steps
                    self.pending_exposure = self.exposed or at_commit
                    self.checkpoint_on_commit = False
                    self.record()
                else:
                    self._train(t_s - self.now)
                    self.now = t_s
            elif status == "checkpointing":
                end = min(t_s, self.checkpoint_end)
                self.checkpoint_s += end - self.now
                self.now = end
                if end == self.checkpoint_end:
                    self.checkpoint_steps = self.pending_checkpoint_steps
                    self.exposure_checkpoints += self.pending_exposure
                    self.since_checkpoint_s = 0.0
                    self.status = "running"
                    self.record()
                    if self.on_checkpoint is not None:
                        self.on_checkpoint()
            elif status == "paused":
                end = min(t_s, self.pause_end)
                if self.pause_kind == "restart":
                    self.restart_s += end - self.now
                else:
                    self.reconfigure_s += end - self.now
                self.now = end
                if end == self.pause_end:
                    self.status = "running"
                    self.record()
            else:
                self.waiting_s += t_s - self.now
                self.now = t_s

    # -- transitions driven by the policies --------------------------------------------
    def set_layout(self, layout: Layout | None) -> None:
        """Adopt the step time of a layout (None: waiting for workers)."""
        if layout is None:
            self.status = "waiting"
            self.num_active_pipelines = 0
            self.record()
            return
        self.num_active_pipelines = layout.num_pipelines
        self.degraded = layout.num_physical_stages < layout.num_stages
        self.step_time_s, calibrated = layout_step_time_s(self.config.model, layout)
        self.uncalibrated = not calibrated
        self.record()

    def pause(self, kind: _PauseKind, duration_s: float) -> None:
        """Stop training for ``duration_s`` from now (a checkpoint being written is lost;
        a pause already running is extended, and a restart outranks a reconfiguration)."""
        end = self.now + duration_s
        if self.status == "paused":
            if kind == "restart":
                self.pause_kind = "restart"
            self.pause_end = max(self.pause_end, end)
        else:
            self.status = "paused"
            self.pause_kind = kind
            self.pause_end = end
        self.record()

    def rollback(self) -> None:
        """Return to the last checkpoint: the steps since then are redone later."""
        self.rollbacks.append((self.now, self.committed_steps - self.checkpoint_steps))
        self.redone_steps += self.committed_steps - self.checkpoint_steps
        self.committed_steps = self.checkpoint_steps
        self.progress = 0.0
        self.since_checkpoint_s = 0.0
        self.record()

    def check(
        self, placed: Collection[str], removed: Sequence[str], arrived: Sequence[str]
    ) -> None:
        """Conservation after a batch: no preempted node is placed (checked for the nodes
        just removed; a layout only ever gains ready nodes, so by induction no preempted
        node is placed at all) and the step ledger balances."""
        assert not any(node in placed for node in removed), "a node is both preempted and placed"
        assert not set(removed) & set(arrived), "a node is both preempted and arriving"
        assert self.trained_steps == self.committed_steps + self.redone_steps
        assert self.checkpoint_steps <= self.committed_steps

    # -- the end -----------------------------------------------------------------------
    def finish(
        self,
        policy: PolicyName,
        duration_s: float,
        cost_usd: float,
        counters: tuple[int, int, int, int],
        layouts: tuple[PlannedLayout, ...] = (),
    ) -> PolicyResult:
        """Run to the end of the trace and check the time and step ledgers balance:
        ``counters`` are (fatal losses, restarts, failovers, preemptions)."""
        self.advance(duration_s)
        num_fatal, num_restarts, num_failovers, num_preemptions = counters
        accounted = (
            self.running_s
            + self.restart_s
            + self.reconfigure_s
            + self.checkpoint_s
            + self.waiting_s
        )
        assert abs(accounted - duration_s) <= 1e-6 * max(1.0, duration_s), (accounted, duration_s)
        assert self.trained_steps == self.committed_steps + self.redone_steps
        return PolicyResult(
            policy=policy,
            duration_s=duration_s,
            committed_samples=self.committed_steps * self.samples_per_step,
            cost_usd=cost_usd,
            running_s=self.running_s,
            restart_s=self.restart_s,
            reconfigure_s=self.reconfigure_s,
            checkpoint_s=self.checkpoint_s,
            waiting_s=self.waiting_s,
            degraded_s=self.degraded_s,
            uncalibrated_s=self.uncalibrated_s,
            redone_samples=self.redone_steps * self.samples_per_step,
            num_fatal_failures=num_fatal,
            num_restarts=num_restarts,
            num_failovers=num_failovers,
            num_preemptions=num_preemptions,
            checkpoint_interval_s=self.base_interval_s,
            exposure_checkpoints=self.exposure_checkpoints,
            rollbacks=tuple((t_s, steps * self.samples_per_step) for t_s, steps in self.rollbacks),
            timeline=tuple(self.timeline) if self.timeline is not None else (),
            layouts=layouts,
        )
