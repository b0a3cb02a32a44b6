"""Many seeds and many preemption rates: synthetic traces through :mod:`spotline.sim.simulator`.

For each (rate, seed) one :func:`~spotline.plan.traces.synthetic_trace` is drawn and every
policy replays that same trace; the on-demand baseline does not depend on the trace and is
simulated once. Results are averaged over seeds. Work is split over processes when
``num_workers > 1`` (chunks of seeds; the results do not depend on the split).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from spotline.plan.traces import synthetic_trace
from spotline.sim.membership import membership_batches
from spotline.sim.results import PolicyResult
from spotline.sim.sim_config import PolicyName, SimConfig
from spotline.sim.simulator import simulate

METRICS: tuple[str, ...] = (
    "samples_per_s",
    "cost_per_hour",
    "samples_per_usd",
    "restart_s",
    "reconfigure_s",
    "checkpoint_s",
    "waiting_s",
    "running_s",
    "degraded_s",
    "uncalibrated_s",
    "redone_samples",
    "num_fatal_failures",
    "num_restarts",
    "num_failovers",
    "num_preemptions",
    "exposure_checkpoints",
)


@dataclass(frozen=True)
class SyntheticSetup:
    """The synthetic cluster: Poisson preemptions at ``rate_per_node_hour`` for
    ``duration_s``, a replacement node added ``replace_after_s`` after each preemption."""

    rate_per_node_hour: float
    duration_s: float
    replace_after_s: float


@dataclass(frozen=True)
class Aggregate:
    """Mean and (population) standard deviation of each of :data:`METRICS` over seeds."""

    policy: PolicyName
    rate_per_node_hour: float
    num_seeds: int
    mean: tuple[tuple[str, float], ...]
    std: tuple[tuple[str, float], ...]

    def get(self, metric: str) -> float:
        """The mean of ``metric``."""
        return dict(self.mean)[metric]

    def summary(self) -> dict[str, float | int | str]:
        """JSON-ready: means under the metric names, deviations under ``<metric>_std``."""
        out: dict[str, float | int | str] = {
            "policy": self.policy,
            "rate_per_node_hour": self.rate_per_node_hour,
            "num_seeds": self.num_seeds,
        }
        out.update(dict(self.mean))
        out.update({f"{name}_std": value for name, value in self.std})
        return out


def _metric(result: PolicyResult, name: str) -> float:
    value = getattr(result, name)
    assert isinstance(value, int | float)
    return float(value)


def _run_chunk(
    config: SimConfig, setup: SyntheticSetup, policies: tuple[PolicyName, ...], seeds: list[int]
) -> list[dict[str, tuple[float, ...]]]:
    """Per seed, per policy: the metric values (picklable, for worker processes)."""
    rows: list[dict[str, tuple[float, ...]]] = []
    for seed in seeds:
        trace = synthetic_trace(
            config.num_nodes,
            setup.rate_per_node_hour,
            setup.duration_s,
            seed,
            setup.replace_after_s,
        )
        batches = membership_batches(trace, config.calibration.node_ready_s)
        row: dict[str, tuple[float, ...]] = {}
        for policy in policies:
            result = simulate(trace, policy, config, batches=batches)
            row[policy] = tuple(_metric(result, name) for name in METRICS)
        rows.append(row)
    return rows


def _aggregate(policy: PolicyName, rate: float, values: Sequence[tuple[float, ...]]) -> Aggregate:
    count = len(values)
    means = [sum(row[i] for row in values) / count for i in range(len(METRICS))]
    stds = [
        math.sqrt(sum((row[i] - means[i]) ** 2 for row in values) / count)
        for i in range(len(METRICS))
    ]
    return Aggregate(
        policy,
        rate,
        count,
        tuple(zip(METRICS, means, strict=True)),
        tuple(zip(METRICS, stds, strict=True)),
    )


def run_seeds(
    config: SimConfig,
    setup: SyntheticSetup,
    policies: Sequence[PolicyName],
    seeds: Sequence[int],
    *,
    num_workers: int = 1,
    progress: Callable[[int], None] | None = None,
    pool: ProcessPoolExecutor | None = None,
) -> dict[PolicyName, Aggregate]:
    """Average every policy over ``seeds`` at one preemption rate. ``progress`` is called
    with the number of seeds finished each time a chunk completes."""
    if not seeds:
        raise ValueError("run_seeds needs at least one seed")
    stochastic = tuple(policy for policy in policies if policy != "on-demand")
    per_policy: dict[PolicyName, list[tuple[float, ...]]] = {p: [] for p in stochastic}
    seed_list = list(seeds)
    if stochastic:
        # About 20 chunks: enough for a smooth progress bar and for balancing processes.
        num_chunks = min(len(seed_list), 20)
        chunks = [seed_list[i::num_chunks] for i in range(num_chunks)]
        if pool is None and num_workers > 1:
            with ProcessPoolExecutor(max_workers=num_workers) as own_pool:
                return run_seeds(config, setup, policies, seeds, progress=progress, pool=own_pool)
        if pool is None:
            results = []
            for chunk in chunks:
                results.append(_run_chunk(config, setup, stochastic, chunk))
                if progress is not None:
                    progress(len(chunk))
        else:
            futures = [
                pool.submit(_run_chunk, config, setup, stochastic, chunk) for chunk in chunks
            ]
            results = []
            for future, chunk in zip(futures, chunks, strict=True):
                results.append(future.result())
                if progress is not None:
                    progress(len(chunk))
        for rows in results:
            for row in rows:
                for policy in stochastic:
                    per_policy[policy].append(row[policy])
    aggregates = {
        policy: _aggregate(policy, setup.rate_per_node_hour, values)
        for policy, values in per_policy.items()
    }
    if "on-demand" in policies:
        # No failures: one run stands for every seed.
        trace = synthetic_trace(config.num_nodes, 0.0, setup.duration_s, 0, 0.0)
        result = simulate(trace, "on-demand", config)
        values = tuple(_metric(result, name) for name in METRICS)
        aggregates["on-demand"] = _aggregate("on-demand", setup.rate_per_node_hour, [values])
    return {policy: aggregates[policy] for policy in policies}


def sweep(
    config: SimConfig,
    rates: Sequence[float],
    policies: Sequence[PolicyName],
    seeds: Sequence[int],
    *,
    duration_s: float,
    replace_after_s: float,
    num_workers: int = 1,
    progress: Callable[[int], None] | None = None,
) -> dict[float, dict[PolicyName, Aggregate]]:
    """:func:`run_seeds` at each preemption rate (per node-hour); one process pool for all."""
    out: dict[float, dict[PolicyName, Aggregate]] = {}
    pool = ProcessPoolExecutor(max_workers=num_workers) if num_workers > 1 else None
    try:
        for rate in rates:
            setup = SyntheticSetup(rate, duration_s, replace_after_s)
            out[rate] = run_seeds(config, setup, policies, seeds, progress=progress, pool=pool)
    finally:
        if pool is not None:
            pool.shutdown()
    return out
