"""``spotline bench``: side-by-side benchmarks of real training runs on this machine.

    spotline bench foundation [--steps 30] [--repeats 3] [--output runs/bench]
    spotline bench redundancy [--steps 30] [--repeats 3] [--cases 2x2,2x4,4x4]

Each subcommand runs its variants in one invocation, interleaved (A, B, A, B, ... for
``--repeats`` rounds) so that machine noise (other jobs on a shared CPU, thermal drift)
hits every variant alike, then reports the median over the rounds and the ratios between
variants: a Markdown table on stdout and the whole record in ``<output>/bench-<name>.json``
(written atomically). Every run is a real multi-process job started as a subprocess; its
own output directory and logs stay under ``<output>/<name>/``.

- ``foundation``: ``spotline train`` (Spotline's engine) against the same model, batches
  and steps trained by DeepSpeed's stock ``PipelineEngine`` (``spotline.launch.stock_worker``).
- ``redundancy``: ``spotline train`` with ``--redundancy off``, ``lazy`` and ``eager`` for
  each case (stages x micro-batches, one pipeline), plus what the pure schedule says about
  the eager mode: the fraction of redundant forwards its bubbles can hide, and the steps it
  adds.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from spotline.errors import UserError
from spotline.plan.schedule import REDUNDANCY_MODES

EXIT_USAGE = 2
DEFAULT_STEPS = 30
DEFAULT_REPEATS = 3
QUICK_STEPS = 6
QUICK_REPEATS = 1
DEFAULT_OUTPUT = "runs/bench"


@dataclass(frozen=True)
class BenchSettings:
    """What every subcommand shares: run length, rounds, where results go, the base config."""

    steps: int
    repeats: int
    output: Path
    config: str | None


@dataclass(frozen=True)
class RedundancyCase:
    """One shape of the redundancy benchmark: one pipeline of ``num_stages`` stages.

    One process per stage (``num_workers == num_stages``), ``num_micro_batches`` per step.
    Written ``<stages>x<micro-batches>`` (``2x4``) on the command line and in the report.
    """

    num_stages: int
    num_micro_batches: int

    @property
    def num_workers(self) -> int:
        return self.num_stages

    @property
    def name(self) -> str:
        return f"{self.num_stages}x{self.num_micro_batches}"


# 2 stages with 2 and 4 micro-batches, and 4 stages on 4 processes: more processes than a
# 2-core machine has cores, where the bubbles are no longer idle CPU time.
DEFAULT_CASES = (RedundancyCase(2, 2), RedundancyCase(2, 4), RedundancyCase(4, 4))


def parse_cases(text: str) -> tuple[RedundancyCase, ...]:
    """``"2x2,4x4"`` -> the cases; raises UserError naming the bad entry."""
    cases = []
    for part in text.split(","):
        fields = part.strip().lower().split("x")
        if len(fields) != 2 or not all(f.isdigit() for f in fields):
            raise UserError(
                f"--cases entry {part.strip()!r} is not <stages>x<micro-batches>; use e.g. --cases 2x2,4x4"
            )
        num_stages, num_micro_batches = int(fields[0]), int(fields[1])
        if num_stages < 2 or num_micro_batches < 1:
            raise UserError(
                f"--cases entry {part.strip()!r}: redundancy needs >= 2 stages and >= 1 micro-batch"
            )
        cases.append(RedundancyCase(num_stages, num_micro_batches))
    if len(set(cases)) != len(cases):
        raise UserError(f"--cases {text!r} names a case twice; list each case once")
    return tuple(cases)


class RunFailed(Exception):
    """A benchmarked job exited non-zero; ``exit_code`` is what ``main`` returns for it."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------- small helpers


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def median_per_rank(rows: Sequence[Sequence[float]]) -> list[float]:
    """Element-wise median over rounds of per-rank lists (every round has the same ranks)."""
    assert rows and len({len(r) for r in rows}) == 1, rows
    return [median(column) for column in zip(*rows, strict=True)]


def medians(runs: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, float]:
    """Median over runs of each key that every run reports (optional keys may be absent)."""
    return {k: median([r[k] for r in runs]) for k in keys if all(k in r for r in runs)}


