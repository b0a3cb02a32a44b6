"""What ``spotline simulate`` prints and writes: the assumptions, the results table with
its ratios, the CSV rows and the command recorded in ``results.json``."""

from __future__ import annotations

import argparse
import csv
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from spotline.atomic_files import write_bytes_atomic
from spotline.sim.calibration import Calibration, ModelCalibration
from spotline.sim.results import versus_references
from spotline.sim.sim_config import PolicyName, SimConfig

SUMMARY_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (key, header, format)
    ("samples_per_s", "samples/s", "{:.1f}"),
    ("samples_vs_ideal", "of ideal", "{:.2f}"),
    ("cost_per_hour", "$/h", "{:.2f}"),
    ("samples_per_usd", "samples/$", "{:.0f}"),
    ("cost_per_sample_vs_on_demand", "$/sample vs od", "{:.2f}"),
    ("restart_s", "restart s", "{:.0f}"),
    ("reconfigure_s", "reconf s", "{:.0f}"),
    ("redone_samples", "redone samples", "{:.0f}"),
    ("degraded_s", "degraded s", "{:.0f}"),
    ("uncalibrated_s", "uncal. s", "{:.0f}"),
    ("num_fatal_failures", "fatal", "{:g}"),
    ("exposure_checkpoints", "exp. ckpts", "{:g}"),
)


def simulation_assumptions(
    calibration: Calibration, config: SimConfig, extra: dict[str, Any]
) -> dict[str, Any]:
    model = config.model
    topology = config.topology
    low, high = model.pipeline_range
    out: dict[str, Any] = {
        "calibration": calibration.name or "(a file)",
        "calibration_file": calibration.source,
        "model": model.name,
        "logical_topology": f"{topology.num_stages} stages x {topology.num_logical_workers} pipelines",
        "samples_per_step (fixed global batch)": model.samples_per_step,
        "measured pipeline counts": list(model.measured_pipelines),
        "step_time_s by active pipelines": {
            str(p): round(model.step_time_bound_s(p, False)[0], 4)
            for p in range(1, topology.num_logical_workers + 1)
        },
        "step times outside the measured rows": (
            f"bounds, not measurements: above {high} pipelines the {high}-pipeline time, "
            f"below {low} that time x {low}/P; time trained on them is uncalibrated_s"
        ),
        "degraded_slowdown": calibration.degraded_slowdown,
        "spot_price_per_node_hour": calibration.spot_price_per_node_hour,
        "on_demand_price_per_node_hour": calibration.on_demand_price_per_node_hour,
        "on_demand_nodes": topology.num_slots,
        "node_ready_s": calibration.node_ready_s,
        "fatal_rendezvous_s (also every start)": calibration.fatal_rendezvous_s,
        "reconfigure_s (Spotline failover or rebalance)": calibration.reconfigure_s,
        "checkpoint_save_s": model.checkpoint_save_s,
        "checkpoint_load_s": model.checkpoint_load_s,
        "spotline_checkpoint_interval_s (until the first fatal loss)": (
            config.spotline_checkpoint_interval_s or calibration.spotline_checkpoint_interval_s
        ),
        "spotline exposure checkpoints (exp. ckpts)": (
            "a layout with a stage on at most 2 workers (machines with --slots > 1) "
            "checkpoints at its first committed step where the layout before it was not so "
            "exposed, and while exposed every sqrt(2 * checkpoint_save_s * MTBF), MTBF = "
            "time so far / bursts so far (batches of preemptions taking members on 2 "
            "machines or more; before the first, the interval above; spotline.plan.exposure)"
        ),
        "preemption_notice_s (not exploited by any policy)": dict(calibration.preemption_notice_s),
        "ideal (the bound of the 'of ideal' column)": (
            "every ready worker from the moment it is ready, in the layout with the shortest "
            f"step of at most {topology.num_logical_workers} pipelines and {config.stages_per_worker} "
            "stages a worker (the memory limit); no rendezvous, reconfiguration, "
            "checkpoint or lost work"
        ),
        "stages_per_worker (memory, own stage + replicas; checkpoint-restart keeps none)": (
            config.stages_per_worker
        ),
    }
    if config.sharded_replicas:  # full replicas: the assumptions read as before --replica
        out["replicas"] = (
            "sharded: each replica holder of a stage keeps one shard of it (one per pipeline); "
            "a stage whose owners are all lost is taken over only while every one of its "
            "shard holders lives (spotline.plan.shards)"
        )
    slots = config.slots_per_machine
    if slots > 1:  # one slot per node: the assumptions read as before --slots existed
        out["slots_per_node"] = (
            f"{slots}: each node is a machine of {slots} workers, preempted all at once, "
            f"paid {slots} x the per-node price; no machine holds every copy of a stage "
            "where the layout allows (spotline.plan.placement)"
        )
        out["workers"] = config.num_workers
        out["on_demand_nodes"] = math.ceil(topology.num_slots / slots)
        out["on_demand_workers"] = topology.num_slots
    out.update(extra)
    return out


