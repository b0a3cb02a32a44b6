"""Discrete-event cluster simulator: the same preemption trace under several policies.

Policies (:data:`POLICIES`), each a :class:`SimPolicy` in :data:`POLICY_MODELS`:

``spotline``
    Bamboo-style redundancy with elastic logical workers. Every decision is the runtime's
    planner's (:func:`spotline.plan.layout.plan_generation`, the function the coordinator
    calls at each generation), in its elastic mode: members report what they hold (their
    stages and their successor's replica, :func:`~spotline.plan.layout.member_holdings`),
    a preemption or an arrival starts a new generation that pauses training for
    ``reconfigure_s``, and nothing is redone (the replica holder replays the in-flight
    step). Too few nodes for a full layout drop whole pipelines first (the global batch is
    fixed, so each step is slower), then fold stages onto fewer workers (the busiest worker
    sets the pace: :func:`layout_step_time_s`), at most ``SimConfig.stages_per_worker`` on
    one (the memory limit, :mod:`spotline.plan.capacity`); fewer workers wait. Waiting for
    nodes keeps the state. Only a
    :class:`~spotline.plan.layout.FatalLoss` (a stage no survivor holds) rolls back to the
    last checkpoint and pays ``fatal_rendezvous_s + checkpoint_load_s``. Checkpoints every
    ``spotline_checkpoint_interval_s`` of training until the first fatal loss; after k
    fatal losses the interval adapts to Young/Daly with the observed fatal MTBF (now / k),
    as a runtime that counts its fatal losses can (a fixed hourly checkpoint would make the
    rigid variant redo up to an hour per fatal loss). Exposure checkpoints, the
    coordinator's rule (:mod:`spotline.plan.exposure`): a layout that leaves some stage's
    copies on at most two workers (machines, with several slots) checkpoints at its first
    committed step when the layout before it was not exposed (a (re)start excepted), and
    while exposed every Young/Daly interval of the bursts observed so far (batches of
    preemptions that took members on two machines or more), never less often than the
    interval above; ``exposure_checkpoints`` counts them, ``rollbacks`` each return to a
    checkpoint. The runtime counts its exposed interval in steps from the first exposed
    one; here, as for the interval above, in seconds of training since the last checkpoint
    (one that is overdue when the interval shrinks is taken at the next committed step).
``spotline-rigid``
    Data parallelism fixed to the configured pipelines (the runtime before logical workers,
    and what the recorded validation replay ran): the same planner without the elastic
    mode, so a loss folds stages in every pipeline.
``checkpoint-restart``
    Whenever a node that runs a stage is preempted, every node restarts from the last
    checkpoint (``fatal_rendezvous_s + checkpoint_load_s``, work since the checkpoint is
    redone) on the planner's initial layout of the ready nodes (whole pipelines first, then
    up to ``stages_per_worker`` stages on a worker, the Spotline policies' limit; fewer
    workers wait). Checkpoints every
    ``sqrt(2 * checkpoint_save_s * MTBF)`` seconds of training (Young/Daly) where MTBF is the
    replayed trace's duration over its number of preemption instants (or an interval given
    in :class:`SimConfig`). Nodes that arrive while it runs join at the next checkpoint if
    they make another pipeline, or unfold stages (the checkpoint was just written, so
    nothing is redone).
``on-demand``
    ``num_stages * (num_workers // num_stages)`` on-demand workers (on whole machines), no
    preemptions, no checkpoints, at the on-demand price.
``ideal``
    The upper bound (an oracle, simulator-only): at every instant it trains on the layout
    of the ready workers with the shortest step (:func:`ideal_layout`: at most the
    configured pipelines, each worker running at most ``stages_per_worker`` stages, the memory limit every
    policy obeys),
    with no rendezvous, reconfiguration, checkpoint or lost work: a change of capacity
    changes the step time at once, and the fraction of a step under way carries over. It
    runs on the trace's spot nodes at the spot price, as the other spot policies do.

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
stages_per_worker)`` workers; fewer means waiting). The global batch is fixed (``samples_per_step``), so fewer active pipelines make
each step slower, not smaller. Preemption notices are not exploited by any policy (the
same for all; conservative). Progress is counted in whole steps: a step commits when it
ends. Conservation is asserted: no preempted node is placed, ``trained == committed +
redone`` steps, and running + paused + checkpointing + waiting time == the duration.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Literal

from spotline.plan.capacity import DEFAULT_STAGES_PER_WORKER, Capacity
from spotline.plan.exposure import exposed_interval_s, exposed_stages, first_exposure, is_burst
from spotline.plan.layout import (
    FatalLoss,
    Holding,
    Layout,
    WaitForCapacity,
    WorkerReport,
    initial_layout,
    member_holdings,
    plan_generation,
)
from spotline.plan.policies import SIM_POLICIES, RecoveryMode, SimPolicyName
from spotline.plan.traces import Trace, TraceEvent
from spotline.sim.calibration import Calibration, ModelCalibration

# The names are spotline.plan.policies' (one vocabulary with the runtime's recovery modes).
PolicyName = SimPolicyName
POLICIES: tuple[PolicyName, ...] = SIM_POLICIES

MIN_CHECKPOINT_INTERVAL_S = 1.0
"""Checkpoint intervals from a rule are at least this (a free checkpoint would otherwise
make the interval 0)."""

REFERENCES: tuple[PolicyName, ...] = ("ideal", "on-demand")
"""The policies every results table compares with (:func:`versus_references`)."""

_Status = Literal["waiting", "paused", "running", "checkpointing"]
_PauseKind = Literal["restart", "reconfigure"]


def layout_step_time_s(model: ModelCalibration, layout: Layout) -> tuple[float, bool]:
    """``(seconds, calibrated)`` per step of ``layout``: the table's time for its physical
    pipelines; with merged stages the pipeline runs at the pace of its busiest worker, which
    runs k logical stages: the degraded time (one extra stage) plus one more increment per
    further stage. ``calibrated`` is False when the pipeline count lies outside the table's
    measured rows: the time is then the table's bound (``step_time_bound_s``), which never
    flatters, and the run counts the time it trained on it."""
    base, inside = model.step_time_bound_s(layout.num_pipelines, False)
    widest = max(len(group) for group in layout.groups)
    if widest == 1:
        return base, inside
    degraded, degraded_inside = model.step_time_bound_s(layout.num_pipelines, True)
    return degraded + (degraded - base) * (widest - 2), inside and degraded_inside


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


def young_daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young/Daly's optimal checkpoint interval: sqrt(2 * checkpoint_cost * MTBF)."""
    if checkpoint_cost_s < 0 or mtbf_s <= 0:
        raise ValueError("checkpoint_cost_s must be >= 0 and mtbf_s > 0")
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def trace_mtbf_s(trace: Trace) -> float:
    """Mean time between preemptions of a trace: its duration over the number of distinct
    instants at which nodes are removed (a burst of removals is one failure of the job);
    the whole duration when nothing is removed."""
    instants = {event.t_s for event in trace.events if event.kind == "remove"}
    return trace.duration_s / max(1, len(instants)) if trace.duration_s > 0 else 1.0


