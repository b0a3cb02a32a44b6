"""``spotline simulate``: replay preemptions at cluster scale and compare policies.

Examples::

    spotline simulate --trace p3-trace.csv --nodes 64 --model gpt2 --output runs/sim-p3
    spotline simulate --trace p3-trace.csv --nodes 16 --slots 4 --output runs/sim-p3-x4
    spotline simulate --preempt-rate 0.1 --seeds 100 --nodes 64 --model gpt2 --output runs/r
    spotline simulate --sweep 0.01,0.05,0.1,0.2,0.5 --seeds 1000 --nodes 64 --output runs/s

Writes ``results.json`` (atomically, last, one entry per policy), ``results.csv`` and PNG
plots into ``--output``, prints a table and every assumption used. The ``ideal`` bound and
the ``on-demand`` baseline are always simulated (added when ``--policies`` leaves them
out): every row gives its samples as a fraction of the ideal's (``samples_vs_ideal``) and
its dollars per sample over on-demand's (``cost_per_sample_vs_on_demand``). Bad input
prints one line ``spotline: error: ...`` on stderr and returns 2 before anything is
written.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from spotline.errors import UserError
from spotline.plan.capacity import DEFAULT_STAGES_PER_WORKER
from spotline.plan.shards import REPLICA_KINDS
from spotline.plan.traces import (
    TRACE_FORMATS,
    Trace,
    live_nodes_over_time,
    load_trace,
    resize_trace,
    scale_trace,
    synthetic_trace,
)
from spotline.sim.calibration import (
    DEFAULT_CALIBRATION,
    NAMED_CALIBRATIONS,
    Calibration,
    ModelCalibration,
    load_calibration,
)
from spotline.sim.engine import (
    POLICIES,
    REFERENCES,
    PolicyName,
    PolicyResult,
    SimConfig,
    simulate_policies,
    trace_mtbf_s,
    versus_references,
    young_daly_interval_s,
)
from spotline.sim.sweep import Aggregate, sweep

if TYPE_CHECKING:  # matplotlib is imported only when a plot is drawn (it costs a second)
    from matplotlib.figure import Figure

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


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as a UserError (one line, exit 2)."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see `spotline simulate --help`)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``spotline simulate``."""
    parser = _Parser(
        prog="spotline simulate",
        description="Simulate training on spot instances under several policies.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="a preemption trace (events, aws or gcp)")
    source.add_argument(
        "--preempt-rate", type=float, help="synthetic Poisson preemptions per node-hour"
    )
    source.add_argument(
        "--sweep", help="comma-separated preemption rates per node-hour, e.g. 0.01,0.05,0.1"
    )
    parser.add_argument(
        "--nodes", type=int, required=True, help="nodes (machines) the job asks for"
    )
    parser.add_argument(
        "--slots",
        type=_slot_count,
        metavar="K",
        help="workers per node, e.g. 4 or 8 GPUs: a preemption takes all K at once, and no "
        "node holds a stage and its only replica where the layout allows (default 1)",
    )
    parser.add_argument(
        "--stages-per-worker",
        type=_stages_per_worker,
        metavar="C",
        help="room for C logical stages on a worker (default 2: a stage and its replica, as "
        "Bamboo): no policy runs more than C stages on a worker, so fewer than "
        "ceil(stages / C) workers wait",
    )
    parser.add_argument(
        "--replica",
        choices=REPLICA_KINDS,
        help="the Spotline policies' replicas, as spotline.redundancy.replica: full (default) "
        "or sharded (each of a stage's replica holders keeps one shard: a stage whose owners "
        "are all lost survives only while every one of its shard holders lives)",
    )
    parser.add_argument("--model", default="gpt2", help="a model of the calibration table")
    parser.add_argument("--output", type=Path, required=True, help="directory for the results")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, from {', '.join(POLICIES)} (default: all; "
        f"{' and '.join(REFERENCES)} are always added: every row is compared with them)",
    )
    parser.add_argument(
        "--calibration",
        metavar="NAME|FILE",
        help=f"a shipped calibration ({', '.join(NAMED_CALIBRATIONS)}) or a calibration JSON "
        f"such as spotline calibrate writes (default: {DEFAULT_CALIBRATION})",
    )
    parser.add_argument("--seeds", type=int, default=None, help="seeds per rate (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument(
        "--hours", type=float, default=12.0, help="simulated hours of a synthetic trace"
    )
    parser.add_argument(
        "--replace-after",
        type=float,
        default=0.0,
        help="seconds from a synthetic preemption to its replacement's launch (default 0)",
    )
    parser.add_argument("--trace-format", choices=TRACE_FORMATS, help="force the trace format")
    parser.add_argument(
        "--trace-scale",
        choices=("fit", "cap", "none"),
        default="fit",
        help="fit: rescale the trace's peak to --nodes (default); cap: only scale down; "
        "none: replay as is",
    )
    parser.add_argument(
        "--checkpoint-interval",
        type=float,
        help="checkpoint-restart's interval in seconds (default: Young/Daly)",
    )
    parser.add_argument(
        "--spotline-checkpoint-interval",
        type=float,
        help="Spotline's first checkpoint interval in seconds (default: from the calibration)",
    )
    parser.add_argument("--workers", type=int, default=1, help="processes for seeds and sweeps")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def _whole_at_least(minimum: int, meaning: str) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``minimum`` (argparse words the error as one
    line, ``argument --FLAG K: ...``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be a whole number >= {minimum} ({meaning}), got {text!r}"
            )
        return value

    return parse


_slot_count = _whole_at_least(1, "workers per node")
_stages_per_worker = _whole_at_least(2, "a worker's own stage and its replica")


def _parse_policies(text: str) -> tuple[PolicyName, ...]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    chosen: list[PolicyName] = []
    for name in names:
        matches = [policy for policy in POLICIES if policy == name]
        if not matches:
            raise UserError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}")
        if matches[0] not in chosen:
            chosen.append(matches[0])
    if not chosen:
        raise UserError(f"--policies is empty; use one of {', '.join(POLICIES)}")
    # The references of the ratio columns (cheap: no planner, no preemptions), in the
    # order of the default list.
    chosen.extend(policy for policy in POLICIES if policy in REFERENCES and policy not in chosen)
    return tuple(chosen)