def uncalibrated_note(
    rows: Iterable[tuple[Any, Mapping[str, Any]]], model: ModelCalibration
) -> str:
    """The line printed under a results table when any row trained at a pipeline count
    outside the calibration's measured rows ("" when none did)."""
    flagged = [
        f"{label} {summary['uncalibrated_s'] / summary['running_s']:.0%}"
        for label, summary in rows
        if summary["uncalibrated_s"] > 0 and summary["running_s"] > 0
    ]
    if not flagged:
        return ""
    low, high = model.pipeline_range
    return (
        f"note: uncal. s is training at pipeline counts outside the calibration's rows "
        f"({low}-{high} pipelines of {model.num_stages} stages), timed by a bound that "
        f"understates throughput; share of training time: {', '.join(flagged)}. "
        "Measure those pipeline counts to remove it."
    )


def print_assumptions(assumptions: dict[str, Any]) -> None:
    print("Assumptions:")
    for key, value in assumptions.items():
        print(f"  {key}: {value}")
    print()


def format_table(rows: Sequence[tuple[str, dict[str, Any]]], first: str) -> str:
    headers = [first] + [header for _, header, _ in SUMMARY_COLUMNS]
    body = [
        [label]
        + [
            "-" if summary[key] is None else fmt.format(summary[key])  # None: no number
            for key, _, fmt in SUMMARY_COLUMNS
        ]
        for label, summary in rows
    ]
    widths = [max(len(row[i]) for row in [headers, *body]) for i in range(len(headers))]
    lines: list[str] = []
    for row in [headers, *body]:
        lines.append(
            "  ".join(
                cell.ljust(width) if i == 0 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def with_references(
    summaries: Mapping[PolicyName, dict[str, float | int | str]],
) -> dict[PolicyName, dict[str, Any]]:
    """Each summary with its ratios to the references (:func:`versus_references`)."""
    relative = versus_references(summaries)
    return {policy: {**summary, **relative[policy]} for policy, summary in summaries.items()}


def headline_ratios(summaries: Mapping[PolicyName, Mapping[str, Any]]) -> dict[str, float]:
    ratios: dict[str, float] = {}
    spot = summaries.get("spotline")
    restart = summaries.get("checkpoint-restart")
    on_demand = summaries.get("on-demand")
    if spot and restart and restart["samples_per_s"] > 0:
        ratios["throughput spotline / checkpoint-restart"] = (
            spot["samples_per_s"] / restart["samples_per_s"]
        )
    if spot and restart and restart["samples_per_usd"] > 0:
        ratios["value spotline / checkpoint-restart"] = (
            spot["samples_per_usd"] / restart["samples_per_usd"]
        )
    if spot and on_demand and on_demand["samples_per_usd"] > 0:
        ratios["value spotline / on-demand"] = (
            spot["samples_per_usd"] / on_demand["samples_per_usd"]
        )
    return ratios


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` written whole or not at all (``spotline.atomic_files``)."""
    write_bytes_atomic(path, text.encode())


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    keys: list[str] = []
    for row in rows:
        keys.extend(key for key in row if key not in keys)
    writer = csv.DictWriter(buffer, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def args_text(args: argparse.Namespace) -> list[str]:
    """The parsed arguments as ``--flag value`` words (for the record in results.json)."""
    words: list[str] = []
    for key, value in sorted(vars(args).items()):
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        words.extend([flag] if value is True else [flag, str(value)])
    return words
