"""``spotline bench recovery``: in-memory failover against checkpoint-restart on one trace."""

from __future__ import annotations

from typing import Any

from spotline.launch.bench.jobs import (
    BenchSettings,
    interleaved,
    machine_info,
    median,
    progress,
    resolve_base_config,
    run_spotline_train,
    write_config,
)


def bench_recovery(
    settings: BenchSettings, trace: str, time_scale: float, max_workers: int = 3
) -> dict[str, Any]:
    """In-memory failover against checkpoint-restart on the same trace, same machine.

    One pipeline of 2 stages on 2 workers with up to 3 live (a spare), the trace replayed
    at ``time_scale``; the variants alternate. Recovery time: from a preemption to the next
    committed step. Goodput: committed samples per second of training, recoveries included.
    """
    base = resolve_base_config(
        settings,
        {
            "spotline.topology.workers": 2,
            "spotline.topology.stages": 2,
            "spotline.redundancy.mode": "lazy",
            "spotline.determinism.enabled": True,
        },
    )
    settings.output.mkdir(parents=True, exist_ok=True)
    config = write_config(base, settings.output / "recovery" / "config.json")
    variants = {
        "failover": ["--recovery", "failover"],
        "checkpoint-restart": ["--recovery", "checkpoint-restart"],
    }
    flags = [
        "--trace",
        trace,
        "--time-scale",
        str(time_scale),
        "--max-workers",
        str(max_workers),
        "--checkpoint-interval",
        "10",
    ]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for round_idx, name in interleaved(list(variants), settings.repeats):
        progress(f"recovery round {round_idx + 1}: {name}")
        run_dir = settings.output / "recovery" / f"{name}-{round_idx}"
        runs[name].append(run_spotline_train(config, run_dir, [*variants[name], *flags]))
    rows: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        times = [e["recovery_s"] for r in results for e in r["recovery_events"]]
        rows[name] = {
            "preemptions": median([r["preemptions"] for r in results]),
            "recoveries": median([len(r["recovery_events"]) for r in results]),
            "median_recovery_s": median(times) if times else None,
            "max_recovery_s": max(times) if times else None,
            "goodput_samples_per_s": median([r["goodput_samples_per_s"] for r in results]),
            "train_wall_s": median([r["train_wall_s"] for r in results]),
            "param_sha256": sorted({r["param_sha256"] for r in results}),
        }
    f, c = rows["failover"], rows["checkpoint-restart"]
    ratios = {
        "recovery_speedup": (c["median_recovery_s"] / f["median_recovery_s"])
        if f["median_recovery_s"] and c["median_recovery_s"]
        else None,
        "goodput_ratio": f["goodput_samples_per_s"] / c["goodput_samples_per_s"],
    }
    return {
        "bench": "recovery",
        "trace": trace,
        "time_scale": time_scale,
        "max_workers": max_workers,
        "steps": settings.steps,
        "repeats": settings.repeats,
        "rows": rows,
        "ratios": ratios,
        "machine": machine_info(),
    }


def format_recovery(report: dict[str, Any]) -> str:
    lines = [
        f"recovery: {report['trace']} at {report['time_scale']}x, {report['steps']} steps, "
        f"{report['repeats']} round(s)",
        "",
        "| policy | preemptions | recoveries | median recovery (s) | max recovery (s) | goodput (samples/s) | training wall (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in report["rows"].items():
        med = f"{row['median_recovery_s']:.2f}" if row["median_recovery_s"] is not None else "n/a"
        mx = f"{row['max_recovery_s']:.2f}" if row["max_recovery_s"] is not None else "n/a"
        lines.append(
            f"| {name} | {row['preemptions']:.0f} | {row['recoveries']:.0f} | {med} | {mx} | "
            f"{row['goodput_samples_per_s']:.1f} | {row['train_wall_s']:.1f} |"
        )
    r = report["ratios"]
    speed = f"{r['recovery_speedup']:.1f}x" if r["recovery_speedup"] else "n/a"
    lines += [
        "",
        f"failover recovers {speed} faster; goodput ratio failover/checkpoint-restart {r['goodput_ratio']:.2f}x",
    ]
    hashes = {h for row in report["rows"].values() for h in row["param_sha256"]}
    lines.append(f"final parameter hashes agree across policies: {len(hashes) == 1}")
    return "\n".join(lines)
