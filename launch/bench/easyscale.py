"""``spotline bench easyscale``: what EasyScale's determinism costs, side by side in one run.

Four measurements, each against its own baseline on the same machine in the same run:

1. Step time with one logical worker per process (M = N) against DeepSpeed's stock data
   parallelism on the same N processes: the plain ``DeepSpeedEngine`` (``deepspeed.initialize``,
   a float all-reduce), ``spotline.exact.dp_engine`` (the same engine, exact reduction and the
   logical worker's dropout seeds) and the full ``spotline train`` (coordinator, one-stage
   pipeline engine, commit barrier). Interleaved rounds, medians, ratios over stock.
2. The exact reduction against a plain gloo ``all_reduce`` of the model's gradient size
   (``spotline bench reduce``'s measurement): time and bytes.
3. Rescale time: ``spotline train --rescale`` 4 -> 2 -> 3 -> 1 processes; from each SIGKILL
   to the next committed step (removals) and from the boundary to the first step of the
   grown generation (an arrival), and the run's hash against the static run.
4. Memory: k logical workers on one process against k processes (peak RSS).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from spotline.errors import UserError
from spotline.launch.bench.jobs import (
    BenchSettings,
    format_spread,
    machine_info,
    medians,
    resolve_base_config,
    round_ratios,
    run_rank_module,
    run_rounds,
    run_spotline_train,
    spread,
    write_config,
)
from spotline.launch.bench.reduce import bench_reduce

DP_VARIANTS = ("stock", "exact", "spotline")
MEMORY_KS = (1, 2, 4)


def run_dp(mode: str, config: Path, workers: int, steps: int, run_dir: Path) -> dict[str, Any]:
    """``workers`` ranks of launch/bench/dp_worker.py; rank 0's JSON result."""
    return run_rank_module(
        "spotline.launch.bench.dp_worker",
        ["--mode", mode, "--config", str(config), "--steps", str(steps)],
        workers,
        run_dir,
        f"{mode} data-parallel",
    )


def num_parameters(cfg: Any) -> int:
    from spotline.models import layers as models

    hf_config = models.load_hf_config(cfg.spotline.model.name, cfg.spotline.model.overrides)
    model = models.reference_model(hf_config, cfg.spotline.training.seed)
    return sum(p.numel() for p in model.parameters())