def interleaved(variants: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """The run order: every variant once per round, rounds one after another (A, B, A, B)."""
    return [(round_idx, v) for round_idx in range(repeats) for v in variants]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # One intra-op thread per process: the fast setting on a shared CPU and Spotline's own.
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def resolve_base_config(settings: BenchSettings, overrides: dict[str, Any]) -> Any:
    """The base config with the bench's overrides; UserError on a bad file or value."""
    from spotline.config import load_config, with_overrides

    return with_overrides(
        load_config(settings.config),
        {
            "spotline.training.steps": settings.steps,
            "spotline.tracking.wandb": "disabled",
            "spotline.tracking.progress": False,
            **overrides,
        },
    )


def write_config(cfg: Any, path: Path) -> Path:
    from spotline.tracking import write_json_atomic

    write_json_atomic(path, cfg.to_json())
    return path


def _error_line(log_text: str) -> str | None:
    for line in log_text.splitlines():
        if line.startswith("spotline: error: "):
            return line.removeprefix("spotline: error: ")
    return None


# --------------------------------------------------------------------------- running jobs


def run_spotline_train(config: Path, run_dir: Path, extra_flags: Sequence[str]) -> dict[str, Any]:
    """``spotline train`` as a subprocess (its own workers); returns its summary.json.

    The job's stdout and stderr go to ``run_dir/bench.log``. Raises RunFailed: exit 2 with
    the job's one-line error (a user mistake), exit 1 otherwise.
    """
    import json

    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "bench.log"
    cmd = [
        sys.executable,
        "-m",
        "spotline.launch.cli",
        "train",
        "--config",
        str(config),
        "--output",
        str(run_dir),
        *extra_flags,
    ]
    with open(log_path, "wb") as log:
        code = subprocess.call(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        message = _error_line(log_path.read_text(errors="replace"))
        if code == EXIT_USAGE and message is not None:
            raise RunFailed(message, EXIT_USAGE)
        raise RunFailed(f"spotline train exited {code}; see {log_path} and {run_dir}/logs", 1)
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return with_per_rank_lists(summary)


def _id_order(worker_id: str) -> tuple[int, str]:
    """Order worker ids ("w10" after "w2") by their number, then by text."""
    digits = re.findall(r"\d+", worker_id)
    return (int(digits[-1]) if digits else -1, worker_id)


PER_RANK_FIELDS = ("peak_rss_mib", "redundant_compute_s", "replica_sync_s")


def with_per_rank_lists(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with ``<field>_per_rank`` lists, also when a summary keys them by worker.

    A summary written by a coordinator may report ``<field>_per_worker`` as a mapping from
    worker id (a string in JSON, e.g. ``w0``) to the value; ordered by id that is the per-rank list of
    an undisturbed run. A field reported neither way stays absent.
    """
    out = dict(summary)
    for name in PER_RANK_FIELDS:
        by_worker = out.get(f"{name}_per_worker")
        if f"{name}_per_rank" in out or by_worker is None:
            continue
        if isinstance(by_worker, dict):
            out[f"{name}_per_rank"] = [
                float(by_worker[k]) for k in sorted(by_worker, key=_id_order)
            ]
        else:
            out[f"{name}_per_rank"] = [float(v) for v in by_worker]
    return out


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of one stock rank: what ``spotline train`` gives its workers.

    Every one of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK is needed: with one
    missing DeepSpeed falls back to MPI discovery (DEEPSPEED-NOTES.md).
    """
    env = child_env()
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the live ranks, then SIGKILL those still alive after a grace period."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_ranks(procs: Sequence[subprocess.Popen[bytes]]) -> list[int]:
    """Exit codes of every rank; when one fails the others are stopped (they would hang)."""
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes if c is not None]
        if any(c not in (None, 0) for c in codes):
            time.sleep(1.0)
            stop(procs)
            return [int(p.wait()) for p in procs]
        time.sleep(0.05)


def run_rank_module(
    module: str, args: Sequence[str], num_ranks: int, run_dir: Path, label: str
) -> dict[str, Any]:
    """``num_ranks`` ranks of ``python -m module *args --output run_dir/result.json`` on one
    gloo group; returns the JSON rank 0 writes there.

    Each rank's output goes to ``run_dir/logs/worker-<rank>.log``. Raises RunFailed
    (exit 1, naming ``label``) when a rank fails.
    """
    import json

    logs_dir = run_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    result_path = run_dir / "result.json"
    result_path.unlink(missing_ok=True)
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    cmd = [sys.executable, "-m", module, *args, "--output", str(result_path)]
    try:
        for rank in range(num_ranks):
            with open(logs_dir / f"worker-{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=rank_env(rank, num_ranks, port),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        codes = wait_ranks(procs)
    except BaseException:
        stop(procs)
        raise
    if any(c != 0 for c in codes) or not result_path.exists():
        raise RunFailed(f"{label} ranks exited {codes}; see {logs_dir}/worker-*.log", 1)
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


def run_stock(config: Path, num_workers: int, run_dir: Path) -> dict[str, Any]:
    """``num_workers`` ranks of ``spotline.launch.stock_worker``; returns rank 0's JSON."""
    return run_rank_module(
        "spotline.launch.stock_worker",
        ["--config", str(config)],
        num_workers,
        run_dir,
        "stock DeepSpeed",
    )


def run_rounds(
    variants: Sequence[str],
    repeats: int,
    run_one: Callable[[str, int], dict[str, Any]],
    label: str,
) -> dict[str, list[dict[str, Any]]]:
    """Run every variant ``repeats`` times, interleaved; each result gets its process time."""
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    order = interleaved(variants, repeats)
    for index, (round_idx, variant) in enumerate(order):
        t0 = time.perf_counter()
        result = run_one(variant, round_idx)
        result["process_s"] = time.perf_counter() - t0
        results[variant].append(result)
        progress(
            f"{label} {variant} round {round_idx + 1}/{repeats} ({index + 1}/{len(order)}): "
            f"step {result['step_time_s'] * 1000:.1f} ms, {result['process_s']:.1f} s with start-up"
        )
    return results


def machine_info() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0],
    }


# --------------------------------------------------------------------------- foundation

FOUNDATION_VARIANTS = ("spotline", "stock")
FOUNDATION_KEYS = ("samples_per_s", "step_time_s", "wall_s", "setup_s", "final_loss", "process_s")


def bench_foundation(settings: BenchSettings) -> dict[str, Any]:
    """Spotline's engine vs DeepSpeed's stock engine on the default 2 stages x 2 pipelines."""
    from spotline.launch.stock_worker import TIED_COPY_NOTE

    cfg = resolve_base_config(
        settings, {"spotline.topology.workers": 4, "spotline.topology.stages": 2}
    )
    work = settings.output / "foundation"
    config = write_config(cfg, work / "config.json")
    info_before = machine_info()

    def run_one(variant: str, round_idx: int) -> dict[str, Any]:
        run_dir = work / f"{variant}-r{round_idx}"
        if variant == "spotline":
            return run_spotline_train(config, run_dir, [])
        return run_stock(config, cfg.num_workers, run_dir)

    results = run_rounds(FOUNDATION_VARIANTS, settings.repeats, run_one, "foundation")
    variants: dict[str, Any] = {}
    for variant, runs in results.items():
        variants[variant] = {
            **medians(runs, FOUNDATION_KEYS),
            "peak_rss_mib_per_rank": median_per_rank([r["peak_rss_mib_per_rank"] for r in runs]),
            "runs": [
                {k: r[k] for k in (*FOUNDATION_KEYS, "peak_rss_mib_per_rank") if k in r}
                for r in runs
            ],
        }
    spot, stock = variants["spotline"], variants["stock"]
    ratios = {
        "samples_per_s": spot["samples_per_s"] / stock["samples_per_s"],
        "step_time_s": spot["step_time_s"] / stock["step_time_s"],
        "peak_rss_mib_max_rank": max(spot["peak_rss_mib_per_rank"])
        / max(stock["peak_rss_mib_per_rank"]),
        "peak_rss_mib_per_rank": [
            a / b
            for a, b in zip(
                spot["peak_rss_mib_per_rank"], stock["peak_rss_mib_per_rank"], strict=True
            )
        ],
    }
    return {
        "bench": "foundation",
        "model": cfg.spotline.model.name,
        "workers": cfg.num_workers,
        "stages": cfg.num_stages,
        "pipelines": cfg.num_pipelines,
        "micro_batches": cfg.num_micro_batches,
        "micro_batch_size": cfg.micro_batch_size,
        "steps": settings.steps,
        "repeats": settings.repeats,
        "order": "interleaved: spotline, stock per round",
        "statistic": "median over rounds (per rank for memory); ratios are spotline / stock",
        "variants": variants,
        "ratio_spotline_over_stock": ratios,
        "note": TIED_COPY_NOTE,
        "machine": {"before": info_before, "after": machine_info()},
    }


def format_foundation(report: dict[str, Any]) -> str:
    def rss(values: Sequence[float]) -> str:
        return " / ".join(f"{v:.0f}" for v in values)

    v = report["variants"]
    r = report["ratio_spotline_over_stock"]
    rows = [
        "| engine | samples/s | step time (ms, median) | peak RSS per rank (MiB) |",
        "|---|---:|---:|---|",
    ]
    for name, title in (
        ("spotline", "Spotline (spotline train)"),
        ("stock", "stock DeepSpeed PipelineEngine"),
    ):
        rows.append(
            f"| {title} | {v[name]['samples_per_s']:.1f} | {v[name]['step_time_s'] * 1000:.1f} "
            f"| {rss(v[name]['peak_rss_mib_per_rank'])} |"
        )
    rows.append(
        f"| ratio Spotline / stock | {r['samples_per_s']:.3f} | {r['step_time_s']:.3f} "
        f"| {' / '.join(f'{x:.3f}' for x in r['peak_rss_mib_per_rank'])} |"
    )
    head = (
        f"### foundation: {report['model']}, {report['workers']} workers "
        f"({report['stages']} stages x {report['pipelines']} pipelines), "
        f"{report['micro_batches']} micro-batches of {report['micro_batch_size']}, "
        f"{report['steps']} steps, median of {report['repeats']} interleaved rounds"
    )
    return "\n".join([head, "", *rows, "", f"Note: {report['note']}."])


# --------------------------------------------------------------------------- redundancy


def schedule_facts(case: RedundancyCase) -> dict[str, Any]:
    """What the pure schedule says about a case: eager's hidden fraction, extra steps per mode."""
    from spotline.plan import schedule as plan

    base = plan.train_schedule(case.num_stages, case.num_micro_batches)
    by_mode = {mode: plan.add_redundancy(base, mode) for mode in REDUNDANCY_MODES}
    return {
        "hidden_fraction": plan.hidden_fraction(by_mode["eager"]),
        "num_extra_steps": {mode: plan.num_extra_steps(s) for mode, s in by_mode.items()},
        "num_schedule_steps": {mode: s.num_steps for mode, s in by_mode.items()},
        "eager_grid": plan.format_grid(by_mode["eager"]),
    }


REDUNDANCY_KEYS = ("step_time_s", "samples_per_s", "wall_s", "process_s")


def _per_step_median(runs: Sequence[dict[str, Any]], key: str) -> list[float] | None:
    """Median over runs of a per-rank total divided by the steps; None if a run lacks it."""
    if not all(key in r for r in runs):
        return None
    # The engine's counters add up over the whole run.
    return median_per_rank([[v / r["steps"] for v in r[key]] for r in runs])


def bench_redundancy(settings: BenchSettings, cases: Sequence[RedundancyCase]) -> dict[str, Any]:
    """Redundancy off/lazy/eager, interleaved, for each case; medians and ratios to off."""
    report_cases = []
    for case in cases:
        facts = schedule_facts(case)
        print(f"eager schedule, {case.name} (stages x micro-batches), compute actions:")
        print("```")
        print(facts["eager_grid"])
        print("```", flush=True)
        cfg = resolve_base_config(
            settings,
            {
                "spotline.topology.workers": case.num_workers,
                "spotline.topology.stages": case.num_stages,
                "gradient_accumulation_steps": case.num_micro_batches,
            },
        )
        work = settings.output / "redundancy" / case.name
        config = write_config(cfg, work / "config.json")

        def run_one(
            mode: str, round_idx: int, work: Path = work, config: Path = config
        ) -> dict[str, Any]:
            return run_spotline_train(config, work / f"{mode}-r{round_idx}", ["--redundancy", mode])

        results = run_rounds(REDUNDANCY_MODES, settings.repeats, run_one, f"redundancy {case.name}")
        modes: dict[str, Any] = {}
        for mode, runs in results.items():
            modes[mode] = {
                **medians(runs, REDUNDANCY_KEYS),
                "peak_rss_mib_per_rank": median_per_rank(
                    [r["peak_rss_mib_per_rank"] for r in runs]
                ),
                "redundant_compute_s_per_step_per_rank": _per_step_median(
                    runs, "redundant_compute_s_per_rank"
                ),
                "replica_sync_s_per_step_per_rank": _per_step_median(
                    runs, "replica_sync_s_per_rank"
                ),
                "num_extra_steps": facts["num_extra_steps"][mode],
                "param_sha256": sorted({r["param_sha256"] for r in runs}),
            }
        off = modes["off"]
        for mode in REDUNDANCY_MODES:
            m = modes[mode]
            m["step_time_ratio_to_off"] = m["step_time_s"] / off["step_time_s"]
            m["peak_rss_ratio_to_off_max_rank"] = max(m["peak_rss_mib_per_rank"]) / max(
                off["peak_rss_mib_per_rank"]
            )
            m["peak_rss_ratio_to_off_per_rank"] = [
                a / b
                for a, b in zip(
                    m["peak_rss_mib_per_rank"], off["peak_rss_mib_per_rank"], strict=True
                )
            ]
        report_cases.append(
            {
                "case": case.name,
                "stages": case.num_stages,
                "workers": case.num_workers,
                "micro_batches": case.num_micro_batches,
                "micro_batch_size": cfg.micro_batch_size,
                "hidden_fraction": facts["hidden_fraction"],
                "num_schedule_steps": facts["num_schedule_steps"],
                "eager_grid": facts["eager_grid"],
                "modes": modes,
            }
        )
    optional = ("redundant_compute_s_per_step_per_rank", "replica_sync_s_per_step_per_rank")
    missing = sorted(
        {f for c in report_cases for m in c["modes"].values() for f in optional if m[f] is None}
    )
    return {
        "bench": "redundancy",
        # Columns the training summaries did not report (shown as n/a).
        "missing_fields": missing,
        "model": cfg.spotline.model.name,
        "steps": settings.steps,
        "repeats": settings.repeats,
        "order": "per case, interleaved: off, lazy, eager per round",
        "statistic": (
            "median over rounds (per rank for memory and seconds); redundant compute and "
            "replica sync are seconds per step; hidden_fraction is the eager schedule's share "
            "of redundant forwards placed in bubbles (a bound on what can be hidden)"
        ),
        "cases": report_cases,
        "machine": machine_info(),
    }


def format_redundancy(report: dict[str, Any]) -> str:
    def per_rank(values: Sequence[float], fmt: str) -> str:
        return " / ".join(format(v, fmt) for v in values)

    rows = [
        "| case (SxM) | mode | step (ms) | vs off | peak RSS per rank (MiB) | RSS vs off (max rank) "
        "| redundant fwd (ms/step per rank) | replica sync (ms/step per rank) | hidden fraction | extra steps |",
        "|---|---|---:|---:|---|---:|---|---|---:|---:|",
    ]
    for case in report["cases"]:
        for mode, m in case["modes"].items():
            hidden = f"{case['hidden_fraction']:.2f}" if mode == "eager" else "-"
            redundant = m["redundant_compute_s_per_step_per_rank"]
            sync = m["replica_sync_s_per_step_per_rank"]
            ms_redundant = (
                "n/a" if redundant is None else per_rank([v * 1000 for v in redundant], ".1f")
            )
            ms_sync = "n/a" if sync is None else per_rank([v * 1000 for v in sync], ".1f")
            rows.append(
                f"| {case['case']} ({case['workers']} procs) | {mode} | {m['step_time_s'] * 1000:.1f} "
                f"| {m['step_time_ratio_to_off']:.3f} | {per_rank(m['peak_rss_mib_per_rank'], '.0f')} "
                f"| {m['peak_rss_ratio_to_off_max_rank']:.3f} | {ms_redundant} "
                f"| {ms_sync} | {hidden} | {m['num_extra_steps']} |"
            )
    head = (
        f"### redundancy: {report['model']}, one pipeline, one process per stage, "
        f"{report['steps']} steps, median of {report['repeats']} interleaved rounds"
    )
    lines = [head, "", *rows]
    if report["missing_fields"]:
        lines += [
            "",
            f"n/a: the training summaries did not report {', '.join(report['missing_fields'])}.",
        ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    """argparse that raises UserError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"bench: {message}; see spotline bench --help")


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


def bench_reduce(
    settings: BenchSettings, elements: int, ranks: int, logical_workers: int
) -> dict[str, Any]:
    """spotline.exact.exact_sum against a float all_reduce of the same gradients, side by
    side in one set of gloo processes (launch/reduce_worker.py)."""
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
                "spotline.launch.reduce_worker",
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
    return {"bench": "reduce", **measured, "machine": machine_info()}


def format_reduce(report: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"reduce: {report['elements']:,} elements, {report['logical_workers']} logical "
            f"workers on {report['ranks']} gloo processes, median of {report['repeats']}",
            "",
            "| reduction | ms | bytes per rank |",
            "|---|---:|---:|",
            f"| float sum + all_reduce | {report['plain_ms']:.2f} | {report['plain_bytes']:,} |",
            f"| exact (fixed point) | {report['exact_ms']:.2f} | {report['exact_bytes']:,} |",
            "",
            f"exact / float: {report['time_ratio']:.2f}x time, {report['bytes_ratio']:.2f}x bytes",
        ]
    )


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


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
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
    parser = _Parser(
        prog="spotline bench",
        description="side-by-side benchmarks of real training runs on this machine",
    )
    sub = parser.add_subparsers(
        dest="bench", required=True, metavar="{foundation,redundancy,recovery,reduce,easyscale}"
    )
    sub.add_parser(
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
        "reduce", parents=[common], help="exact fixed-point reduction vs a float all_reduce"
    )
    reduce.add_argument(
        "--elements", type=int, default=1_000_000, help="gradient elements (default 1,000,000)"
    )
    reduce.add_argument("--ranks", type=int, default=2, help="gloo processes (default 2)")
    reduce.add_argument(
        "--logical-workers", type=int, default=4, help="logical workers in all (default 4)"
    )
    easyscale = sub.add_parser(
        "easyscale",
        parents=[common],
        help="logical workers: step time vs stock data parallelism, reduction, rescale, memory",
    )
    easyscale.add_argument(
        "--workers", type=int, default=2, help="processes = logical workers (default 2)"
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    repeats = (
        args.repeats
        if args.repeats is not None
        else (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    )
    if steps < 1:
        raise UserError(f"--steps {steps}: use at least 1 step")
    if repeats < 1:
        raise UserError(f"--repeats {repeats}: use at least 1 round")
    return BenchSettings(steps=steps, repeats=repeats, output=Path(args.output), config=args.config)


def fail(message: str) -> int:
    print(f"spotline: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def run_guarded(
    name: str,
    parser: argparse.ArgumentParser,
    argv: list[str],
    work: Callable[[argparse.Namespace], int],
) -> int:
    """Parse ``argv`` and run ``work``: exit 2 with one line for a user mistake (in the
    arguments or in a job they started), 1 when a measured job failed."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except UserError as exc:
        return fail(str(exc))
    try:
        return work(args)
    except UserError as exc:
        return fail(str(exc))
    except RunFailed as exc:
        if exc.exit_code == EXIT_USAGE:
            return fail(str(exc))
        print(f"spotline: {name} failed: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark; 0 on success, 2 on bad input, 1 when a benchmarked job failed."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def work(args: argparse.Namespace) -> int:
        from spotline.tracking import write_json_atomic

        settings = settings_from_args(args)
        if args.bench == "foundation":
            report = bench_foundation(settings)
            table = format_foundation(report)
        elif args.bench == "recovery":
            report = bench_recovery(settings, args.trace, args.time_scale, args.max_workers)
            table = format_recovery(report)
        elif args.bench == "easyscale":
            from spotline.launch.bench_easyscale import bench_easyscale, format_easyscale

            report = bench_easyscale(settings, args.workers)
            table = format_easyscale(report)
        elif args.bench == "reduce":
            report = bench_reduce(settings, args.elements, args.ranks, args.logical_workers)
            table = format_reduce(report)
        else:
            report = bench_redundancy(settings, parse_cases(args.cases))
            table = format_redundancy(report)
        report["command"] = ["spotline", "bench", *argv]
        path = settings.output / f"bench-{report['bench']}.json"
        write_json_atomic(path, report)
        print(table)
        print(f"\nresults: {path}", flush=True)
        return 0

    return run_guarded("bench", build_parser(), argv, work)


if __name__ == "__main__":
    sys.exit(main())