def _parse_rates(text: str) -> tuple[float, ...]:
    rates: list[float] = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise UserError(f"--sweep: {part.strip()!r} is not a number; e.g. 0.01,0.05") from None
        if not math.isfinite(rate) or rate < 0:
            raise UserError(f"--sweep: rates must be finite and >= 0, got {part.strip()}")
        rates.append(rate)
    return tuple(rates)


def _assumptions(
    calibration: Calibration, config: SimConfig, extra: dict[str, Any]
) -> dict[str, Any]:
    model = config.model
    topology = config.topology
    low, high = model.pipeline_range
    out: dict[str, Any] = {
        "calibration": calibration.name or "(a file)",
        "calibration_file": calibration.source,
        "model": model.name,
        "logical_topology": f"{topology.num_stages} stages x {topology.num_pipelines} pipelines",
        "samples_per_step (fixed global batch)": model.samples_per_step,
        "measured pipeline counts": list(model.measured_pipelines),
        "step_time_s by active pipelines": {
            str(p): round(model.step_time_bound_s(p, False)[0], 4)
            for p in range(1, topology.num_pipelines + 1)
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
            f"step of at most {topology.num_pipelines} pipelines and {config.stages_per_worker} "
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


def _print_assumptions(assumptions: dict[str, Any]) -> None:
    print("Assumptions:")
    for key, value in assumptions.items():
        print(f"  {key}: {value}")
    print()


def _format_table(rows: Sequence[tuple[str, dict[str, Any]]], first: str) -> str:
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


def _with_references(
    summaries: Mapping[PolicyName, dict[str, float | int | str]],
) -> dict[PolicyName, dict[str, Any]]:
    """Each summary with its ratios to the references (:func:`versus_references`)."""
    relative = versus_references(summaries)
    return {policy: {**summary, **relative[policy]} for policy, summary in summaries.items()}


def _ratios(summaries: Mapping[PolicyName, Mapping[str, Any]]) -> dict[str, float]:
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


def _write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file in the same directory and rename: never half a file."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp creates 0600; give a normal file mode
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _csv_text(rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    keys: list[str] = []
    for row in rows:
        keys.extend(key for key in row if key not in keys)
    writer = csv.DictWriter(buffer, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def trace_run_figure(trace: Trace, results: Mapping[PolicyName, PolicyResult]) -> Figure:
    """The trace run's figure (what ``timeline.png`` shows): live spot nodes over the trace,
    and per policy with a recorded timeline its windowed throughput and committed samples.
    Drawn on matplotlib's Agg canvas, no pyplot state; returned so that tests can read its
    series."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    hours = 1.0 / 3600.0
    figure = Figure(figsize=(10, 9))
    FigureCanvasAgg(figure)
    top, middle, bottom = figure.subplots(3, 1, sharex=True)
    points = live_nodes_over_time(trace)
    xs = [t * hours for t, _ in points] + [trace.duration_s * hours]
    ys = [count for _, count in points] + [points[-1][1]]
    top.step(xs, ys, where="post", color="black")
    top.set_ylabel("live spot nodes")
    top.set_title(f"trace: {trace.source}")
    num_bins = 48
    window_s = trace.duration_s / num_bins if trace.duration_s > 0 else 1.0
    grid = [window_s * i for i in range(num_bins + 1)]
    for policy, result in results.items():
        if not result.timeline:
            continue
        done = [_committed_at(result, t) for t in grid]
        rates = [(done[i + 1] - done[i]) / window_s for i in range(num_bins)]
        middle.step([t * hours for t in grid], rates + [rates[-1]], where="post", label=policy)
        bottom.plot([t * hours for t in grid], done, label=policy)
    middle.set_ylabel(f"samples/s ({window_s / 60:.0f}-min windows)")
    middle.legend(loc="lower right", fontsize="small")
    bottom.set_ylabel("committed samples")
    bottom.set_xlabel("hours")
    bottom.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    return figure


def _plot_trace_run(
    output: Path, trace: Trace, results: dict[PolicyName, PolicyResult]
) -> list[Path]:
    path = output / "timeline.png"
    trace_run_figure(trace, results).savefig(path, dpi=100)
    return [path]


def _committed_at(result: PolicyResult, t_s: float) -> float:
    """Committed samples at ``t_s`` from a recorded timeline: the last recorded state plus
    its rate since then (steps commit one at a time, so this is exact to one step)."""
    current = result.timeline[0]
    for point in result.timeline:
        if point.t_s > t_s:
            break
        current = point
    return current.committed_samples + current.samples_per_s * max(0.0, t_s - current.t_s)


# (metric, y-axis label, file name) of each sweep plot
SWEEP_PLOTS: tuple[tuple[str, str, str], ...] = (
    ("samples_per_usd", "samples per $", "value_vs_rate.png"),
    ("samples_per_s", "samples/s", "throughput_vs_rate.png"),
)


def sweep_figures(results: Mapping[float, Mapping[PolicyName, Aggregate]]) -> dict[str, Figure]:
    """One figure per :data:`SWEEP_PLOTS` entry, by file name: the metric against the
    preemption rate, one line per policy (Agg canvas, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rates = sorted(results)
    policies = list(next(iter(results.values())))
    figures: dict[str, Figure] = {}
    for metric, label, name in SWEEP_PLOTS:
        figure = Figure(figsize=(8, 5))
        FigureCanvasAgg(figure)
        axes = figure.subplots()
        for policy in policies:
            axes.plot(
                rates, [results[r][policy].get(metric) for r in rates], marker="o", label=policy
            )
        axes.set_xlabel("preemptions per node-hour")
        axes.set_ylabel(label)
        axes.legend()
        axes.grid(True, alpha=0.3)
        figure.tight_layout()
        figures[name] = figure
    return figures


def _plot_sweep(output: Path, results: dict[float, dict[PolicyName, Aggregate]]) -> list[Path]:
    written: list[Path] = []
    for name, figure in sweep_figures(results).items():
        path = output / name
        figure.savefig(path, dpi=100)
        written.append(path)
    return written


def _prepare_output(output: Path) -> None:
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} exists and is not a directory; give a directory")
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create --output {output}: {error}") from None
    if not os.access(output, os.W_OK):
        raise UserError(f"--output {output} is not writable")


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.nodes < 1:
        raise UserError(f"--nodes must be >= 1, got {args.nodes}")
    # Default None, not 1, as --seeds: results.json records only the flags given, so a run
    # without --slots records the same command as before the flag existed.
    slots = 1 if args.slots is None else args.slots
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    if not args.hours > 0 or not math.isfinite(args.hours):
        raise UserError(f"--hours must be > 0, got {args.hours}")
    if args.replace_after < 0:
        raise UserError(f"--replace-after must be >= 0, got {args.replace_after}")
    for flag, value in (
        ("--checkpoint-interval", args.checkpoint_interval),
        ("--spotline-checkpoint-interval", args.spotline_checkpoint_interval),
    ):
        if value is not None and not value > 0:
            raise UserError(f"{flag} must be > 0 seconds, got {value}")
    policies = _parse_policies(args.policies)
    calibration = load_calibration(args.calibration)
    model = calibration.model(args.model)
    if args.nodes * slots < model.num_stages:
        fewest = math.ceil(model.num_stages / slots)
        nodes = f"{args.nodes}" if slots == 1 else f"{args.nodes} x --slots {slots}"
        raise UserError(
            f"--nodes {nodes} cannot hold one pipeline of {model.name} "
            f"({model.num_stages} stages); give at least {fewest}"
        )
    config = SimConfig(
        calibration,
        model,
        args.nodes,
        checkpoint_interval_s=args.checkpoint_interval,
        spotline_checkpoint_interval_s=args.spotline_checkpoint_interval,
        slots_per_machine=slots,
        # Default None, not 2, as --slots: the command recorded reads as before the flag.
        stages_per_worker=(
            DEFAULT_STAGES_PER_WORKER if args.stages_per_worker is None else args.stages_per_worker
        ),
        sharded_replicas=args.replica == "sharded",
    )
    if args.trace is not None:
        if args.seeds is not None:
            raise UserError("--seeds applies to --preempt-rate and --sweep, not to --trace")
        trace = load_trace(args.trace, format=args.trace_format)
        if trace.peak_nodes == 0:
            raise UserError(f"trace {args.trace} never has a live node; nothing to simulate")
        _prepare_output(args.output)
        return _run_trace(args, calibration, config, policies, trace)
    if args.preempt_rate is not None:
        if not math.isfinite(args.preempt_rate) or args.preempt_rate < 0:
            raise UserError(f"--preempt-rate must be finite and >= 0, got {args.preempt_rate}")
        rates: tuple[float, ...] = (args.preempt_rate,)
    else:
        rates = _parse_rates(args.sweep)
    num_seeds = 10 if args.seeds is None else args.seeds
    if num_seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {num_seeds}")
    _prepare_output(args.output)
    return _run_synthetic(args, calibration, config, policies, rates, num_seeds)


def _run_trace(
    args: argparse.Namespace,
    calibration: Calibration,
    config: SimConfig,
    policies: tuple[PolicyName, ...],
    original: Trace,
) -> int:
    if args.trace_scale == "fit":
        trace = resize_trace(original, args.nodes)
    elif args.trace_scale == "cap":
        trace = scale_trace(original, args.nodes)
    else:
        trace = original
    assumptions = _assumptions(
        calibration,
        config,
        {
            "trace": str(args.trace),
            "trace_peak_nodes": original.peak_nodes,
            "trace_scaling": (
                f"{args.trace_scale}: peak {original.peak_nodes} -> {trace.peak_nodes} nodes "
                "(counts scaled proportionally, every drop still preempts; see resize_trace)"
            ),
            "trace_duration_h": round(trace.duration_s / 3600.0, 3),
            "trace_preemptions": trace.num_removals,
            "checkpoint_restart_interval_s": round(
                config.checkpoint_interval_s
                or young_daly_interval_s(config.model.checkpoint_save_s, trace_mtbf_s(trace)),
                1,
            ),
            "checkpoint_restart_interval_rule": (
                "given"
                if config.checkpoint_interval_s
                else "Young/Daly sqrt(2 C MTBF), "
                f"MTBF = trace duration / preemption instants = {trace_mtbf_s(trace):.0f} s"
            ),
        },
    )
    _print_assumptions(assumptions)
    recording = dataclasses.replace(config, record_timeline=True)
    results: dict[PolicyName, PolicyResult] = {}
    progress = _Progress(len(policies), "policies", args.no_progress)
    for policy in policies:
        results.update(simulate_policies(trace, (policy,), recording))
        progress(1)
    progress.close()
    summaries = _with_references({policy: result.summary() for policy, result in results.items()})
    print(_format_table(list(summaries.items()), "policy"))
    note = uncalibrated_note(summaries.items(), config.model)
    if note:
        print(note)
    ratios = _ratios(summaries)
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    plots = _plot_trace_run(args.output, trace, results)
    _write_atomic(args.output / "results.csv", _csv_text(list(summaries.values())))
    document = {
        "command": "spotline simulate " + " ".join(_args_text(args)),
        "assumptions": assumptions,
        "results": summaries,
        "ratios": ratios,
        "uncalibrated_note": note,
        "plots": [str(path.name) for path in plots],
    }
    _write_atomic(args.output / "results.json", json.dumps(document, indent=2, default=str) + "\n")
    print(f"\nwrote {args.output / 'results.json'}, results.csv and {len(plots)} plot(s)")
    return 0


def _args_text(args: argparse.Namespace) -> list[str]:
    """The parsed arguments as ``--flag value`` words (for the record in results.json)."""
    words: list[str] = []
    for key, value in sorted(vars(args).items()):
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        words.extend([flag] if value is True else [flag, str(value)])
    return words


def _run_synthetic(
    args: argparse.Namespace,
    calibration: Calibration,
    config: SimConfig,
    policies: tuple[PolicyName, ...],
    rates: tuple[float, ...],
    num_seeds: int,
) -> int:
    duration_s = args.hours * 3600.0
    seeds = range(args.seed, args.seed + num_seeds)
    assumptions = _assumptions(
        calibration,
        config,
        {
            "synthetic_trace": (
                f"{args.nodes} nodes at t=0, Poisson preemptions per node, a replacement "
                f"launched {args.replace_after:g} s after each preemption"
            ),
            "rates_per_node_hour": list(rates),
            "seeds": f"{args.seed}..{args.seed + num_seeds - 1}",
            "simulated_hours": args.hours,
            "checkpoint_restart_interval_rule": (
                f"given: {config.checkpoint_interval_s} s"
                if config.checkpoint_interval_s
                else "Young/Daly sqrt(2 C MTBF) with the MTBF of each replayed trace"
            ),
        },
    )
    _print_assumptions(assumptions)
    stochastic = sum(1 for policy in policies if policy != "on-demand")
    progress = _Progress(len(rates) * num_seeds if stochastic else 0, "seeds", args.no_progress)
    results = sweep(
        config,
        rates,
        policies,
        seeds,
        duration_s=duration_s,
        replace_after_s=args.replace_after,
        num_workers=args.workers,
        progress=progress,
    )
    progress.close()
    rows: list[dict[str, Any]] = []
    table: list[tuple[str, dict[str, Any]]] = []
    per_policy: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    all_ratios: dict[str, dict[str, float]] = {}
    for rate, by_policy in results.items():
        summaries = _with_references(
            {policy: aggregate.summary() for policy, aggregate in by_policy.items()}
        )
        for policy, summary in summaries.items():
            rows.append(summary)
            per_policy[policy].append(summary)
            table.append((f"{rate:g} {policy}", summary))
        all_ratios[f"{rate:g}"] = _ratios(summaries)
    print(_format_table(table, "rate policy"))
    note = uncalibrated_note(table, config.model)
    if note:
        print(note)
    for rate_text, ratios in all_ratios.items():
        for name, value in ratios.items():
            print(f"rate {rate_text}: {name}: {value:.2f}x")
    plots: list[Path] = []
    if len(rates) > 1:
        plots.extend(_plot_sweep(args.output, results))
    # One recorded seed (the first) shows the trace, live nodes and throughput over time.
    example = synthetic_trace(args.nodes, rates[-1], duration_s, args.seed, args.replace_after)
    recording = dataclasses.replace(config, record_timeline=True)
    plots.extend(
        _plot_trace_run(args.output, example, simulate_policies(example, policies, recording))
    )
    _write_atomic(args.output / "results.csv", _csv_text(rows))
    document = {
        "command": "spotline simulate " + " ".join(_args_text(args)),
        "assumptions": assumptions,
        "results": per_policy,
        "ratios": all_ratios,
        "uncalibrated_note": note,
        "plots": [path.name for path in plots],
    }
    _write_atomic(args.output / "results.json", json.dumps(document, indent=2, default=str) + "\n")
    print(f"\nwrote {args.output / 'results.json'}, results.csv and {len(plots)} plot(s)")
    return 0


class _Progress:
    """A tqdm bar (on stderr) behind a plain callable, or nothing when hidden."""

    def __init__(self, total: int, unit: str, hidden: bool) -> None:
        self.bar: Any = None
        if total > 0 and not hidden:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=unit, file=sys.stderr, leave=False)

    def __call__(self, count: int) -> None:
        if self.bar is not None:
            self.bar.update(count)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``spotline simulate`` (the ``spotline`` CLI dispatches here).

    Returns 0 on success and 2 on bad input, after printing ``spotline: error: ...``.
    """
    try:
        return _run(list(sys.argv[1:] if argv is None else argv))
    except UserError as error:
        print(f"spotline: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