def bench_easyscale(settings: BenchSettings, workers: int) -> dict[str, Any]:
    if workers < 1:
        raise UserError(f"--workers {workers}: use at least 1 process")
    work = settings.output / "easyscale"
    cfg = resolve_base_config(
        settings, {"spotline.topology.workers": workers, "spotline.topology.stages": 1}
    )
    config = write_config(cfg, work / "config.json")
    info_before = machine_info()

    # 1. Step time, M = N.
    def run_one(variant: str, round_idx: int) -> dict[str, Any]:
        run_dir = work / f"{variant}-r{round_idx}"
        if variant == "spotline":
            return run_spotline_train(config, run_dir, ["--logical-workers", str(workers)])
        return run_dp(variant, config, workers, settings.steps, run_dir)

    results = run_rounds(DP_VARIANTS, settings.repeats, run_one, "easyscale")
    keys = ("step_time_s", "samples_per_s")
    step: dict[str, dict[str, Any]] = {
        v: {**medians(runs, keys), "runs": [r["step_time_s"] for r in runs]}
        for v, runs in results.items()
    }
    stock_s = step["stock"]["step_time_s"]
    ratios = {v: step[v]["step_time_s"] / stock_s for v in ("exact", "spotline")}
    spreads = {v: spread(round_ratios(results, v, "stock")) for v in ("exact", "spotline")}

    # 2. The exact reduction of this model's gradient against a float all_reduce.
    elements = num_parameters(cfg)
    reduce = bench_reduce(
        replace(settings, output=work / "reduce", steps=max(20, settings.steps)),
        elements,
        max(2, workers),
        max(2, workers),
    )

    # 3. Rescale 4 -> 2 -> 3 -> 1 in place against the static 4-process run.
    steps = max(settings.steps, 12)
    rescale_cfg = resolve_base_config(
        settings,
        {
            "spotline.topology.workers": 4,
            "spotline.topology.stages": 1,
            "spotline.training.steps": steps,
        },
    )
    rescale_config = write_config(rescale_cfg, work / "rescale-config.json")
    # --rescale counts steps from 1: M processes from the step after a quarter, a half and
    # three quarters of the run.
    plan = f"{steps // 4 + 1}:2,{steps // 2 + 1}:3,{3 * steps // 4 + 1}:1"
    static = run_spotline_train(rescale_config, work / "rescale-static", [])
    rescaled = run_spotline_train(rescale_config, work / "rescale", ["--rescale", plan])
    removals = [e["recovery_s"] for e in rescaled["recovery_events"]]
    arrivals = [e["reconfigure_s"] for e in rescaled["reconfigurations"]]

    # 4. Memory: k logical workers on one process against k processes.
    memory = []
    for k in MEMORY_KS:
        one = run_spotline_train(
            config, work / f"memory-1x{k}", ["--workers", "1", "--logical-workers", str(k)]
        )
        many = run_spotline_train(
            config, work / f"memory-{k}x1", ["--workers", str(k), "--logical-workers", str(k)]
        )
        memory.append(
            {
                "logical_workers": k,
                "one_process_mib": max(one["peak_rss_mib_per_rank"]),
                "k_processes_mib": sum(many["peak_rss_mib_per_rank"]),
                # k logical workers in turn on one process, against k processes at once
                # (on this host's cores): the price of running the topology on fewer.
                "one_process_step_s": one["step_time_s"],
                "k_processes_step_s": many["step_time_s"],
                "same_hash": one["param_sha256"] == many["param_sha256"],
            }
        )
    return {
        "bench": "easyscale",
        "model": cfg.spotline.model.name,
        "workers": workers,
        "steps": settings.steps,
        "repeats": settings.repeats,
        "statistic": "median over interleaved rounds; ratios over stock DeepSpeedEngine",
        "step_time": step,
        "ratio_over_stock": ratios,
        # Round by round (a variant over the stock run of the same round): min, median, max.
        "spread": spreads,
        "reduce": reduce,
        "rescale": {
            "plan": plan,
            "same_hash_as_static": rescaled["param_sha256"] == static["param_sha256"],
            "removal_s": removals,
            "arrival_s": arrivals,
            "max_s": max(removals + arrivals) if removals or arrivals else None,
        },
        "memory": memory,
        "machine": {"before": info_before, "after": machine_info()},
    }


def format_easyscale(report: dict[str, Any]) -> str:
    step, ratios, red, res = (
        report["step_time"],
        report["ratio_over_stock"],
        report["reduce"],
        report["rescale"],
    )
    lines = [
        f"easyscale: {report['model']}, {report['workers']} processes = logical workers, "
        f"{report['steps']} steps x {report['repeats']} rounds",
        f"  step time  stock DeepSpeedEngine {step['stock']['step_time_s'] * 1000:.1f} ms   "
        f"exact (spotline.exact.dp_engine) {step['exact']['step_time_s'] * 1000:.1f} ms "
        f"({ratios['exact']:.3f}x)   spotline train {step['spotline']['step_time_s'] * 1000:.1f} ms "
        f"({ratios['spotline']:.3f}x)",
        f"  round by round over stock, median (min-max): exact {format_spread(report['spread']['exact'])}, "
        f"spotline train {format_spread(report['spread']['spotline'])}",
        f"  reduction  {red['elements']:,} elements: exact {red['exact_ms']:.2f} ms vs all_reduce "
        f"{red['plain_ms']:.2f} ms ({red['time_ratio']:.2f}x time, {red['bytes_ratio']:.2f}x bytes)",
        f"  rescale    {res['plan']}: removals {', '.join(f'{s:.2f}' for s in res['removal_s'])} s, "
        f"arrivals {', '.join(f'{s:.2f}' for s in res['arrival_s'])} s, same hash as static: "
        f"{res['same_hash_as_static']}",
    ]
    for row in report["memory"]:
        lines.append(
            f"  memory     {row['logical_workers']} logical workers: one process "
            f"{row['one_process_mib']:.0f} MiB, {row['logical_workers']} processes "
            f"{row['k_processes_mib']:.0f} MiB; step {row['one_process_step_s'] * 1000:.0f} ms vs "
            f"{row['k_processes_step_s'] * 1000:.0f} ms (same hash: {row['same_hash']})"
        )
    return "\n".join(lines)
