"""``spotline calibrate``: measure this machine's numbers for the simulator.

Short ``spotline train`` runs of the same job (``--stages S --workers W``), one after the
other, each measuring what the simulator's calibration table needs:

1. steady, once per pipeline count of ``--pipelines`` (at least three; default 1,2,3): the
   mean step time of S x P workers (the first two steps, warm-up, left out). Every run of
   the calibration trains the same logical topology (``--logical-workers``, the least common
   multiple of the pipeline counts), so every row has the same global batch, as the
   simulator assumes; the simulator interpolates between these rows and refuses (or, where
   it must plan outside them, flags) any other pipeline count;
2. checkpointing: the same with a checkpoint every step; the extra time is the save cost;
3. failover: the last worker is killed a third of the way in, with no spare, so the
   planner folds stages onto fewer workers: the recovery time (a generation change, the
   simulator's ``reconfigure_s``) and the step time of the folded (degraded) layout;
4. failover onto a spare: one worker arrives as a standby, then the last worker is killed;
   the standby receives the lost stage's state: the extra time over a generation change
   is ``state_transfer_s``;
5. fatal loss: W workers arrive as standbys (their start-up is ``node_ready_s``), then every
   member is killed at once, two thirds of the way in: the restore from the last
   checkpoint (``checkpoint_load_s`` on top of a generation change). This run keeps W / S
   logical workers, so that the arrivals stay standbys.

Runs 2-5 use W workers (W / S pipelines, also a measured count). The result is a
calibration table (the format of ``spotline/assets/calibration-bamboo.json``) with one
model, ``local``, in wall seconds of this machine; prices are the default table's.
``spotline simulate --calibration FILE --model local`` and the replay validation
(:mod:`spotline.sim.validate`) read it.

    spotline calibrate --stages 2 --workers 2 --pipelines 1,2,3 --steps 30 --output calibration.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

from spotline.errors import UserError
from spotline.launch.bench.jobs import (
    BenchSettings,
    RunFailed,
    machine_info,
    progress,
    resolve_base_config,
    run_guarded,
    run_spotline_train,
    write_config,
)
from spotline.launch.flags import UsageErrorParser
from spotline.reports.timeline import counted

WARMUP_STEPS = 2


def build_parser() -> argparse.ArgumentParser:
    parser = UsageErrorParser(prog="spotline calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="base config (default: the built-in one)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument(
        "--pipelines",
        default="1,2,3",
        help="pipeline counts to measure the step time of, at least three (default 1,2,3); "
        "W / S is always one of them",
    )
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--output", required=True, help="calibration JSON to write")
    parser.add_argument(
        "--runs", default="runs/calibrate", help="where the runs' files go (default runs/calibrate)"
    )
    return parser


MIN_PIPELINE_COUNTS = 3
"""A calibration measures at least this many pipeline counts (issue 14)."""


def parse_pipelines(text: str, base: int) -> tuple[int, ...]:
    """The pipeline counts of ``--pipelines`` (ascending, with ``base``, the run's own
    W / S, added); a UserError naming the flag when they are not at least three distinct
    positive integers."""
    counts: set[int] = set()
    for part in text.split(","):
        try:
            count = int(part.strip())
        except ValueError:
            raise UserError(
                f"--pipelines: {part.strip()!r} is not a whole number; e.g. --pipelines 1,2,3"
            ) from None
        if count < 1:
            raise UserError(f"--pipelines: counts must be >= 1, got {count}")
        counts.add(count)
    counts.add(base)
    if len(counts) < MIN_PIPELINE_COUNTS:
        raise UserError(
            f"--pipelines {text} measures {len(counts)} pipeline count(s); give at least "
            f"{MIN_PIPELINE_COUNTS} distinct ones (e.g. --pipelines 1,2,3) so the simulator "
            "has rows to interpolate between"
        )
    return tuple(sorted(counts))


def _steady_mean(times: list[float | None], first: int) -> float:
    """The mean step time from step ``first`` on, warm-up excluded: the mean, not the
    median, because a run's length is the sum of its steps, slow ones included."""
    kept = [t for t in times[max(first, WARMUP_STEPS) :] if t is not None]
    if not kept:
        raise RunFailed("no step times were reported; see the run's logs", 1)
    return sum(kept) / len(kept)


