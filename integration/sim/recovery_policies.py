"""The runtime's recovery policies, each one class with two faces: what the coordinator does
when a member is lost, and how the simulator's replay models it.

A recovery policy decides what a *failure* (a member lost) leads to, and the checkpoint
interval it needs; arrivals and departures at a step boundary are a new generation whatever
the policy. Each policy is one :class:`RecoveryPolicy` subclass, keyed by the names of
:mod:`spotline.plan.policies` (``recovery``, the runtime's ``spotline.recovery.mode``; the
simulator's ``name`` is the system's, ``spotline`` for failover):

- its runtime face, :meth:`RecoveryPolicy.recover` and
  :meth:`RecoveryPolicy.checkpoint_interval`, which the coordinator calls with its planner
  (:class:`spotline.launch.control.recovery.GenerationPlanner`, seen here as a :class:`Replanner`:
  this floor imports nothing of launch/);
- its simulator face, :class:`spotline.sim.replay.SimPolicy`'s hooks, which
  :class:`spotline.sim.replay.ReplayJob` calls.

One class rather than a runtime class and a model class: the simulator replays the very
object the coordinator runs (``POLICY_MODELS["checkpoint-restart"] is
RECOVERY_POLICIES["checkpoint-restart"]``), the two halves of each rule sit side by side (the
checkpoint interval in steps and in seconds; :attr:`RecoveryPolicy.exposure_checkpoints`,
one flag both faces read), and a new policy cannot be added to one side only: both faces'
methods are abstract. A new policy is one subclass added to :data:`RECOVERY_POLICIES` and
to :data:`spotline.sim.simulator.POLICY_MODELS` (its names to
:mod:`spotline.plan.policies`). The simulator-only policies (``spotline-rigid``,
``on-demand``, ``ideal``) are in :mod:`spotline.sim.sim_only_policies`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar, Protocol

from spotline.config import RunConfig
from spotline.plan.capacity import Capacity
from spotline.plan.checkpoint_interval import interval_steps, modelled_interval_s
from spotline.plan.exposure import exposed_interval_s, exposed_stages, first_exposure, is_burst
from spotline.plan.layout import FatalLoss, WaitForCapacity, WorkerReport
from spotline.plan.policies import CheckpointRestart, Failover, RecoveryMode
from spotline.plan.traces import Trace
from spotline.sim.canonical_plans import PlacedMembers, Slot
from spotline.sim.replay import ReplayJob, SimPolicy
from spotline.sim.sim_config import (
    MIN_CHECKPOINT_INTERVAL_S,
    PolicyName,
    SimConfig,
    trace_mtbf_s,
)


class Replanner(Protocol):
    """What a policy's runtime face asks of the coordinator's planner
    (:class:`spotline.launch.control.recovery.GenerationPlanner`)."""

    def replan(
        self, reports: list[WorkerReport], *, failure: bool, reached: int, ready_t: float
    ) -> None:
        """The next generation from what the live workers hold (a fatal loss reads the last
        checkpoint)."""
        ...

    def restart_all(self, reports: list[WorkerReport], reached: int) -> None:
        """Every surviving worker is replaced by a fresh one, which reads the checkpoint."""
        ...


class RecoveryPolicy(SimPolicy):
    """A runtime recovery policy and its model (module docstring): what a failure leads to,
    and the checkpoint interval it needs."""

    recovery: ClassVar[RecoveryMode]
    """Its runtime name (``spotline.recovery.mode``), its key in :data:`RECOVERY_POLICIES`."""
    exposure_checkpoints: ClassVar[bool] = False
    """Whether an exposed plan checkpoints off the interval (spotline.plan.exposure): for a
    policy that survives losses in memory. The coordinator's planner schedules those
    checkpoints; the replay takes them (:meth:`_exposure`)."""

    # -- the runtime's face: the coordinator ------------------------------------------------
    def checkpoint_interval(self, cfg: RunConfig, mtbf_s: float | None) -> int:
        """Steps between checkpoints (0: none); ``mtbf_s``: wall seconds between the
        preemptions this run expects (None: none)."""
        return cfg.spotline.checkpoints.interval_steps

    @abstractmethod
    def recover(
        self, planner: Replanner, reports: list[WorkerReport], *, reached: int, ready_t: float
    ) -> None:
        """Plan the generation after a failure, from the survivors' reports."""

    # -- the simulator's face: the replay (the rest of SimPolicy's hooks) ---------------------
    def on_start(self, job: ReplayJob) -> None:
        self._exposure(job, restarted=True)

    def _exposure(self, job: ReplayJob, *, restarted: bool) -> None:
        """The exposure rule on the layout just adopted (spotline.plan.exposure, the
        coordinator's), for a policy with :attr:`exposure_checkpoints`: a checkpoint at the
        first committed step of a first exposure, and the Young/Daly interval of the
        preemptions observed so far while exposed."""
        if not self.exposure_checkpoints:
            return
        members, run = job.members, job.run
        assert members is not None
        exposed = bool(
            _exposed_stages(
                members,
                job.machine_of if job.slots_per_machine > 1 else None,
                sharded=job.config.sharded_replicas,
            )
        )
        run.checkpoint_on_commit = first_exposure(exposed, run.exposed, restarted=restarted)
        run.exposed = exposed
        run.interval_s = run.base_interval_s
        if exposed:
            run.interval_s = max(
                MIN_CHECKPOINT_INTERVAL_S,
                exposed_interval_s(
                    run.base_interval_s,
                    job.config.model.checkpoint_save_s,
                    run.now,
                    job.num_bursts,
                ),
            )


