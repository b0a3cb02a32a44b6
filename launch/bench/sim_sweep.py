"""Benchmark (not a test): a preemption-rate sweep at cluster scale, timed.

Default: 64 nodes of GPT-2 (8 stages x 8 pipelines), preemption rates 0.01 .. 0.5 per
node-hour (8 rates), 1,000 seeds each, 12 simulated hours per seed, every policy, on 2
processes (the ideal bound among them, the reference of each policy's fraction of the
ideal, beside each one's dollars per sample over on-demand's). The target is under 2
minutes on 2 cores. Run::

    python -m spotline.launch.bench.sim_sweep [--seeds 1000] [--workers 2] [--hours 12]
"""

from __future__ import annotations

import argparse
import os
import time

from spotline.sim.calibration import load_calibration
from spotline.sim.results import versus_references
from spotline.sim.sim_config import POLICIES, SimConfig
from spotline.sim.sweep import sweep

RATES: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    """Run the timed sweep and print the wall time and the mean value per policy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--hours", type=float, default=12.0)
    parser.add_argument("--model", default="gpt2")
    args = parser.parse_args(argv)
    calibration = load_calibration()
    config = SimConfig(calibration, calibration.model(args.model), args.nodes)
    start = time.perf_counter()
    results = sweep(
        config,
        RATES,
        POLICIES,
        range(args.seeds),
        duration_s=args.hours * 3600.0,
        replace_after_s=0.0,
        num_workers=args.workers,
    )
    elapsed = time.perf_counter() - start
    print(
        f"sweep: {len(RATES)} rates x {args.seeds} seeds x {len(POLICIES)} policies, "
        f"{args.nodes} nodes, {args.hours:g} h each, {args.workers} processes "
        f"(cpu count {os.cpu_count()}): {elapsed:.1f} s"
    )
    for rate, by_policy in results.items():
        relative = versus_references({p: a.summary() for p, a in by_policy.items()})
        cells = "  ".join(
            f"{policy} {aggregate.get('samples_per_s'):7.1f} sps "
            f"({_ratio(relative[policy]['samples_vs_ideal'])} of ideal) "
            f"{aggregate.get('samples_per_usd'):7.0f} s/$ "
            f"({_ratio(relative[policy]['cost_per_sample_vs_on_demand'])} $/sample vs od)"
            for policy, aggregate in by_policy.items()
        )
        print(f"rate {rate:<5g} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
