"""What a replay reports: a policy's :class:`PolicyResult` on one trace (with its timeline and
layouts when recorded), and :func:`versus_references`, each policy against the
:data:`REFERENCES` run on the same trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from spotline.plan.grid import Layout
from spotline.sim.sim_config import PolicyName

REFERENCES: tuple[PolicyName, ...] = ("ideal", "on-demand")
"""The policies every results table compares with (:func:`versus_references`)."""


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