class FailoverPolicy(RecoveryPolicy):
    """``failover`` (the simulator's ``spotline``): Bamboo's takeover in memory, with elastic
    logical workers; a fatal loss reads the last checkpoint.

    In the replay every decision is the runtime's planner's
    (:func:`spotline.plan.layout.plan_generation`, the function the coordinator calls at
    each generation), in its elastic mode: members report what they hold (their stages and
    their successor's replica, :func:`~spotline.plan.layout.member_holdings`), a preemption
    or an arrival starts a new generation that pauses training for ``reconfigure_s``, and
    nothing is redone (the replica holder replays the in-flight step). Too few nodes for a
    full layout drop whole pipelines first (the global batch is fixed, so each step is
    slower), then fold stages onto fewer workers (the busiest worker sets the pace:
    :func:`spotline.sim.sim_config.layout_step_time_s`), at most
    ``SimConfig.stages_per_worker`` on one (the memory limit, :mod:`spotline.plan.capacity`);
    fewer workers wait. Waiting for nodes keeps the state. Only a
    :class:`~spotline.plan.layout.FatalLoss` (a stage no survivor holds) rolls back to the
    last checkpoint and pays ``fatal_rendezvous_s + checkpoint_load_s``. Checkpoints every
    ``spotline_checkpoint_interval_s`` of training until the first fatal loss; after k fatal
    losses the interval adapts to Young/Daly with the observed fatal MTBF (now / k), as a
    runtime that counts its fatal losses can (a fixed hourly checkpoint would make the rigid
    variant redo up to an hour per fatal loss). Exposure checkpoints, the coordinator's rule
    (:mod:`spotline.plan.exposure`): a layout that leaves some stage's copies on at most two
    workers (machines, with several slots) checkpoints at its first committed step when the
    layout before it was not exposed (a (re)start excepted), and while exposed every
    Young/Daly interval of the bursts observed so far (batches of preemptions that took
    members on two machines or more), never less often than the interval above;
    ``exposure_checkpoints`` counts them, ``rollbacks`` each return to a checkpoint. The
    runtime counts its exposed interval in steps from the first exposed one; here, as for
    the interval above, in seconds of training since the last checkpoint (one that is
    overdue when the interval shrinks is taken at the next committed step)."""

    name: ClassVar[PolicyName] = "spotline"
    recovery: ClassVar[Failover] = "failover"
    elastic: ClassVar[bool] = True
    exposure_checkpoints: ClassVar[bool] = True

    # -- the runtime's face -----------------------------------------------------------------
    def recover(
        self, planner: Replanner, reports: list[WorkerReport], *, reached: int, ready_t: float
    ) -> None:
        planner.replan(reports, failure=True, reached=reached, ready_t=ready_t)

    # -- the simulator's face ---------------------------------------------------------------
    def checkpoint_interval_s(self, trace: Trace, config: SimConfig) -> float:
        interval = config.spotline_checkpoint_interval_s
        if interval is None:
            interval = config.calibration.spotline_checkpoint_interval_s
        return interval

    def on_preemption(self, job: ReplayJob, gone: frozenset[Slot]) -> None:
        if not job.lost:
            job.num_failovers += 1
        members = job.members
        assert members is not None
        workers = [members.by_slot[slot] for slot in gone]
        # The failure domains it took: machines, or with one slot each the workers.
        on = workers if job.slots_per_machine == 1 else [job.machine_of[w] for w in workers]
        job.num_bursts += is_burst(on)
        job.lost |= gone
        self._replan(job)

    def on_arrival(self, job: ReplayJob) -> None:
        # An arrival joins at a step boundary: a new generation, as in the runtime.
        self._replan(job)

    def on_checkpoint(self, job: ReplayJob) -> None:
        pass  # nodes join when they arrive, not at a checkpoint

    def _replan(self, job: ReplayJob) -> None:
        """The next generation from what the survivors hold and the idle nodes."""
        members, run = job.members, job.run
        assert members is not None
        idle = job.idle()
        where = None
        if job.slots_per_machine > 1:
            # The machine of each slot of the last layout (its lost ones unused) and of each
            # idle worker: what the placement rule needs (see ReplayJob.machines).
            machine = job.machine_of
            by_slot = {slot: machine[worker] for slot, worker in members.by_slot.items()}
            where = (by_slot, [machine[worker] for worker in idle])
        result = job.planner.replan(members.layout, frozenset(job.lost), len(idle), where)
        if isinstance(result, FatalLoss):
            job.num_fatal += 1
            run.rollback()
            run.base_interval_s = max(
                MIN_CHECKPOINT_INTERVAL_S,
                modelled_interval_s(
                    job.config.model.checkpoint_save_s, max(run.now, 1.0) / job.num_fatal
                ),
            )
            job.start()
        elif result is None or isinstance(result, WaitForCapacity):
            # Too few nodes (for the pipelines, or to hold the model within capacity): wait,
            # the survivors keep the state.
            run.set_layout(None)
        else:
            job.members, job.lost = PlacedMembers(result, members.by_slot, idle), set()
            job.record_layout()
            calibration = job.config.calibration
            transfer_s = calibration.state_transfer_s if result.moves_state else 0.0
            run.pause("reconfigure", calibration.reconfigure_s + transfer_s)
            run.set_layout(job.members.layout)
            self._exposure(job, restarted=False)


