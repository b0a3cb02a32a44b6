"""``spotline bench reduce``: the exact (fixed-order) sum against a float ``all_reduce``.

Both in one set of gloo processes, the rank worker :mod:`spotline.launch.bench.reduce_worker`;
``spotline bench easyscale`` runs the same measurement at its model's gradient size.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from spotline.errors import UserError
from spotline.launch.bench.jobs import (
    BenchSettings,
    RunFailed,
    format_spread,
    free_port,
    machine_info,
    rank_env,
    spread,
    stop,
    wait_ranks,
)


def bench_reduce(
    settings: BenchSettings, elements: int, ranks: int, logical_workers: int
) -> dict[str, Any]:
    """spotline.exact.reduction.exact_sum against a float all_reduce of the same gradients, side by
    side in one set of gloo processes (launch/bench/reduce_worker.py)."""
    if elements < 1 or ranks < 1 or logical_workers < ranks or logical_workers % ranks:
        raise UserError(
            f"--elements {elements} --ranks {ranks} --logical-workers {logical_workers}: "
            "use positive numbers and a multiple of --ranks logical workers"
        )
    settings.output.mkdir(parents=True, exist_ok=True)
    out = settings.output / "reduce-ranks.json"
    out.unlink(missing_ok=True)
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spotline.launch.bench.reduce_worker",
                "--elements",
                str(elements),
                "--logical-workers",
                str(logical_workers),
                "--repeats",
                str(settings.steps),
                "--out",
                str(out),
            ],
            env=rank_env(rank, ranks, port),
        )
        for rank in range(ranks)
    ]
    try:
        codes = wait_ranks(procs)
    finally:
        stop(procs)
    if any(codes) or not out.exists():
        raise RunFailed(f"a reduce rank failed (exit codes {codes})", 1)
    import json

    measured: dict[str, Any] = json.loads(out.read_text())
    measured["time_ratio"] = measured["exact_ms"] / measured["plain_ms"]
    measured["bytes_ratio"] = measured["exact_bytes"] / measured["plain_bytes"]
    measured["time_ratio_spread"] = spread(measured["time_ratios"])
    return {"bench": "reduce", **measured, "machine": machine_info()}


def format_reduce(report: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"reduce: {report['elements']:,} elements, {report['logical_workers']} logical "
            f"workers on {report['ranks']} gloo processes, median of {report['repeats']}",
            "",
            "| reduction | ms | bytes sent per rank |",
            "|---|---:|---:|",
            f"| float sum + all_reduce | {report['plain_ms']:.2f} | {report['plain_bytes']:,} |",
            f"| exact (fixed order) | {report['exact_ms']:.2f} | {report['exact_bytes']:,} |",
            "",
            f"exact / float: {report['time_ratio']:.2f}x time (repeat by repeat, median (min-max): "
            f"{format_spread(report['time_ratio_spread'], '.2f')}), {report['bytes_ratio']:.2f}x bytes",
        ]
    )
