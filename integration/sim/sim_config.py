"""What one replay is set up with: the job (:class:`SimConfig`, its :class:`Topology`), the
policy names, and the step time of a layout (:func:`layout_step_time_s`, the one bound every
policy is timed by).
"""

from __future__ import annotations

from dataclasses import dataclass

from spotline.plan.capacity import DEFAULT_STAGES_PER_WORKER, Capacity
from spotline.plan.grid import Layout
from spotline.plan.policies import SIM_POLICIES, SimPolicyName
from spotline.plan.traces import Trace
from spotline.sim.calibration import Calibration, ModelCalibration

# The names are spotline.plan.policies' (one vocabulary with the runtime's recovery modes).
PolicyName = SimPolicyName
POLICIES: tuple[PolicyName, ...] = SIM_POLICIES

MIN_CHECKPOINT_INTERVAL_S = 1.0
"""Checkpoint intervals from a rule are at least this (a free checkpoint would otherwise
make the interval 0)."""


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
    every policy under the same limit:
    :meth:`spotline.sim.replay.SimPolicy.capacity`)."""

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
    """``num_stages`` logical stages x ``num_logical_workers`` logical pipelines (EasyScale's
    logical workers; the physical pipelines are each layout's)."""

    num_stages: int
    num_logical_workers: int

    @property
    def num_slots(self) -> int:
        return self.num_stages * self.num_logical_workers