class CheckpointRestartPolicy(RecoveryPolicy):
    """``checkpoint-restart``, the baseline: every worker is replaced and reads the last
    checkpoint, written at the Young/Daly interval unless one is given.

    In the replay: whenever a node that runs a stage is preempted, every node restarts from
    the last checkpoint (``fatal_rendezvous_s + checkpoint_load_s``, work since the
    checkpoint is redone) on the planner's initial layout of the ready nodes (whole
    pipelines first, then up to ``stages_per_worker`` stages on a worker, the Spotline
    policies' limit; fewer workers wait). Checkpoints every ``sqrt(2 * checkpoint_save_s *
    MTBF)`` seconds of training (Young/Daly) where MTBF is the replayed trace's duration over
    its number of preemption instants (or an interval given in
    :class:`~spotline.sim.sim_config.SimConfig`). Nodes that arrive while it runs join at
    the next checkpoint if they make another pipeline, or unfold stages (the checkpoint was
    just written, so nothing is redone)."""

    name: ClassVar[PolicyName] = "checkpoint-restart"
    recovery: ClassVar[CheckpointRestart] = "checkpoint-restart"
    # A restart re-reads the checkpoint onto whole pipelines of the ready nodes (the global
    # batch is fixed, so fewer pipelines means slower steps): the planner's elastic start.
    elastic: ClassVar[bool] = True

    # -- the runtime's face -----------------------------------------------------------------
    def checkpoint_interval(self, cfg: RunConfig, mtbf_s: float | None) -> int:
        """Given, or Young/Daly: sqrt(2 * checkpoint cost * MTBF), in steps."""
        given = cfg.spotline.checkpoints.interval_steps
        if given > 0:
            return given
        if mtbf_s is None:
            return 0
        rec = cfg.spotline.recovery
        return interval_steps(rec.step_time_estimate_s, rec.checkpoint_cost_s, max(mtbf_s, 1e-3))

    def recover(
        self, planner: Replanner, reports: list[WorkerReport], *, reached: int, ready_t: float
    ) -> None:
        planner.restart_all(reports, reached)

    # -- the simulator's face ---------------------------------------------------------------
    def checkpoint_interval_s(self, trace: Trace, config: SimConfig) -> float:
        """Given, or Young/Daly with the trace's MTBF (:func:`~spotline.sim.sim_config.
        trace_mtbf_s`), in seconds of training."""
        interval = config.checkpoint_interval_s
        if interval is None:
            interval = modelled_interval_s(config.model.checkpoint_save_s, trace_mtbf_s(trace))
        return max(interval, MIN_CHECKPOINT_INTERVAL_S)

    def capacity(self, config: SimConfig) -> Capacity:
        # The same memory per worker, no replica in it: a worker runs up to
        # stages_per_worker stages, so fewer nodes than stages still train where they fit
        # (the planner's start waits below Capacity.fewest_workers, as Spotline's does).
        return Capacity(config.stages_per_worker, replicas=False)

    def on_preemption(self, job: ReplayJob, gone: frozenset[Slot]) -> None:
        job.run.rollback()
        job.start()

    def on_arrival(self, job: ReplayJob) -> None:
        pass  # the nodes wait for the next checkpoint

    def on_checkpoint(self, job: ReplayJob) -> None:
        # The checkpoint was just written: growing redoes nothing, only the restart costs.
        members, topology = job.members, job.topology
        if members is None:
            return
        # The elastic start's shape on the ready workers (spotline.plan.layout): more
        # pipelines, or more physical stages for a layout that folds stages, is a growth.
        ready = len(job.ready)
        pipelines = max(1, min(topology.num_logical_workers, ready // topology.num_stages))
        physical = min(topology.num_stages, ready // pipelines)
        shape = members.layout
        if pipelines > shape.num_pipelines or (
            pipelines == shape.num_pipelines and physical > shape.num_physical_stages
        ):
            job.start()


RECOVERY_POLICIES: Mapping[RecoveryMode, RecoveryPolicy] = MappingProxyType(
    {policy.recovery: policy for policy in (FailoverPolicy(), CheckpointRestartPolicy())}
)
"""The runtime's recovery policies by name (``spotline.recovery.mode``); the simulator runs
these same objects (:data:`spotline.sim.simulator.POLICY_MODELS`)."""


_EXPOSED_SHAPES: dict[tuple[tuple[tuple[int, ...], ...], int, bool], tuple[int, ...]] = {}
"""Exposed stages by layout shape, with every worker its own machine (shared by a sweep)."""


def _exposed_stages(
    members: PlacedMembers, machine_of: Mapping[str, str] | None, *, sharded: bool = False
) -> tuple[int, ...]:
    """The members' exposed stages (:func:`spotline.plan.exposure.exposed_stages`):
    ``machine_of`` the machine of each worker (None: each worker its own, so the answer
    depends on the shape only and is memoized); ``sharded``: sharded replicas."""
    layout = members.layout
    if machine_of is None:
        key = (layout.groups, layout.num_pipelines, sharded)
        if key not in _EXPOSED_SHAPES:
            _EXPOSED_SHAPES[key] = exposed_stages(layout, str, sharded=sharded)
        return _EXPOSED_SHAPES[key]
    # The canonical layout names each member after its slot: its machine is its node's.
    domains = {f"m{p}.{i}": machine_of[worker] for (p, i), worker in members.by_slot.items()}
    return exposed_stages(layout, domains.__getitem__, sharded=sharded)
