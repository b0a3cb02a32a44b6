"""``spotline bench overlap``: can the replica exchange hide behind compute on this host?

Lazy redundancy's exchange (each stage's reduced gradient to its replica holder) must finish
before the step's commit; a cut that moved it behind other work would pay off only where
the transfer uses hardware the compute leaves idle. This measures that directly, in one set
of processes (the rank worker :mod:`spotline.launch.bench.overlap_worker`): the exchange
alone, the replica's AdamW step alone, both at once on every rank, and both at once beside
a peer that only exchanges (a bubble's idle core), round by round, and reports the fraction
of the exchange that hid in each case.
"""

from __future__ import annotations

from typing import Any

from spotline.errors import UserError
from spotline.launch.bench.jobs import (
    BenchSettings,
    format_spread,
    machine_info,
    run_rank_module,
    spread,
)

# One stage of gpt2-big on two stages (its 14,345,472 parameters halved): the exchange's size
# in the redundancy benchmark's 2 x 4 case.
DEFAULT_OVERLAP_ELEMENTS = 7_172_736


def bench_overlap(
    settings: BenchSettings, elements: int, ranks: int, device: str
) -> dict[str, Any]:
    """The exchange, the replica's step and both at once, side by side (see the module)."""
    if elements < 1 or ranks < 2:
        raise UserError(
            f"--elements {elements} --ranks {ranks}: use a positive number of elements and "
            "at least 2 ranks (the exchange is a ring)"
        )
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < ranks:
            raise UserError(
                f"--device cuda --ranks {ranks}: this machine has "
                f"{torch.cuda.device_count()} CUDA devices; use --device cpu here, or a "
                f"machine with at least {ranks} GPUs"
            )
    measured = run_rank_module(
        "spotline.launch.bench.overlap_worker",
        ["--elements", str(elements), "--repeats", str(settings.steps), "--device", device],
        ranks,
        settings.output / "overlap",
        "overlap",
    )
    measured["hidden_spread"] = spread(measured["hidden_fractions"])
    measured["hidden_beside_idle_spread"] = spread(measured["hidden_fractions_beside_idle"])
    return {"bench": "overlap", **measured, "machine": machine_info()}


def format_overlap(report: dict[str, Any]) -> str:
    hidden, beside_idle = report["hidden_spread"], report["hidden_beside_idle_spread"]
    return "\n".join(
        [
            f"overlap: the replica exchange of {report['elements']:,} float32 elements "
            f"({report['bytes_sent_per_rank']:,} bytes each way per rank) on a ring of "
            f"{report['ranks']} {report['backend']} processes ({report['device']}), "
            f"median of {report['repeats']}",
            "",
            "| variant | ms |",
            "|---|---:|",
            f"| exchange alone | {report['exchange_ms']:.2f} |",
            f"| replica AdamW step alone | {report['step_ms']:.2f} |",
            f"| both at once, every rank | {report['both_ms']:.2f} |",
            f"| both at once, beside a peer that only exchanges | {report['beside_idle_ms']:.2f} |",
            "",
            "hidden fraction of the exchange, (exchange + step - both) / exchange, round by "
            f"round, median (min-max): every rank computing {format_spread(hidden, '.2f')}; "
            f"beside an idle peer {format_spread(beside_idle, '.2f')}",
        ]
    )
