"""``spotline bench``: side-by-side benchmarks of real training runs on this machine.

    spotline bench foundation [--steps 30] [--repeats 3] [--output runs/bench]
    spotline bench foundation --model gpt2-big     (or --ladder gpt2: tiny, mid, big)
    spotline bench foundation --stages 4           (4 stages x 1 pipeline; default 2 x 2)
    spotline bench foundation --alternate 4        (a round's jobs at once, taking turns)
    spotline bench foundation --profile            (CPU and idle cores against stock's)
    spotline bench redundancy [--steps 30] [--repeats 3] [--cases 2x2,2x4,4x4] [--pipelines 2]
                              [--modes lazy,lazy-sharded] [--alternate 6] [--profile]
    spotline bench recovery --trace FILE [--time-scale 60] [--max-workers 3]
    spotline bench reduce [--elements 1000000] [--ranks 2] [--logical-workers 4]
    spotline bench overlap [--elements 7172736] [--ranks 2] [--device cpu]
    spotline bench easyscale [--workers 2]
    spotline bench takeover [--kill-at 6]
    spotline bench profile [--model gpt2-big] [--stages 2]
    spotline bench cluster [--steps 8] [--repeats 3] [--victim w1] [--kill-after 2]
    spotline bench cluster-replay [--trace FILE] [--machines 4] [--time-scale 30]
                                  [--steps 200] [--repeats 1] [--calibration FILE]

Each subcommand runs its variants in one invocation, interleaved (A, B, A, B, ... for
``--repeats`` rounds) so that machine noise (other jobs on a shared CPU, thermal drift)
hits every variant alike, then reports the median over the rounds and the ratios between
variants: a Markdown table on stdout and the whole record in ``<output>/bench-<name>.json``
(written atomically). Every run is a real multi-process job started as a subprocess; its
own output directory and logs stay under ``<output>/<name>/``. One module per benchmark
(:mod:`~spotline.launch.bench.foundation`, :mod:`~spotline.launch.bench.redundancy_bench`,
:mod:`~spotline.launch.bench.recovery_bench`, :mod:`~spotline.launch.bench.reduce`,
:mod:`~spotline.launch.bench.overlap`, :mod:`~spotline.launch.bench.easyscale`); this one
parses the command line and dispatches.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from spotline.errors import UserError
from spotline.launch.bench.cluster import bench_cluster, format_cluster
from spotline.launch.bench.cluster_replay import (
    DEFAULT_TRACE,
    bench_cluster_replay,
    format_cluster_replay,
)
from spotline.launch.bench.easyscale import bench_easyscale, format_easyscale
from spotline.launch.bench.foundation import (
    FOUNDATION_STAGES,
    FOUNDATION_WORKERS,
    bench_foundation,
    format_foundation,
)
from spotline.launch.bench.jobs import BenchSettings, run_guarded
from spotline.launch.bench.ladder import (
    LADDER_BENCHES,
    LADDERS,
    format_ladder,
    ladder_models,
    ladder_report,
    parameters,
    plot_ladder,
)
from spotline.launch.bench.overlap import (
    DEFAULT_OVERLAP_ELEMENTS,
    bench_overlap,
    format_overlap,
)
from spotline.launch.bench.profile import bench_profile, format_profile
from spotline.launch.bench.recovery_bench import bench_recovery, format_recovery
from spotline.launch.bench.reduce import bench_reduce, format_reduce
from spotline.launch.bench.redundancy_bench import (
    DEFAULT_CASES,
    bench_redundancy,
    format_redundancy,
    parse_cases,
)
from spotline.launch.bench.takeover import bench_takeover, format_takeover
from spotline.launch.flags import UsageErrorParser

DEFAULT_STEPS = 30
# The cluster bench times a loss, not steady steps: a few steps before and after it.
CLUSTER_DEFAULT_STEPS = 8
# A replay runs long enough to meet a trace's preemptions, once (it is not a timing of steps).
REPLAY_DEFAULT_STEPS, REPLAY_DEFAULT_REPEATS = 200, 1
DEFAULT_REPEATS = 3
# A takeover is timed once a run: a few steps before and after it.
TAKEOVER_DEFAULT_STEPS = 10
QUICK_STEPS = 6
QUICK_REPEATS = 1
DEFAULT_OUTPUT = "runs/bench"
DEFAULT_ELEMENTS = 1_000_000


def build_parser() -> argparse.ArgumentParser:
    common = UsageErrorParser(add_help=False)
    common.add_argument(
        "--output", default=DEFAULT_OUTPUT, help=f"results folder (default {DEFAULT_OUTPUT})"
    )
    common.add_argument(
        "--steps", type=int, help=f"optimizer steps per run (default {DEFAULT_STEPS})"
    )
    common.add_argument(
        "--repeats", type=int, help=f"interleaved rounds (default {DEFAULT_REPEATS})"
    )
    common.add_argument(
        "--quick",
        action="store_true",
        help=f"steps {QUICK_STEPS}, repeats {QUICK_REPEATS} unless given: a smoke test, not a measurement",
    )
    common.add_argument("--config", help="base config JSON (default: the built-in default)")
    common.add_argument(
        "--model",
        help="the model to measure: a ladder rung (gpt2-tiny, gpt2-mid, gpt2-big, llama-tiny, "
        "llama-mid, llama-big: each with its sequence length and micro-batch size), another "
        "preset or a save_pretrained directory (default: the config's)",
    )
    common.add_argument(
        "--ladder",
        metavar="FAMILY",
        help=f"run the benchmark on every rung of a family's ladder ({', '.join(LADDERS)}) "
        "and print its ratios against the parameters",
    )
    parser = UsageErrorParser(
        prog="spotline bench",
        description="side-by-side benchmarks of real training runs on this machine",
    )
    sub = parser.add_subparsers(
        dest="bench",
        required=True,
        metavar="{foundation,redundancy,recovery,reduce,overlap,easyscale,takeover,profile,"
        "cluster,cluster-replay}",
    )
    foundation = sub.add_parser(
        "foundation", parents=[common], help="Spotline vs stock DeepSpeed PipelineEngine"
    )
    redundancy = sub.add_parser(
        "redundancy", parents=[common], help="redundancy off / lazy / eager"
    )
    redundancy.add_argument(
        "--cases",
        default=",".join(c.name for c in DEFAULT_CASES),
        help="comma-separated <stages>x<micro-batches> (default %(default)s)",
    )
    redundancy.add_argument(
        "--pipelines",
        type=int,
        default=1,
        help="data-parallel pipelines of each case (default 1); 2 or more add the mode "
        "lazy-sharded (sharded replicas)",
    )
    redundancy.add_argument(
        "--modes",
        default=None,
        help="comma-separated modes to bench beside off (off, lazy, eager, lazy-sharded; "
        "default: all the case can run); off always runs, every ratio is over it",
    )
    redundancy.add_argument(
        "--profile",
        action="store_true",
        help="also time every schedule instruction of every run, and report each mode's CPU "
        "per step by instruction (the schedule's thread and the others) against off's, "
        "paired by round",
    )
    foundation.add_argument(
        "--profile",
        action="store_true",
        help="also time every schedule instruction of every run, and report each Spotline "
        "variant's CPU by instruction and the cores' idle time by wait against the stock "
        "run of its round",
    )
    recovery = sub.add_parser(
        "recovery", parents=[common], help="in-memory failover vs checkpoint-restart on a trace"
    )
    recovery.add_argument(
        "--trace", required=True, help="a spot trace (e.g. integration/assets/traces/p3-trace.csv)"
    )
    recovery.add_argument(
        "--max-workers", type=int, default=3, help="local cap on workers (default 3)"
    )
    recovery.add_argument(
        "--time-scale", type=float, default=60.0, help="trace seconds per wall second"
    )
    reduce = sub.add_parser(
        "reduce", parents=[common], help="exact (fixed-order) reduction vs a float all_reduce"
    )
    reduce.add_argument(
        "--elements",
        type=int,
        help=f"gradient elements (default {DEFAULT_ELEMENTS:,}, or --model's parameters)",
    )
    reduce.add_argument("--ranks", type=int, default=2, help="gloo processes (default 2)")
    reduce.add_argument(
        "--logical-workers", type=int, default=4, help="logical workers in all (default 4)"
    )
    overlap = sub.add_parser(
        "overlap",
        parents=[common],
        help="whether the replica exchange hides behind the replica's step on this host",
    )
    overlap.add_argument(
        "--elements",
        type=int,
        help=f"elements each rank sends (default {DEFAULT_OVERLAP_ELEMENTS:,}: a gpt2-big "
        "stage of 2; with --model, half its parameters)",
    )
    overlap.add_argument("--ranks", type=int, default=2, help="processes on the ring (default 2)")
    overlap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (gloo) or cuda (NCCL, one GPU a rank) (default cpu)",
    )
    easyscale = sub.add_parser(
        "easyscale",
        parents=[common],
        help="logical workers: step time vs stock data parallelism, reduction, rescale, memory",
    )
    easyscale.add_argument(
        "--workers", type=int, default=2, help="processes = logical workers (default 2)"
    )
    cluster = sub.add_parser(
        "cluster",
        parents=[common],
        help="a machine lost on a namespace cluster (kill, cut link, one-machine reference) "
        "and the gloo vs TCP state-transfer rate between two machines (needs root)",
    )
    cluster.add_argument(
        "--victim", default="w1", help="the worker whose machine is lost (default w1)"
    )
    cluster.add_argument(
        "--kill-after",
        type=int,
        default=2,
        help="lose it once the coordinator shows this step (default 2)",
    )
    cluster.add_argument(
        "--heartbeat-timeout",
        type=float,
        help="recovery.heartbeat_timeout_s (default: the config's)",
    )
    cluster.add_argument(
        "--transfer-mib", type=int, default=256, help="bytes per transfer, MiB (default 256)"
    )
    cluster.add_argument(
        "--transfer-repeats", type=int, default=5, help="transfers per path (default 5)"
    )
    profile = sub.add_parser(
        "profile",
        parents=[common],
        help="seconds per step by schedule instruction: Spotline (lazy, off) and stock",
    )
    for turns in (foundation, redundancy):
        turns.add_argument(
            "--alternate",
            type=float,
            default=None,
            metavar="SECONDS",
            help="run a round's jobs at once, taking turns of SECONDS on the host (the others "
            "stopped), and time the steps inside the turns: the host's drift is then the same "
            "for every job (default: one run after another)",
        )
    for four_workers in (foundation, profile):
        four_workers.add_argument(
            "--stages",
            type=int,
            choices=FOUNDATION_STAGES,
            default=2,
            help=f"pipeline stages of the {FOUNDATION_WORKERS} workers (default %(default)s)",
        )
    takeover = sub.add_parser(
        "takeover",
        parents=[common],
        help="an in-memory takeover's time (kill to next committed step) and the state it moves",
    )
    takeover.add_argument(
        "--kill-at",
        type=int,
        default=6,
        help="SIGKILL worker 1 during this step, counted from 1 (default 6)",
    )
    replay = sub.add_parser(
        "cluster-replay",
        parents=[common],
        help="a spot trace replayed machine by machine on a namespace cluster, against the "
        "simulator's prediction (needs root)",
    )
    replay.add_argument("--trace", default=DEFAULT_TRACE, help="a spot trace (default %(default)s)")
    replay.add_argument(
        "--machines", type=int, default=4, help="machines of 1 slot at most (default 4)"
    )
    replay.add_argument(
        "--time-scale", type=float, default=30.0, help="trace seconds per wall second (default 30)"
    )
    replay.add_argument(
        "--checkpoint-interval", type=int, default=10, help="steps between checkpoints (default 10)"
    )
    replay.add_argument(
        "--calibration",
        help="a table `spotline calibrate` measured on this machine: adds the prediction",
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    default_steps = {
        "cluster": CLUSTER_DEFAULT_STEPS,
        "cluster-replay": REPLAY_DEFAULT_STEPS,
        "takeover": TAKEOVER_DEFAULT_STEPS,
    }
    default_repeats = REPLAY_DEFAULT_REPEATS if args.bench == "cluster-replay" else DEFAULT_REPEATS
    steps = (
        args.steps
        if args.steps is not None
        else (QUICK_STEPS if args.quick else default_steps.get(args.bench, DEFAULT_STEPS))
    )
    repeats = (
        args.repeats
        if args.repeats is not None
        else (QUICK_REPEATS if args.quick else default_repeats)
    )
    if steps < 1:
        raise UserError(f"--steps {steps}: use at least 1 step")
    if repeats < 1:
        raise UserError(f"--repeats {repeats}: use at least 1 round")
    if args.ladder is not None:
        if args.model is not None:
            raise UserError("--ladder runs every model of a ladder; drop --model or --ladder")
        if args.bench not in LADDER_BENCHES:
            raise UserError(
                f"--ladder: bench {args.bench} does not run a ladder; use it with "
                + ", ".join(LADDER_BENCHES)
            )
        ladder_models(args.ladder)  # an unknown family fails here, before any run
    if getattr(args, "elements", None) is not None and args.model is not None:
        raise UserError("--elements and --model both set the gradient size; give one of them")
    return BenchSettings(
        steps=steps,
        repeats=repeats,
        output=Path(args.output),
        config=args.config,
        model=args.model,
    )


def run_bench(args: argparse.Namespace, settings: BenchSettings) -> tuple[dict[str, Any], str]:
    """One benchmark on ``settings``: its report and its table."""
    if args.bench == "foundation":
        report = bench_foundation(settings, args.stages, args.alternate, args.profile)
        return report, format_foundation(report)
    if args.bench == "recovery":
        report = bench_recovery(settings, args.trace, args.time_scale, args.max_workers)
        return report, format_recovery(report)
    if args.bench == "easyscale":
        report = bench_easyscale(settings, args.workers)
        return report, format_easyscale(report)
    if args.bench == "cluster":
        report = bench_cluster(
            settings,
            victim=args.victim,
            kill_after=args.kill_after,
            heartbeat_timeout_s=args.heartbeat_timeout,
            transfer_mib=args.transfer_mib,
            transfer_repeats=args.transfer_repeats,
        )
        return report, format_cluster(report)
    if args.bench == "cluster-replay":
        report = bench_cluster_replay(
            settings,
            trace_path=args.trace,
            machines=args.machines,
            time_scale=args.time_scale,
            checkpoint_interval=args.checkpoint_interval,
            calibration_path=args.calibration,
        )
        return report, format_cluster_replay(report)
    if args.bench == "profile":
        report = bench_profile(settings, args.stages)
        return report, format_profile(report)
    if args.bench == "takeover":
        report = bench_takeover(settings, args.kill_at)
        return report, format_takeover(report)
    if args.bench == "reduce":
        if settings.model is not None:
            elements = parameters(settings.model)
        else:
            elements = DEFAULT_ELEMENTS if args.elements is None else args.elements
        report = bench_reduce(settings, elements, args.ranks, args.logical_workers)
        report["model"] = settings.model
        return report, format_reduce(report)
    if args.bench == "overlap":
        if settings.model is not None:
            elements = parameters(settings.model) // 2
        else:
            elements = DEFAULT_OVERLAP_ELEMENTS if args.elements is None else args.elements
        report = bench_overlap(settings, elements, args.ranks, args.device)
        report["model"] = settings.model
        return report, format_overlap(report)
    report = bench_redundancy(
        settings,
        parse_cases(args.cases, args.pipelines, args.modes),
        args.alternate,
        args.profile,
    )
    return report, format_redundancy(report)


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark; 0 on success, 2 on bad input, 1 when a benchmarked job failed."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def work(args: argparse.Namespace) -> int:
        from spotline.atomic_files import write_json_atomic

        settings = settings_from_args(args)
        if args.ladder is None:
            report, table = run_bench(args, settings)
        else:
            rungs = []
            for model in ladder_models(args.ladder):
                rung_settings = replace(settings, model=model, output=settings.output / model)
                rung_report, rung_table = run_bench(args, rung_settings)
                rung_report["command"] = ["spotline", "bench", *argv]
                print(rung_table, "", sep="\n", flush=True)
                rungs.append((model, parameters(model), rung_report))
            report = ladder_report(args.bench, rungs)
            plot = settings.output / f"bench-{args.bench}-ladder.png"
            plot_ladder(report, plot)
            table = f"{format_ladder(report)}\n\nplot: {plot}"
        report["command"] = ["spotline", "bench", *argv]
        path = settings.output / f"bench-{report['bench']}.json"
        write_json_atomic(path, report)
        print(table)
        print(f"\nresults: {path}", flush=True)
        return 0

    return run_guarded("bench", build_parser(), argv, work)


if __name__ == "__main__":
    sys.exit(main())
