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
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotline.errors import UserError
from spotline.launch.flags import UsageErrorParser
from spotline.launch.simulate_plots import plot_sweep, plot_trace_run
from spotline.launch.simulate_report import (
    args_text,
    csv_text,
    format_table,
    headline_ratios,
    print_assumptions,
    simulation_assumptions,
    uncalibrated_note,
    with_references,
    write_text_atomic,
)
from spotline.plan.capacity import DEFAULT_STAGES_PER_WORKER
from spotline.plan.checkpoint_interval import modelled_interval_s
from spotline.plan.shards import REPLICA_KINDS
from spotline.plan.traces import (
    TRACE_FORMATS,
    Trace,
    load_trace,
    resize_trace,
    scale_trace,
    synthetic_trace,
)
from spotline.sim.calibration import (
    DEFAULT_CALIBRATION,
    NAMED_CALIBRATIONS,
    Calibration,
    load_calibration,
)
from spotline.sim.results import REFERENCES, PolicyResult
from spotline.sim.sim_config import POLICIES, PolicyName, SimConfig, trace_mtbf_s
from spotline.sim.simulator import simulate_policies
from spotline.sim.sweep import sweep


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``spotline simulate``."""
    parser = UsageErrorParser(
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
    assumptions = simulation_assumptions(
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
                or modelled_interval_s(config.model.checkpoint_save_s, trace_mtbf_s(trace)),
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
    print_assumptions(assumptions)
    recording = dataclasses.replace(config, record_timeline=True)
    results: dict[PolicyName, PolicyResult] = {}
    progress = _Progress(len(policies), "policies", args.no_progress)
    for policy in policies:
        results.update(simulate_policies(trace, (policy,), recording))
        progress(1)
    progress.close()
    summaries = with_references({policy: result.summary() for policy, result in results.items()})
    print(format_table(list(summaries.items()), "policy"))
    note = uncalibrated_note(summaries.items(), config.model)
    if note:
        print(note)
    ratios = headline_ratios(summaries)
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    plots = plot_trace_run(args.output, trace, results)
    write_text_atomic(args.output / "results.csv", csv_text(list(summaries.values())))
    document = {
        "command": "spotline simulate " + " ".join(args_text(args)),
        "assumptions": assumptions,
        "results": summaries,
        "ratios": ratios,
        "uncalibrated_note": note,
        "plots": [str(path.name) for path in plots],
    }
    write_text_atomic(
        args.output / "results.json", json.dumps(document, indent=2, default=str) + "\n"
    )
    print(f"\nwrote {args.output / 'results.json'}, results.csv and {len(plots)} plot(s)")
    return 0


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
    assumptions = simulation_assumptions(
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
    print_assumptions(assumptions)
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
        summaries = with_references(
            {policy: aggregate.summary() for policy, aggregate in by_policy.items()}
        )
        for policy, summary in summaries.items():
            rows.append(summary)
            per_policy[policy].append(summary)
            table.append((f"{rate:g} {policy}", summary))
        all_ratios[f"{rate:g}"] = headline_ratios(summaries)
    print(format_table(table, "rate policy"))
    note = uncalibrated_note(table, config.model)
    if note:
        print(note)
    for rate_text, ratios in all_ratios.items():
        for name, value in ratios.items():
            print(f"rate {rate_text}: {name}: {value:.2f}x")
    plots: list[Path] = []
    if len(rates) > 1:
        plots.extend(plot_sweep(args.output, results))
    # One recorded seed (the first) shows the trace, live nodes and throughput over time.
    example = synthetic_trace(args.nodes, rates[-1], duration_s, args.seed, args.replace_after)
    recording = dataclasses.replace(config, record_timeline=True)
    plots.extend(
        plot_trace_run(args.output, example, simulate_policies(example, policies, recording))
    )
    write_text_atomic(args.output / "results.csv", csv_text(rows))
    document = {
        "command": "spotline simulate " + " ".join(args_text(args)),
        "assumptions": assumptions,
        "results": per_policy,
        "ratios": all_ratios,
        "uncalibrated_note": note,
        "plots": [path.name for path in plots],
    }
    write_text_atomic(
        args.output / "results.json", json.dumps(document, indent=2, default=str) + "\n"
    )
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