@dataclass(frozen=True)
class SimConfig:
    """One simulation set-up: the model's calibration, the cluster-wide calibration, the
    number of nodes (machines) the job asks for and the slots (workers) of each (its logical
    topology is ``num_stages`` x ``num_nodes * slots_per_machine // num_stages``), optional
    checkpoint intervals (None: the policy's rule), whether to record a timeline for plots
    (off for sweeps: it costs time), whether to record every layout planned (for tests),
    and the logical stages one worker has room for (``stages_per_worker``: a stage and its
    replica, or the stages it runs: the runtime's ``spotline.redundancy.stages_per_worker``,
    every policy under the same limit: :meth:`SimPolicy.capacity`)."""

    calibration: Calibration
    model: ModelCalibration
    num_nodes: int
    checkpoint_interval_s: float | None = None
    spotline_checkpoint_interval_s: float | None = None
    record_timeline: bool = False
    slots_per_machine: int = 1
    record_layouts: bool = False
    stages_per_worker: int = DEFAULT_STAGES_PER_WORKER
    # The runtime's spotline.redundancy.replica "sharded": the Spotline policies' replica
    # holders keep one shard each (spotline.plan.shards), so a stage whose owners are all
    # lost survives only while every one of its shard holders lives.
    sharded_replicas: bool = False

    def __post_init__(self) -> None:
        # One rule with the runtime's spotline.redundancy.stages_per_worker (its one-line
        # ValueError): the Spotline policies keep a replica beside each worker's stage.
        Capacity(self.stages_per_worker, replicas=True)
        # bool is an int to Python; a slot count of True is a mistake, not 1.
        if type(self.slots_per_machine) is not int or self.slots_per_machine < 1:
            raise ValueError(
                f"slots_per_machine must be an integer >= 1, got {self.slots_per_machine!r}"
            )
        if self.num_workers < self.model.num_stages:
            slots = "" if self.slots_per_machine == 1 else f" of {self.slots_per_machine} slots"
            raise ValueError(
                f"{self.num_nodes} nodes{slots} cannot hold one pipeline of model "
                f"{self.model.name!r}, which has {self.model.num_stages} stages"
            )
        for interval in (self.checkpoint_interval_s, self.spotline_checkpoint_interval_s):
            if interval is not None and not interval > 0:
                raise ValueError(f"checkpoint intervals must be > 0, got {interval}")

    @property
    def num_workers(self) -> int:
        """Worker processes the job asks for: every slot of every node."""
        return self.num_nodes * self.slots_per_machine

    @property
    def topology(self) -> Topology:
        """The job's fixed logical topology."""
        return Topology(self.model.num_stages, self.num_workers // self.model.num_stages)


@dataclass(frozen=True)
class Topology:
    """``num_stages`` logical stages x ``num_pipelines`` logical pipelines."""

    num_stages: int
    num_pipelines: int

    @property
    def num_slots(self) -> int:
        return self.num_stages * self.num_pipelines


@dataclass(frozen=True)
class TimelinePoint:
    """The state from ``t_s`` on: training rate (0 when not training), committed samples so
    far, ready nodes, and active pipelines (0 when none run)."""

    t_s: float
    samples_per_s: float
    committed_samples: int
    num_ready_nodes: int
    num_active_pipelines: int


@dataclass(frozen=True)
class PlannedLayout:
    """A layout the simulator adopted at ``t_s`` (recorded with ``SimConfig.record_layouts``),
    its members and standbys named as the job's workers (``node/slot`` with several slots per
    machine, the node's name with one), and the machine (trace node) of each of them."""

    t_s: float
    layout: Layout
    machines: Mapping[str, str]


@dataclass(frozen=True)
class PolicyResult:
    """What one policy achieved on one trace. Times are seconds, money US dollars.

    ``restart_s`` is time lost to restarts (checkpoint-restart restarts, Spotline's fatal
    fallbacks, the first start); ``reconfigure_s`` Spotline's in-memory failovers and
    rebalances; ``redone_samples`` work rolled back to a checkpoint and done again;
    ``degraded_s`` training time with a worker running two stages; ``uncalibrated_s``
    training time at a pipeline count outside the calibration's measured rows, whose step
    time is a bound that understates throughput (see ``ModelCalibration.step_time_bound_s``).
    """

    policy: PolicyName
    duration_s: float
    committed_samples: int
    cost_usd: float
    running_s: float
    restart_s: float
    reconfigure_s: float
    checkpoint_s: float
    waiting_s: float
    degraded_s: float
    redone_samples: int
    num_fatal_failures: int
    num_restarts: int
    num_failovers: int
    num_preemptions: int
    checkpoint_interval_s: float
    timeline: tuple[TimelinePoint, ...] = ()
    layouts: tuple[PlannedLayout, ...] = ()
    uncalibrated_s: float = 0.0
    exposure_checkpoints: int = 0
    rollbacks: tuple[tuple[float, int], ...] = ()
    """Each return to a checkpoint: (seconds into the trace, samples rolled back)."""

    @property
    def samples_per_s(self) -> float:
        """Committed samples over the whole duration."""
        return self.committed_samples / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def cost_per_hour(self) -> float:
        """Average spend per hour."""
        return self.cost_usd / (self.duration_s / 3600.0) if self.duration_s > 0 else 0.0

    @property
    def samples_per_usd(self) -> float:
        """Value: committed samples per dollar."""
        return self.committed_samples / self.cost_usd if self.cost_usd > 0 else 0.0

    def summary(self) -> dict[str, float | int | str]:
        """The scalar results as a JSON-ready dict (the timeline is left out)."""
        return {
            "policy": self.policy,
            "samples_per_s": self.samples_per_s,
            "cost_per_hour": self.cost_per_hour,
            "samples_per_usd": self.samples_per_usd,
            "committed_samples": self.committed_samples,
            "cost_usd": self.cost_usd,
            "duration_s": self.duration_s,
            "running_s": self.running_s,
            "restart_s": self.restart_s,
            "reconfigure_s": self.reconfigure_s,
            "checkpoint_s": self.checkpoint_s,
            "waiting_s": self.waiting_s,
            "degraded_s": self.degraded_s,
            "uncalibrated_s": self.uncalibrated_s,
            "redone_samples": self.redone_samples,
            "num_fatal_failures": self.num_fatal_failures,
            "num_restarts": self.num_restarts,
            "num_failovers": self.num_failovers,
            "num_preemptions": self.num_preemptions,
            "checkpoint_interval_s": self.checkpoint_interval_s,
            "exposure_checkpoints": self.exposure_checkpoints,
        }


def versus_references(
    summaries: Mapping[PolicyName, Mapping[str, float | int | str]],
) -> dict[PolicyName, dict[str, float | None]]:
    """Each policy against the :data:`REFERENCES` run on the same trace (or the same seeds):
    ``samples_vs_ideal``, its samples as a fraction of the ideal's, and
    ``cost_per_sample_vs_on_demand``, its dollars per sample over on-demand's.

    ``summaries`` are :meth:`PolicyResult.summary` dicts or a sweep's means (every policy
    over the same duration): samples are compared by ``samples_per_s`` and dollars per
    sample are ``cost_per_hour / 3600 / samples_per_s``, so over seeds these are ratios of
    totals (total samples, total dollars), not means of per-seed ratios. A reference missing
    or without samples, or a policy without samples, gives None (no number)."""

    def number(policy: PolicyName, key: str) -> float:
        value = summaries[policy][key]
        assert isinstance(value, int | float), (policy, key, value)
        return float(value)

    def per_sample(policy: PolicyName) -> float | None:
        if policy not in summaries or not number(policy, "samples_per_s") > 0:
            return None
        return number(policy, "cost_per_hour") / 3600.0 / number(policy, "samples_per_s")

    ideal = number("ideal", "samples_per_s") if "ideal" in summaries else 0.0
    on_demand = per_sample("on-demand")
    out: dict[PolicyName, dict[str, float | None]] = {}
    for policy in summaries:
        cost = per_sample(policy)
        out[policy] = {
            "samples_vs_ideal": number(policy, "samples_per_s") / ideal if ideal > 0 else None,
            "cost_per_sample_vs_on_demand": (
                cost / on_demand if cost is not None and on_demand else None
            ),
        }
    return out


def membership_batches(
    trace: Trace, node_ready_s: float, *, warm_pool: int = 0, initial_ready: bool = False
) -> list[tuple[float, list[str], list[str]]]:
    """The trace as the job sees it: ``(t_s, removed, ready)`` batches in time order.

    A node added at t becomes ready at ``t + node_ready_s`` unless it is removed first (then
    its removal is invisible to the job, except in the bill); within one instant removals
    come before arrivals. Only batches before the end of the trace are kept.

    ``warm_pool`` processes started ahead (AWS calls them warm pools; the local launcher's
    ``recovery.warm_workers``) make an arrival ready as soon as one of them has started; each
    one taken is replaced by a new one that needs ``node_ready_s``. With ``initial_ready``
    the nodes of the trace's first instant are ready at once (a local replay's clock starts
    when its first workers have started).
    """
    # When each warm process will have started (all of them at the start).
    pool = [0.0] * warm_pool
    first_t = trace.events[0].t_s if trace.events else 0.0
    removed_at: dict[tuple[str, int], float] = {}
    occurrence: dict[str, int] = {}
    adds: list[tuple[float, str, int]] = []
    for event in trace.events:
        if event.kind == "add":
            occurrence[event.node] = occurrence.get(event.node, -1) + 1
            adds.append((event.t_s, event.node, occurrence[event.node]))
        else:
            removed_at[(event.node, occurrence[event.node])] = event.t_s
    # (time, 0 = remove / 1 = ready, sequence, node): sorting gives removals first.
    items: list[tuple[float, int, int, str]] = []
    for sequence, (t_s, node, nth) in enumerate(adds):
        if initial_ready and t_s == first_t:
            ready_t = t_s
        elif pool:
            soonest = min(range(len(pool)), key=pool.__getitem__)
            ready_t = max(t_s, pool[soonest])
            pool[soonest] = t_s + node_ready_s  # its replacement starts now
        else:
            ready_t = t_s + node_ready_s
        removed_t = removed_at.get((node, nth), math.inf)
        if ready_t < removed_t and ready_t < trace.duration_s:
            items.append((ready_t, 1, sequence, node))
            if removed_t < trace.duration_s:
                items.append((removed_t, 0, sequence, node))
    items.sort()
    batches: list[tuple[float, list[str], list[str]]] = []
    for t_s, kind, _, node in items:
        if not batches or batches[-1][0] != t_s:
            batches.append((t_s, [], []))
        (batches[-1][2] if kind else batches[-1][1]).append(node)
    return batches


def spot_cost_usd(trace: Trace, price_per_node_hour: float) -> float:
    """What the trace's nodes cost: every node from its add to its removal (or the end)."""
    added: dict[str, float] = {}
    node_seconds = 0.0
    for event in trace.events:
        if event.kind == "add":
            added[event.node] = event.t_s
        else:
            node_seconds += event.t_s - added.pop(event.node)
    node_seconds += sum(trace.duration_s - t_s for t_s in added.values())
    cost_usd: float = node_seconds / 3600.0 * price_per_node_hour
    return cost_usd


class _Run:
    """The training state machine shared by the policies: time buckets, the step ledger and
    the checkpoint timer. Policies drive it through pause/rollback/set_rate."""

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


def _finish(
    run: _Run,
    policy: PolicyName,
    duration_s: float,
    cost_usd: float,
    counters: tuple[int, int, int, int],
    layouts: tuple[PlannedLayout, ...] = (),
) -> PolicyResult:
    run.advance(duration_s)
    num_fatal, num_restarts, num_failovers, num_preemptions = counters
    accounted = run.running_s + run.restart_s + run.reconfigure_s + run.checkpoint_s + run.waiting_s
    assert abs(accounted - duration_s) <= 1e-6 * max(1.0, duration_s), (accounted, duration_s)
    assert run.trained_steps == run.committed_steps + run.redone_steps
    return PolicyResult(
        policy=policy,
        duration_s=duration_s,
        committed_samples=run.committed_steps * run.samples_per_step,
        cost_usd=cost_usd,
        running_s=run.running_s,
        restart_s=run.restart_s,
        reconfigure_s=run.reconfigure_s,
        checkpoint_s=run.checkpoint_s,
        waiting_s=run.waiting_s,
        degraded_s=run.degraded_s,
        uncalibrated_s=run.uncalibrated_s,
        redone_samples=run.redone_steps * run.samples_per_step,
        num_fatal_failures=num_fatal,
        num_restarts=num_restarts,
        num_failovers=num_failovers,
        num_preemptions=num_preemptions,
        checkpoint_interval_s=run.base_interval_s,
        exposure_checkpoints=run.exposure_checkpoints,
        rollbacks=tuple((t_s, steps * run.samples_per_step) for t_s, steps in run.rollbacks),
        timeline=tuple(run.timeline) if run.timeline is not None else (),
        layouts=layouts,
    )


Slot = tuple[int, int]  # (physical pipeline, physical stage)


@dataclass(frozen=True)
class _Plan:
    """A planned layout with canonical names, and where each slot's worker comes from:
    ``kept`` (new slot, its slot in the last layout) and ``joined`` (new slot, index among
    the idle nodes). Idle nodes not placed stand by."""

    layout: Layout
    kept: tuple[tuple[Slot, Slot], ...]
    joined: tuple[tuple[Slot, int], ...]
    shape: Layout  # the layout with members named after their slots, no standbys
    moves_state: bool  # some member must receive a stage it does not hold

    @staticmethod
    def of(layout: Layout, held: dict[str, tuple[Holding, ...]] | None = None) -> _Plan:
        kept: list[tuple[Slot, Slot]] = []
        joined: list[tuple[Slot, int]] = []
        for p, row in enumerate(layout.slots):
            for i, name in enumerate(row):
                if name.startswith("m"):
                    old_p, old_i = name[1:].split(".")
                    kept.append(((p, i), (int(old_p), int(old_i))))
                else:
                    joined.append(((p, i), int(name[1:])))
        moves = held is not None and any(
            # A shard is not the stage: a member holding only a shard receives the rest.
            not set(layout.groups[i]) <= {h.stage for h in held.get(name, ()) if h.whole}
            for row in layout.slots
            for i, name in enumerate(row)
        )
        return _Plan(layout, tuple(kept), tuple(joined), _canonical(layout), moves)

    def place(self, last: dict[Slot, str], idle: Sequence[str]) -> dict[Slot, str]:
        """The real node on each slot, given the last layout's and the idle nodes."""
        placed = {new: last[old] for new, old in self.kept}
        placed.update((new, idle[k]) for new, k in self.joined)
        return placed


class _RuntimePlanner:
    """The runtime's planner (:mod:`spotline.plan.layout`), called with canonical worker
    names and memoized, so that a sweep of thousands of runs plans each situation once.

    A situation is the last layout's shape (groups, physical pipelines), which of its slots
    were lost, and how many idle nodes there are. Members are named ``m{p}.{i}`` after their
    slot and idle nodes ``i{k}`` after their order: a plan depends on the workers' order,
    never on their names (tests/test_layout.py checks this), so the canonical plan holds for
    the real nodes. With machines of several slots the situation also says which workers
    share a machine, as machines numbered in order of first appearance among the workers
    (:func:`_partition`): the placement rule groups workers by machine and breaks ties by
    worker order, never by a machine's name.
    """

    # Shared by every run of a process (a sweep runs thousands): the planner is pure.
    _plans: ClassVar[dict[tuple[object, ...], _Plan | None | WaitForCapacity | FatalLoss]] = {}

    def __init__(
        self,
        num_stages: int,
        num_pipelines: int,
        *,
        elastic: bool,
        capacity: Capacity,
        sharded: bool = False,
    ) -> None:
        self.num_stages = num_stages
        self.num_pipelines = num_pipelines
        self.elastic = elastic
        self.capacity = capacity
        self.sharded = sharded

    def initial(self, num_workers: int, machines: Sequence[str] | None = None) -> _Plan | None:
        """A start from nothing (first start, or the restart after a fatal loss) on
        ``num_workers`` ready workers; ``machines``: the machine of each (None: not said)."""
        partition = None if machines is None else _partition(machines)
        key: tuple[object, ...] = (
            self.num_stages,
            self.num_pipelines,
            self.elastic,
            self.capacity,
            num_workers,
        )
        if partition is not None:
            key += (partition,)
        if key not in self._plans:
            idle = [f"i{k}" for k in range(num_workers)]
            said = None if partition is None else dict(zip(idle, _named(partition), strict=True))
            layout = initial_layout(
                self.num_stages,
                self.num_pipelines,
                idle,
                elastic=self.elastic,
                machines=said,
                capacity=self.capacity,
                sharded=self.sharded,
            )
            self._plans[key] = None if layout is None else _Plan.of(layout)
        planned = self._plans[key]
        assert not isinstance(planned, (FatalLoss, WaitForCapacity))
        return planned

    def replan(
        self,
        last: Layout,
        lost: frozenset[Slot],
        num_idle: int,
        machines: tuple[Mapping[Slot, str], Sequence[str]] | None = None,
    ) -> _Plan | None | WaitForCapacity | FatalLoss:
        """The next generation after ``last`` (canonical), whose slots ``lost`` are gone,
        with ``num_idle`` idle nodes: a plan, None (waiting for nodes), a wait for capacity
        (the survivors hold the state, too few to hold it within capacity) or a FatalLoss.
        ``machines``: the machine of each of ``last``'s slots and of each idle node (None:
        not said)."""
        survivors = [
            (p, i)
            for i in range(last.num_physical_stages)
            for p in range(last.num_pipelines)
            if (p, i) not in lost
        ]
        partition = None
        if machines is not None:
            by_slot, idle_machines = machines
            assert len(idle_machines) == num_idle
            partition = _partition([by_slot[slot] for slot in survivors] + list(idle_machines))
        key: tuple[object, ...] = (
            self.num_stages,
            self.num_pipelines,
            self.elastic,
            self.capacity,
            last.groups,
            last.num_pipelines,
            lost,
            num_idle,
            self.sharded,
        )
        if partition is not None:
            key += (partition,)
        if key not in self._plans:
            held = member_holdings(last, 1, replicas=True, sharded=self.sharded)
            reports = [
                WorkerReport(last.slots[p][i], held[last.slots[p][i]], (p, i)) for p, i in survivors
            ] + [WorkerReport(f"i{k}") for k in range(num_idle)]
            if partition is not None:
                reports = [
                    dataclasses.replace(report, machine=machine)
                    for report, machine in zip(reports, _named(partition), strict=True)
                ]
            result = plan_generation(
                0,
                self.num_stages,
                self.num_pipelines,
                reports,
                elastic=self.elastic,
                capacity=self.capacity,
                sharded=self.sharded,
            )
            if isinstance(result, (FatalLoss, WaitForCapacity)):
                self._plans[key] = result
            else:
                self._plans[key] = None if result.layout is None else _Plan.of(result.layout, held)
        return self._plans[key]


def _partition(machines: Sequence[str]) -> tuple[int, ...]:
    """Which workers share a machine, whatever the machines' names: each worker's machine
    numbered in order of first appearance (``["b", "a", "b"]`` -> ``(0, 1, 0)``)."""
    numbers: dict[str, int] = {}
    return tuple(numbers.setdefault(machine, len(numbers)) for machine in machines)


def _named(partition: Sequence[int]) -> list[str]:
    """Canonical machine names for a :func:`_partition`."""
    return [f"M{number}" for number in partition]


def _canonical(layout: Layout) -> Layout:
    """``layout`` with each member named ``m{p}.{i}`` after its slot and no standbys."""
    return Layout(
        layout.num_stages,
        layout.num_pipelines,
        layout.groups,
        tuple(tuple(f"m{p}.{i}" for i in range(len(row))) for p, row in enumerate(layout.slots)),
    )


_EXPOSED_SHAPES: dict[tuple[tuple[tuple[int, ...], ...], int, bool], tuple[int, ...]] = {}
"""Exposed stages by layout shape, with every worker its own machine (shared by a sweep)."""


def _exposed_stages(
    members: _Members, machine_of: Mapping[str, str] | None, *, sharded: bool = False
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


class _Members:
    """The running (or last) layout in the simulator: its canonical shape and the node on
    each slot."""

    def __init__(self, plan: _Plan, last: dict[Slot, str], idle: Sequence[str]) -> None:
        self.layout = plan.shape
        self.by_slot = plan.place(last, idle)
        self.slot_of = {node: slot for slot, node in self.by_slot.items()}


Batches = Sequence[tuple[float, list[str], list[str]]]
"""A trace as the job sees it (:func:`membership_batches`)."""


@dataclass(frozen=True)
class Cluster:
    """The nodes a policy runs on: the trace it replays, that trace's membership batches,
    and what its nodes cost."""

    trace: Trace
    batches: Batches
    cost_usd: float


class _Job:
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
        self.run = _Run(config, interval_s)
        self.planner = _RuntimePlanner(
            self.topology.num_stages,
            self.topology.num_pipelines,
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
        self.members: _Members | None = None
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
        self.members = None if plan is None else _Members(plan, {}, workers)
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
        return _finish(self.run, self.policy.name, duration_s, cost_usd, counters, layouts)


class SimPolicy(ABC):
    """A simulated policy: what it does on a preemption, on an arrival and after a
    checkpoint, its checkpoint interval and restart cost, and its capacity rule (the nodes
    it runs on, the planner's mode, the nodes a start needs). Stateless: a run's state is
    its :class:`_Job`. A new policy is one subclass added to :data:`POLICY_MODELS` (and its
    name to :data:`spotline.plan.policies.SimPolicyName`)."""

    name: ClassVar[PolicyName]
    recovery: ClassVar[RecoveryMode | None]
    """The runtime recovery policy this one runs (:data:`SIMULATED_RECOVERY`), if any."""
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

    def on_start(self, job: _Job) -> None:  # noqa: B027 (a hook most policies leave empty)
        """A (re)start has just adopted a layout (no state in memory before it)."""

    @abstractmethod
    def on_preemption(self, job: _Job, gone: frozenset[Slot]) -> None:
        """Members on the slots ``gone`` were preempted (counted already)."""

    @abstractmethod
    def on_arrival(self, job: _Job) -> None:
        """Nodes became ready while members hold the state (a start otherwise)."""

    @abstractmethod
    def on_checkpoint(self, job: _Job) -> None:
        """A checkpoint has just completed."""

    def simulate(self, trace: Trace, config: SimConfig, batches: Batches | None) -> PolicyResult:
        """Replay ``trace`` (rules in the module docstring)."""
        cluster = self.cluster(trace, config, batches)
        job = _Job(self, config, self.checkpoint_interval_s(cluster.trace, config))
        job.replay(cluster.batches)
        return job.result(cluster.trace.duration_s, cluster.cost_usd)


class SpotlinePolicy(SimPolicy):
    """``spotline``: in-memory failover with elastic logical workers."""

    name: ClassVar[PolicyName] = "spotline"
    recovery: ClassVar[RecoveryMode | None] = "failover"
    elastic: ClassVar[bool] = True

    def checkpoint_interval_s(self, trace: Trace, config: SimConfig) -> float:
        interval = config.spotline_checkpoint_interval_s
        if interval is None:
            interval = config.calibration.spotline_checkpoint_interval_s
        return interval

    def on_preemption(self, job: _Job, gone: frozenset[Slot]) -> None:
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

    def on_arrival(self, job: _Job) -> None:
        # An arrival joins at a step boundary: a new generation, as in the runtime.
        self._replan(job)

    def on_checkpoint(self, job: _Job) -> None:
        pass  # nodes join when they arrive, not at a checkpoint

    def _replan(self, job: _Job) -> None:
        """The next generation from what the survivors hold and the idle nodes."""
        members, run = job.members, job.run
        assert members is not None
        idle = job.idle()
        where = None
        if job.slots_per_machine > 1:
            # The machine of each slot of the last layout (its lost ones unused) and of each
            # idle worker: what the placement rule needs (see _Job.machines).
            machine = job.machine_of
            by_slot = {slot: machine[worker] for slot, worker in members.by_slot.items()}
            where = (by_slot, [machine[worker] for worker in idle])
        result = job.planner.replan(members.layout, frozenset(job.lost), len(idle), where)
        if isinstance(result, FatalLoss):
            job.num_fatal += 1
            run.rollback()
            run.base_interval_s = max(
                MIN_CHECKPOINT_INTERVAL_S,
                young_daly_interval_s(
                    job.config.model.checkpoint_save_s, max(run.now, 1.0) / job.num_fatal
                ),
            )
            job.start()
        elif result is None or isinstance(result, WaitForCapacity):
            # Too few nodes (for the pipelines, or to hold the model within capacity): wait,
            # the survivors keep the state.
            run.set_layout(None)
        else:
            job.members, job.lost = _Members(result, members.by_slot, idle), set()
            job.record_layout()
            calibration = job.config.calibration
            transfer_s = calibration.state_transfer_s if result.moves_state else 0.0
            run.pause("reconfigure", calibration.reconfigure_s + transfer_s)
            run.set_layout(job.members.layout)
            self._exposure(job, restarted=False)

    def on_start(self, job: _Job) -> None:
        self._exposure(job, restarted=True)

    def _exposure(self, job: _Job, *, restarted: bool) -> None:
        """The exposure rule on the layout just adopted (spotline.plan.exposure, the
        coordinator's): a checkpoint at the first committed step of a first exposure, and
        the Young/Daly interval of the preemptions observed so far while exposed."""
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


class RigidSpotlinePolicy(SpotlinePolicy):
    """``spotline-rigid``: the same failover with data parallelism fixed to the configured
    pipelines (the planner without its elastic mode)."""

    name: ClassVar[PolicyName] = "spotline-rigid"
    elastic: ClassVar[bool] = False


class CheckpointRestartPolicy(SimPolicy):
    """``checkpoint-restart``: every member restarts from the last checkpoint on a
    preemption; arrivals join at the next checkpoint."""

    name: ClassVar[PolicyName] = "checkpoint-restart"
    recovery: ClassVar[RecoveryMode | None] = "checkpoint-restart"
    # A restart re-reads the checkpoint onto whole pipelines of the ready nodes (the global
    # batch is fixed, so fewer pipelines means slower steps): the planner's elastic start.
    elastic: ClassVar[bool] = True

    def checkpoint_interval_s(self, trace: Trace, config: SimConfig) -> float:
        interval = config.checkpoint_interval_s
        if interval is None:
            interval = young_daly_interval_s(config.model.checkpoint_save_s, trace_mtbf_s(trace))
        return max(interval, MIN_CHECKPOINT_INTERVAL_S)

    def capacity(self, config: SimConfig) -> Capacity:
        # The same memory per worker, no replica in it: a worker runs up to
        # stages_per_worker stages, so fewer nodes than stages still train where they fit
        # (the planner's start waits below Capacity.fewest_workers, as Spotline's does).
        return Capacity(config.stages_per_worker, replicas=False)

    def on_preemption(self, job: _Job, gone: frozenset[Slot]) -> None:
        job.run.rollback()
        job.start()

    def on_arrival(self, job: _Job) -> None:
        pass  # the nodes wait for the next checkpoint

    def on_checkpoint(self, job: _Job) -> None:
        # The checkpoint was just written: growing redoes nothing, only the restart costs.
        members, topology = job.members, job.topology
        if members is None:
            return
        # The elastic start's shape on the ready workers (spotline.plan.layout): more
        # pipelines, or more physical stages for a layout that folds stages, is a growth.
        ready = len(job.ready)
        pipelines = max(1, min(topology.num_pipelines, ready // topology.num_stages))
        physical = min(topology.num_stages, ready // pipelines)
        shape = members.layout
        if pipelines > shape.num_pipelines or (
            pipelines == shape.num_pipelines and physical > shape.num_physical_stages
        ):
            job.start()


class OnDemandPolicy(CheckpointRestartPolicy):
    """``on-demand``: whole pipelines of on-demand nodes, never preempted, no checkpoints."""

    name: ClassVar[PolicyName] = "on-demand"
    recovery: ClassVar[RecoveryMode | None] = None

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

    def checkpoint_interval_s(self, trace: Trace, config: SimConfig) -> float:
        return math.inf


class IdealPolicy(SimPolicy):
    """``ideal``: the upper bound (module docstring). It keeps no job state, plans nothing
    and never fails, so it replays the trace itself (:meth:`simulate`) on the shared
    training state machine; the per-event hooks of the job-driven policies never run."""

    name: ClassVar[PolicyName] = "ideal"
    recovery: ClassVar[RecoveryMode | None] = None  # simulator-only: no runtime policy
    elastic: ClassVar[bool] = True  # it drops pipelines or folds, whichever is faster

    def checkpoint_interval_s(self, trace: Trace, config: SimConfig) -> float:
        return math.inf  # it loses nothing, so it never checkpoints

    def on_preemption(self, job: _Job, gone: frozenset[Slot]) -> None:
        raise AssertionError("the ideal drives no _Job (IdealPolicy.simulate)")

    def on_arrival(self, job: _Job) -> None:
        raise AssertionError("the ideal drives no _Job (IdealPolicy.simulate)")

    def on_checkpoint(self, job: _Job) -> None:
        raise AssertionError("the ideal drives no _Job (IdealPolicy.simulate)")

    def simulate(self, trace: Trace, config: SimConfig, batches: Batches | None) -> PolicyResult:
        """Replay ``trace``: after each batch of the membership, the :func:`ideal_layout` of
        the ready workers from that instant, at no cost. ``num_preemptions`` counts the
        batches that remove ready nodes (it uses every one it can)."""
        cluster = self.cluster(trace, config, batches)
        run = _Run(config, self.checkpoint_interval_s(cluster.trace, config))
        slots, max_pipelines = config.slots_per_machine, config.topology.num_pipelines
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
        return _finish(run, self.name, cluster.trace.duration_s, cluster.cost_usd, counters)


POLICY_MODELS: Mapping[PolicyName, SimPolicy] = MappingProxyType(
    {
        policy.name: policy
        for policy in (
            SpotlinePolicy(),
            RigidSpotlinePolicy(),
            CheckpointRestartPolicy(),
            OnDemandPolicy(),
            IdealPolicy(),
        )
    }
)
"""The simulated policies by name, in :data:`POLICIES` order."""


def on_demand_trace(config: SimConfig, duration_s: float) -> Trace:
    """The on-demand baseline's cluster: one whole-pipelines' worth of nodes, all added at
    time 0 and never removed (whole machines: the last one's spare slots stand by)."""
    num_nodes = math.ceil(config.topology.num_slots / config.slots_per_machine)
    return Trace(
        tuple(TraceEvent(0.0, "add", f"od{i}") for i in range(num_nodes)),
        duration_s,
        f"on-demand: {num_nodes} nodes",
    )


def simulate(
    trace: Trace,
    policy: PolicyName,
    config: SimConfig,
    *,
    batches: Batches | None = None,
) -> PolicyResult:
    """Replay ``trace`` under ``policy`` (rules in the module docstring).

    ``batches`` may pass :func:`membership_batches` of the trace, computed once for several
    policies. ``on-demand`` ignores the trace's nodes and uses only its duration.
    """
    model = POLICY_MODELS.get(policy)
    if model is None:
        raise ValueError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")
    return model.simulate(trace, config, batches)


def simulate_policies(
    trace: Trace, policies: Sequence[PolicyName], config: SimConfig
) -> dict[PolicyName, PolicyResult]:
    """Run several policies on the same trace (the membership timeline computed once)."""
    batches = membership_batches(trace, config.calibration.node_ready_s)
    return {policy: simulate(trace, policy, config, batches=batches) for policy in policies}