def _event_times(summary: dict[str, Any], kind: str) -> list[tuple[float, dict[str, Any]]]:
    return [(e["t_s"], e) for e in summary["events"] if e["kind"] == kind]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the four jobs; the measured numbers (wall seconds)."""
    stages, workers, steps = args.stages, args.workers, args.steps
    if stages < 1 or workers < 1 or workers % stages:
        raise UserError(
            f"--workers {workers} must be a positive multiple of --stages {stages}; "
            "e.g. --stages 2 --workers 2"
        )
    if steps < 12:
        raise UserError(f"--steps {steps} is too short to measure; use 12 or more")
    base_pipelines = workers // stages
    pipeline_counts = parse_pipelines(args.pipelines, base_pipelines)
    # One global batch for every run: each row's pipelines share the same logical workers
    # evenly (a count that does not divide them would time its busiest pipeline instead).
    logical = math.lcm(*pipeline_counts)
    runs = Path(args.runs)
    settings = BenchSettings(steps=steps, repeats=1, output=runs, config=args.config)
    base = resolve_base_config(
        settings,
        {
            "spotline.topology.workers": workers,
            "spotline.topology.stages": stages,
            "spotline.redundancy.mode": "lazy",
        },
    )
    runs.mkdir(parents=True, exist_ok=True)
    config = write_config(base, runs / "config.json")
    logical_flag = ["--logical-workers", str(logical)]
    topology = ["--workers", str(workers), "--stages", str(stages), *logical_flag]
    kill_at = steps // 3  # a step index (0-based); --inject names it kill_at + 1

    pipeline_step_s: dict[int, float] = {}
    steady: dict[str, Any] = {}
    for count in pipeline_counts:
        progress(
            f"calibrate 1/5: steady, {counted(stages, 'stage')} x {counted(count, 'pipeline')}"
        )
        run = run_spotline_train(
            config,
            runs / f"steady-{count}p",
            [
                *["--workers", str(stages * count), "--stages", str(stages), *logical_flag],
                *["--checkpoint-interval", "0"],
            ],
        )
        assert run["logical_workers"] == logical, (run["logical_workers"], logical)
        pipeline_step_s[count] = _steady_mean(run["step_times_s"], 0)
        if count == base_pipelines:
            steady = run
    step_time = pipeline_step_s[base_pipelines]

    progress("calibrate 2/5: checkpointing every step")
    saving = run_spotline_train(
        config, runs / "checkpoint", [*topology, "--checkpoint-interval", "1"]
    )
    save_s = max(0.0, _steady_mean(saving["step_times_s"], 0) - step_time)

    progress("calibrate 3/5: failover without a spare")
    failover = run_spotline_train(
        config,
        runs / "failover",
        [*topology, "--checkpoint-interval", "0", "--inject", f"kill:{kill_at + 1}:{workers - 1}"],
    )
    recoveries = [e["recovery_s"] for e in failover["recovery_events"]]
    if not recoveries:
        raise RunFailed("the failover run recorded no recovery; see its logs", 1)
    reconfigure_s = float(median(recoveries))
    degraded_step = _steady_mean(failover["step_times_s"], kill_at + 2)

    progress("calibrate 4/5: failover onto a spare")
    spare = run_spotline_train(
        config,
        runs / "spare",
        [
            *topology,
            "--checkpoint-interval",
            "0",
            "--inject",
            "add:2",
            "--inject",
            f"kill:{kill_at + 1}:{workers - 1}",
        ],
    )
    if not spare["recovery_events"]:
        raise RunFailed("the failover-onto-a-spare run recorded no recovery; see its logs", 1)
    transfer_s = max(0.0, float(spare["recovery_events"][-1]["recovery_s"]) - reconfigure_s)

    progress("calibrate 5/5: arrivals, then a fatal loss")
    # Late enough that checkpoints were committed (the coordinator commits them as it polls).
    fatal_at = 2 * steps // 3  # a step index (0-based), as kill_at
    interval = max(2, steps // 6)
    # This run alone keeps the default logical workers (W / S): with more, the W arrivals
    # would form pipelines of their own and the members' loss would be survived in memory.
    # What it measures (worker start-up, a restore) does not depend on the global batch.
    fatal_flags = [
        *["--workers", str(workers), "--stages", str(stages)],
        *["--checkpoint-interval", str(interval)],
    ]
    for _ in range(workers):
        fatal_flags += ["--inject", "add:2"]
    for worker in range(workers):
        fatal_flags += ["--inject", f"kill:{fatal_at + 1}:{worker}"]
    fatal = run_spotline_train(config, runs / "fatal", fatal_flags)
    arrived = {e["worker"]: t for t, e in _event_times(fatal, "arrived")}
    joined = [
        t - arrived[e["worker"]] for t, e in _event_times(fatal, "joined") if e["worker"] in arrived
    ]
    if not joined:
        raise RunFailed("the arrivals never joined; see the fatal run's logs", 1)
    # Checkpoints are committed in the background: on a slow machine none may be complete
    # when every worker dies, and the run starts again from scratch instead. Both are the
    # restore a fatal loss costs (the checkpoint read of a tiny model is milliseconds).
    falls = _event_times(fatal, "checkpoint-fallback")
    scratch = _event_times(fatal, "restart-from-scratch")
    if not (falls or scratch) or not fatal["recovery_events"]:
        raise RunFailed("the fatal-loss run recorded no restore; see its logs", 1)
    restore_s = float(fatal["recovery_events"][-1]["recovery_s"])
    return {
        "stages": stages,
        "workers": workers,
        "pipelines": base_pipelines,
        "logical_workers": logical,
        "steps": steps,
        # The fixed global batch: every logical pipeline's micro-batches.
        "samples_per_step": steady["micro_batch_size"]
        * steady["micro_batches"]
        * steady["logical_workers"],
        "step_time_s": step_time,
        "pipeline_step_times_s": {str(count): t for count, t in pipeline_step_s.items()},
        "degraded_step_time_s": degraded_step,
        "checkpoint_save_s": save_s,
        "reconfigure_s": reconfigure_s,
        "state_transfer_s": transfer_s,
        "restore_s": restore_s,
        "restore_from": "checkpoint" if falls else "scratch",
        "node_ready_s": float(median(joined)),
        "checkpoint_interval_steps": interval,
        "param_sha256": steady["param_sha256"],
        "model": steady["model"],
    }


def calibration_table(measured: dict[str, Any]) -> dict[str, Any]:
    """The measured numbers as a calibration table (one model, ``local``)."""
    from spotline.sim.calibration import DEFAULT_CALIBRATION_PATH

    default = json.loads(DEFAULT_CALIBRATION_PATH.read_text(encoding="utf-8"))
    stages, pipelines = measured["stages"], measured["pipelines"]
    step = measured["step_time_s"]
    # Tables written before --pipelines measured one count: the run's own.
    per_count = measured.get("pipeline_step_times_s", {str(pipelines): step})
    counts = ", ".join(sorted(per_count, key=int))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = [
        {
            "num_stages": stages,
            "num_pipelines": count,
            "degraded": False,
            "step_time_s": round(per_count[str(count)], 5),
        }
        for count in sorted(int(text) for text in per_count)
    ]
    rows.append(
        {
            "num_stages": stages,
            "num_pipelines": pipelines,
            "degraded": True,
            "step_time_s": round(measured["degraded_step_time_s"], 5),
        }
    )
    return {
        "description": (
            f"Measured by spotline calibrate on this machine ({when}): {measured['model']}, "
            f"{stages} stages x {counts} pipelines, wall seconds; prices from the default table."
        ),
        "sources": {
            "measured": (
                "spotline calibrate: short spotline train runs, a steady one per pipeline "
                "count, then four at the run's own (see launch/calibrate.py)"
            ),
            "prices": "copied from spotline/assets/calibration-bamboo.json",
        },
        "spot_price_per_node_hour": default["spot_price_per_node_hour"],
        "on_demand_price_per_node_hour": default["on_demand_price_per_node_hour"],
        "node_ready_s": round(measured["node_ready_s"], 4),
        # A (re)start from nothing is a generation change; a restore adds the checkpoint read.
        "fatal_rendezvous_s": round(measured["reconfigure_s"], 4),
        "reconfigure_s": round(measured["reconfigure_s"], 4),
        "state_transfer_s": round(measured["state_transfer_s"], 4),
        "degraded_slowdown": round(measured["degraded_step_time_s"] / step, 4),
        "preemption_notice_s": default["preemption_notice_s"],
        "spotline_checkpoint_interval_s": round(measured["checkpoint_interval_steps"] * step, 4),
        "models": {
            "local": {
                "num_stages": stages,
                "samples_per_step": measured["samples_per_step"],
                "checkpoint_save_s": round(measured["checkpoint_save_s"], 4),
                "checkpoint_load_s": round(
                    max(0.0, measured["restore_s"] - measured["reconfigure_s"]), 4
                ),
                "step_times": rows,
            }
        },
        "measured": measured,
        "machine": machine_info(),
    }


def main(argv: list[str] | None = None) -> int:
    """0 on success, 2 on bad input, 1 when a measured run failed."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def work(args: argparse.Namespace) -> int:
        from spotline.atomic_files import write_json_atomic
        from spotline.sim.calibration import load_calibration

        table = calibration_table(measure(args))
        output = Path(args.output)
        write_json_atomic(output, table)
        load_calibration(output)  # what was written is a valid table
        m = table["measured"]
        per_count = ", ".join(
            f"{count}: {t * 1e3:.1f} ms" for count, t in m["pipeline_step_times_s"].items()
        )
        print(
            f"spotline: calibrated {m['stages']} stages, step by pipelines {per_count}; "
            f"at {m['pipelines']}: step {m['step_time_s'] * 1e3:.1f} ms "
            f"(folded {m['degraded_step_time_s'] * 1e3:.1f} ms), "
            f"generation change {m['reconfigure_s']:.2f} s "
            f"(+{m['state_transfer_s']:.2f} s moving state), restore {m['restore_s']:.2f} s, "
            f"worker start-up {m['node_ready_s']:.2f} s, "
            f"checkpoint save {m['checkpoint_save_s'] * 1e3:.1f} ms"
        )
        print(f"calibration: {output}")
        return 0

    return run_guarded("calibrate", build_parser(), argv, work)


if __name__ == "__main__":
    sys.exit(main())
