"""The discrete-event replay: one trace, one policy, the runtime's own planner.

:class:`SimPolicy` is what a simulated policy decides (what a preemption, an arrival and a
completed checkpoint do, its checkpoint interval, restart cost and capacity rule);
:class:`ReplayJob` is one run of it on one trace, driving the training state machine
(:class:`spotline.sim.training_run.TrainingRun`) and calling the runtime's planner
(:class:`spotline.sim.canonical_plans.CanonicalPlanner`) for every placement, takeover and
fatal-loss decision. The policies themselves live elsewhere:

- :mod:`spotline.sim.recovery_policies`: the runtime's recovery policies, each one class with
  its runtime face (what the coordinator does on a loss) beside its simulator face:
  ``spotline`` (:class:`~spotline.sim.recovery_policies.FailoverPolicy`) and
  ``checkpoint-restart``.
- :mod:`spotline.sim.sim_only_policies`: ``spotline-rigid``, ``on-demand`` and ``ideal``.
- :mod:`spotline.sim.simulator`: every policy by name, and :func:`~spotline.sim.simulator.
  simulate`.

Common rules: a node added at t is usable at ``t + node_ready_s`` (a node preempted before
that never joins); it is paid from t at the spot price until its removal or the end of the
trace. A trace node is a *machine* with ``SimConfig.slots_per_machine`` slots (K; one worker
each, the runtime's agent ``--slots K``): its K workers become ready together, a preemption
removes all K at once, and it is paid K times the per-node price (the calibration's node is
one accelerator). With K > 1 the planner is told each worker's machine and places stages by
the runtime's rule (:mod:`spotline.plan.placement`: no machine holds every copy of a stage
where the shape allows it); with K = 1 every worker is its own machine, which the rule
cannot improve on, so the planner is called exactly as before. Training starts (and
restarts after waiting) with a ``fatal_rendezvous_s`` rendezvous once at least one
pipeline's worth of workers is ready within the memory limit (``ceil(num_stages /
stages_per_worker)`` workers; fewer means waiting). The global batch is fixed
(``samples_per_step``), so fewer active pipelines make each step slower, not smaller.
Preemption notices are not exploited by any policy (the same for all; conservative).
Progress is counted in whole steps: a step commits when it ends. Conservation is asserted:
no preempted node is placed, ``trained == committed + redone`` steps, and running + paused +
checkpointing + waiting time == the duration.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import ClassVar

from spotline.plan.capacity import Capacity
from spotline.plan.grid import Layout
from spotline.plan.policies import RecoveryMode
from spotline.plan.traces import Trace
from spotline.sim.canonical_plans import CanonicalPlanner, PlacedMembers, Slot
from spotline.sim.membership import Batches, Cluster, membership_batches, spot_cost_usd
from spotline.sim.results import PlannedLayout, PolicyResult
from spotline.sim.sim_config import PolicyName, SimConfig, Topology
from spotline.sim.training_run import TrainingRun


class SimPolicy(ABC):
    """A simulated policy: what it does on a preemption, on an arrival and after a
    checkpoint, its checkpoint interval and restart cost, and its capacity rule (the nodes
    it runs on, the planner's mode, the nodes a start needs). Stateless: a run's state is
    its :class:`ReplayJob`. A new policy is one subclass added to
    :data:`spotline.sim.simulator.POLICY_MODELS` (and its name to
    :data:`spotline.plan.policies.SimPolicyName`); a runtime recovery policy subclasses
    :class:`spotline.sim.recovery_policies.RecoveryPolicy`, which adds the runtime's face."""

    name: ClassVar[PolicyName]
    recovery: ClassVar[RecoveryMode | None]
    """The runtime recovery policy this one runs
    (:data:`spotline.plan.policies.SIMULATED_RECOVERY`), if any."""
    elastic: ClassVar[bool]
    """The planner's elastic mode: too few nodes drop whole pipelines first (True), or fold
    stages in every pipeline (False)."""

    def cluster(self, trace: Trace, config: SimConfig, batches: Batches | None) -> Cluster:
        """The nodes it runs on: the trace's spot nodes (``batches``, when given, are their
        :func:`membership_batches`)."""
        calibration = config.calibration
        if batches is None:
            batches = membership_batches(trace, calibration.node_ready_s)
        # The calibration prices one accelerator; a machine of K slots costs K of them.
        price = calibration.spot_price_per_node_hour * config.slots_per_machine
        return Cluster(trace, batches, spot_cost_usd(trace, price))

    def min_start_nodes(self, topology: Topology) -> int:
        """The fewest ready workers a (re)start is tried with (the planner may want more)."""
        return 1

    def capacity(self, config: SimConfig) -> Capacity:
        """Room for ``config.stages_per_worker`` logical stages on a worker: a stage and its
        successor's replica (Bamboo's redundancy), or up to that many stages it runs."""
        return Capacity(config.stages_per_worker, replicas=True)

    def restart_cost_s(self, config: SimConfig, *, first: bool) -> float:
        """The pause of a (re)start: rendezvous, plus loading a checkpoint after the first."""
        cost: float = config.calibration.fatal_rendezvous_s
        if not first:
            cost += config.model.checkpoint_load_s
        return cost

    @abstractmethod
    def checkpoint_interval_s(self, trace: Trace, config: SimConfig) -> float:
        """Seconds of training between checkpoints at the start of a run."""

    def on_start(self, job: ReplayJob) -> None:  # noqa: B027 (a hook most policies leave empty)
        """A (re)start has just adopted a layout (no state in memory before it)."""

    @abstractmethod
    def on_preemption(self, job: ReplayJob, gone: frozenset[Slot]) -> None:
        """Members on the slots ``gone`` were preempted (counted already)."""

    @abstractmethod
    def on_arrival(self, job: ReplayJob) -> None:
        """Nodes became ready while members hold the state (a start otherwise)."""

    @abstractmethod
    def on_checkpoint(self, job: ReplayJob) -> None:
        """A checkpoint has just completed."""

    def simulate(self, trace: Trace, config: SimConfig, batches: Batches | None) -> PolicyResult:
        """Replay ``trace`` (rules in the module docstring)."""
        cluster = self.cluster(trace, config, batches)
        job = ReplayJob(self, config, self.checkpoint_interval_s(cluster.trace, config))
        job.replay(cluster.batches)
        return job.result(cluster.trace.duration_s, cluster.cost_usd)


class ReplayJob:
    """One policy's run on one trace: the training state machine, the runtime's planner,
    the ready workers, the members that hold the training state and the counters. The
    policy (:class:`SimPolicy`) decides what a preemption, an arrival and a completed
    checkpoint do to it.

    A worker is one slot of a trace node (a machine): with one slot per machine the worker
    is named after its node, otherwise ``node/slot``, and ``machine_of`` says its node."""

    def __init__(self, policy: SimPolicy, config: SimConfig, interval_s: float) -> None:
        self.policy = policy
        self.config = config
        self.topology = config.topology
        self.run = TrainingRun(config, interval_s)
        self.planner = CanonicalPlanner(
            self.topology.num_stages,
            self.topology.num_logical_workers,
            elastic=policy.elastic,
            capacity=policy.capacity(config),
            sharded=config.sharded_replicas,
        )
        self.slots_per_machine = config.slots_per_machine
        self.machine_of: dict[str, str] = {}
        self.layouts: list[PlannedLayout] | None = [] if config.record_layouts else None
        self.ready: dict[str, None] = {}  # insertion order = the order workers became ready
        # ``members``: the layout whose members hold the training state (None: no state, a
        # start or a restart from the checkpoint is next); ``lost``: its slots gone since it
        # was planned (non-empty while waiting for nodes with the state still held).
        self.members: PlacedMembers | None = None
        self.lost: set[Slot] = set()
        self.num_fatal = self.num_restarts = self.num_failovers = self.num_preemptions = 0
        # Batches of preemptions that took members on two machines or more at once
        # (spotline.plan.exposure.is_burst): the Spotline policies' exposed interval.
        self.num_bursts = 0

    def start(self) -> None:
        """A (re)start on the ready nodes with no state in memory: the planner's first
        layout, paid as the policy's restart cost; waiting for nodes with fewer than the
        policy's ``min_start_nodes`` or too few for the planner."""
        workers = list(self.ready)
        enough = len(workers) >= self.policy.min_start_nodes(self.topology)
        plan = self.planner.initial(len(workers), self.machines(workers)) if enough else None
        self.members = None if plan is None else PlacedMembers(plan, {}, workers)
        self.lost = set()
        if self.members is not None:
            first = not self.run.started
            self.run.started = True
            self.run.pause("restart", self.policy.restart_cost_s(self.config, first=first))
            self.num_restarts += 1
            self.record_layout()
            self.policy.on_start(self)
        self.run.set_layout(None if self.members is None else self.members.layout)

    def machines(self, workers: Sequence[str]) -> list[str] | None:
        """The machine of each of ``workers`` for the planner; None with one slot per
        machine (each worker its own machine: the placement rule changes nothing then, and
        the planner's memo keeps its keys)."""
        if self.slots_per_machine == 1:
            return None
        return [self.machine_of[worker] for worker in workers]

    def idle(self) -> list[str]:
        """The ready workers that run no stage, in the order they became ready."""
        held = self.members.slot_of if self.members is not None else {}
        return [worker for worker in self.ready if worker not in held]

    def record_layout(self) -> None:
        """Keep the members' layout as adopted now, for ``PolicyResult.layouts``."""
        if self.layouts is None or self.members is None:
            return
        members, idle = self.members, self.idle()
        shape = members.layout
        slots = tuple(
            tuple(members.by_slot[(p, i)] for i in range(shape.num_physical_stages))
            for p in range(shape.num_pipelines)
        )
        layout = Layout(shape.num_stages, shape.num_pipelines, shape.groups, slots, tuple(idle))
        machines = {w: self.machine_of.get(w, w) for w in (*members.slot_of, *idle)}
        self.layouts.append(PlannedLayout(self.run.now, layout, machines))

    def _workers(self, nodes: Sequence[str]) -> list[str]:
        """The workers of trace nodes, every slot of each node in slot order."""
        if self.slots_per_machine == 1:
            return list(nodes)
        workers = []
        for node in nodes:
            for slot in range(self.slots_per_machine):
                worker = f"{node}/{slot}"
                self.machine_of[worker] = node
                workers.append(worker)
        return workers

    def placed(self) -> Collection[str]:
        """The workers that run a stage now (none while waiting)."""
        return self.members.slot_of if self.members is not None and not self.lost else {}

    def replay(self, batches: Batches) -> None:
        """Drive the run through ``batches``: a member lost is the policy's preemption, a
        node ready its arrival (or a start when no member holds the state). A node's
        removal removes every worker on it in the same batch: one preemption."""
        run = self.run
        run.on_checkpoint = lambda: self.policy.on_checkpoint(self)
        for t_s, removed_nodes, arrived_nodes in batches:
            removed, arrived = self._workers(removed_nodes), self._workers(arrived_nodes)
            run.advance(t_s)
            for worker in removed:
                del self.ready[worker]
            # Ready nodes: every node's workers come and go together.
            run.num_ready = len(self.ready) // self.slots_per_machine
            # A standby or idle worker that goes changes nothing: the members train on.
            held = self.members.slot_of if self.members is not None else {}
            gone = frozenset(held[w] for w in removed if w in held)
            if gone:
                self.num_preemptions += 1
                self.policy.on_preemption(self, gone)
            if arrived:
                for worker in arrived:
                    self.ready[worker] = None
                run.num_ready = len(self.ready) // self.slots_per_machine
                if self.members is None:
                    self.start()
                else:
                    self.policy.on_arrival(self)
            run.check(self.placed(), removed, arrived)

    def result(self, duration_s: float, cost_usd: float) -> PolicyResult:
        counters = (self.num_fatal, self.num_restarts, self.num_failovers, self.num_preemptions)
        layouts = () if self.layouts is None else tuple(self.layouts)
        return self.run.finish(self.policy.name, duration_s, cost_usd, counters, layouts)
