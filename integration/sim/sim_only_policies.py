"""The policies only the simulator runs: a variant of failover and the two references.

``spotline-rigid``
    Data parallelism fixed to the configured pipelines (the runtime before logical workers,
    and what the recorded validation replay ran): the failover policy's planner without the
    elastic mode, so a loss folds stages in every pipeline.
``on-demand``
    ``num_stages * (num_workers // num_stages)`` on-demand workers (on whole machines), no
    preemptions, no checkpoints, at the on-demand price.
``ideal``
    The upper bound (an oracle): at every instant it trains on the layout of the ready
    workers with the shortest step (:func:`ideal_layout`: at most the configured pipelines,
    each worker running at most ``stages_per_worker`` stages, the memory limit every policy
    obeys), with no rendezvous, reconfiguration, checkpoint or lost work: a change of
    capacity changes the step time at once, and the fraction of a step under way carries
    over. It runs on the trace's spot nodes at the spot price, as the other spot policies
    do.

The references run no runtime policy (:data:`spotline.plan.policies.SIMULATOR_ONLY`; the
runtime's configuration refuses their names).
"""

from __future__ import annotations

import math
from typing import ClassVar

from spotline.plan.capacity import DEFAULT_STAGES_PER_WORKER, Capacity
from spotline.plan.grid import Layout
from spotline.plan.policies import RecoveryMode
from spotline.plan.traces import Trace, TraceEvent
from spotline.sim.calibration import ModelCalibration
from spotline.sim.canonical_plans import Slot
from spotline.sim.membership import Batches, Cluster, membership_batches, spot_cost_usd
from spotline.sim.recovery_policies import FailoverPolicy
from spotline.sim.replay import ReplayJob, SimPolicy
from spotline.sim.results import PolicyResult
from spotline.sim.sim_config import PolicyName, SimConfig, layout_step_time_s
from spotline.sim.training_run import TrainingRun


class RigidSpotlinePolicy(FailoverPolicy):
    """``spotline-rigid``: the same failover with data parallelism fixed to the configured
    pipelines (the planner without its elastic mode)."""

    name: ClassVar[PolicyName] = "spotline-rigid"
    elastic: ClassVar[bool] = False


class OnDemandPolicy(SimPolicy):
    """``on-demand``: whole pipelines of on-demand nodes, never preempted, no checkpoints.
    Its nodes all become ready at once and stay: the job starts once and nothing else
    happens to it, so the per-event hooks never run."""

    name: ClassVar[PolicyName] = "on-demand"
    recovery: ClassVar[RecoveryMode | None] = None  # simulator-only: no runtime policy
    # Started as checkpoint-restart starts: whole pipelines of the ready nodes.
    elastic: ClassVar[bool] = True

    def cluster(self, trace: Trace, config: SimConfig, batches: Batches | None) -> Cluster:
        calibration = config.calibration
        od_trace = on_demand_trace(config, trace.duration_s)
        return Cluster(
            od_trace,
            membership_batches(od_trace, calibration.node_ready_s),
            spot_cost_usd(
                od_trace, calibration.on_demand_price_per_node_hour * config.slots_per_machine
            ),
        )

    def capacity(self, config: SimConfig) -> Capacity:
        # Checkpoint-restart's rule (no replica on a worker): it never loses a worker.
        return Capacity(config.stages_per_worker, replicas=False)

    def checkpoint_interval_s(self, trace: Trace, config: SimConfig) -> float:
        return math.inf

    def on_preemption(self, job: ReplayJob, gone: frozenset[Slot]) -> None:
        raise AssertionError("on-demand nodes are never preempted")

    def on_arrival(self, job: ReplayJob) -> None:
        raise AssertionError("on-demand nodes all arrive at once: the start")

    def on_checkpoint(self, job: ReplayJob) -> None:
        raise AssertionError("on-demand never checkpoints")


class IdealPolicy(SimPolicy):
    """``ideal``: the upper bound (module docstring). It keeps no job state, plans nothing
    and never fails, so it replays the trace itself (:meth:`simulate`) on the shared
    training state machine; the per-event hooks of the job-driven policies never run."""

    name: ClassVar[PolicyName] = "ideal"
    recovery: ClassVar[RecoveryMode | None] = None  # simulator-only: no runtime policy
    elastic: ClassVar[bool] = True  # it drops pipelines or folds, whichever is faster

    def checkpoint_interval_s(self, trace: Trace, config: SimConfig) -> float:
        return math.inf  # it loses nothing, so it never checkpoints

    def on_preemption(self, job: ReplayJob, gone: frozenset[Slot]) -> None:
        raise AssertionError("the ideal drives no ReplayJob (IdealPolicy.simulate)")

    def on_arrival(self, job: ReplayJob) -> None:
        raise AssertionError("the ideal drives no ReplayJob (IdealPolicy.simulate)")

    def on_checkpoint(self, job: ReplayJob) -> None:
        raise AssertionError("the ideal drives no ReplayJob (IdealPolicy.simulate)")

    def simulate(self, trace: Trace, config: SimConfig, batches: Batches | None) -> PolicyResult:
        """Replay ``trace``: after each batch of the membership, the :func:`ideal_layout` of
        the ready workers from that instant, at no cost. ``num_preemptions`` counts the
        batches that remove ready nodes (it uses every one it can)."""
        cluster = self.cluster(trace, config, batches)
        run = TrainingRun(config, self.checkpoint_interval_s(cluster.trace, config))
        slots, max_pipelines = config.slots_per_machine, config.topology.num_logical_workers
        layouts: dict[int, Layout | None] = {}  # by ready workers: a trace repeats its counts
        ready: set[str] = set()
        current: Layout | None = None
        num_preemptions = 0
        for t_s, removed, arrived in cluster.batches:
            run.advance(t_s)
            ready.difference_update(removed)
            ready.update(arrived)
            if removed:
                num_preemptions += 1
            run.num_ready = len(ready)
            workers = len(ready) * slots
            if workers not in layouts:
                layouts[workers] = ideal_layout(
                    config.model, max_pipelines, workers, config.stages_per_worker
                )
            layout = layouts[workers]
            if layout != current:
                if current is None:
                    # Leave waiting at once: a pause of zero seconds is a free start.
                    run.pause("reconfigure", 0.0)
                run.set_layout(layout)
                current = layout
            run.check((), removed, arrived)
        counters = (0, 0, 0, num_preemptions)
        return run.finish(self.name, cluster.trace.duration_s, cluster.cost_usd, counters)


def ideal_layout(
    model: ModelCalibration,
    max_pipelines: int,
    num_workers: int,
    stages_per_worker: int = DEFAULT_STAGES_PER_WORKER,
) -> Layout | None:
    """The layout with the shortest step (:func:`layout_step_time_s`) that ``num_workers``
    ready workers allow: for each count of pipelines up to ``max_pipelines`` (the job's
    logical pipelines), its stages in as many physical stages as the workers allow, folded
    evenly, no worker running more than ``stages_per_worker`` stages; None when too few
    workers for one pipeline within that limit. Ties go to fewer pipelines. Workers are
    named ``w{p}.{i}`` after their slot; the others stand by (unnamed)."""
    num_stages = model.num_stages
    fewest = -(-num_stages // stages_per_worker)  # physical stages within the memory limit
    best: tuple[float, Layout] | None = None
    for pipelines in range(1, min(max_pipelines, num_workers // fewest) + 1):
        physical = min(num_stages, num_workers // pipelines)
        # Even groups in stage order: the widest holds ceil(S / physical) stages, the fewest
        # any cut into ``physical`` groups can, and the step time depends on nothing else.
        sizes = [num_stages // physical + (i < num_stages % physical) for i in range(physical)]
        bounds = [sum(sizes[:i]) for i in range(physical + 1)]
        groups = tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(physical))
        slots = tuple(tuple(f"w{p}.{i}" for i in range(physical)) for p in range(pipelines))
        layout = Layout(num_stages, pipelines, groups, slots)
        assert max(sizes) <= stages_per_worker
        step_s, _ = layout_step_time_s(model, layout)  # the same bound every policy is timed by
        if best is None or step_s < best[0]:
            best = (step_s, layout)
    return None if best is None else best[1]


def on_demand_trace(config: SimConfig, duration_s: float) -> Trace:
    """The on-demand baseline's cluster: one whole-pipelines' worth of nodes, all added at
    time 0 and never removed (whole machines: the last one's spare slots stand by)."""
    num_nodes = math.ceil(config.topology.num_slots / config.slots_per_machine)
    return Trace(
        tuple(TraceEvent(0.0, "add", f"od{i}") for i in range(num_nodes)),
        duration_s,
        f"on-demand: {num_nodes} nodes",
    )
