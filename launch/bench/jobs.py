"""Running measured jobs: what every benchmark and ``spotline calibrate`` share.

The run settings (:class:`BenchSettings`), the base config with a job's overrides, jobs
started as subprocesses (``spotline train`` with :func:`run_spotline_train`, a gloo group of
rank workers with :func:`run_rank_module`), interleaved rounds and their medians, the
machine's description, and :func:`run_guarded`, which turns a user mistake into one line and
exit code 2 and a failed job into exit code 1. Imports only the standard library and
``spotline.errors`` at module level (config and tracking are imported when used), and no
benchmark module: every benchmark imports this one, never another benchmark's helpers.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from spotline.errors import UserError
from spotline.run_dir import earlier_run_outputs

EXIT_USAGE = 2


@dataclass(frozen=True)
class BenchSettings:
    """What every subcommand shares: run length, rounds, where results go, the base config."""

    steps: int
    repeats: int
    output: Path
    config: str | None
    # A model of the ladder (its sequence length and micro-batch size come with it: see
    # spotline.launch.bench.ladder) or any preset or save_pretrained directory; None: the
    # config's model.
    model: str | None = None


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


def spread(values: Sequence[float]) -> dict[str, float]:
    """Min, median and max of one figure over rounds: what a ratio's noise looks like; and
    where the median lies (:func:`median_interval`)."""
    assert values, "a spread of no rounds"
    low, high, level = median_interval(values)
    return {
        "min": min(values),
        "median": median(values),
        "max": max(values),
        "median_low": low,
        "median_high": high,
        "median_level": level,
    }


MEDIAN_LEVEL = 0.9
"""The confidence asked of :func:`median_interval` (given when the rounds allow it)."""


def median_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of the rounds' distribution,
    from order statistics: ``[x(k), x(n+1-k)]`` of the ``n`` sorted values covers the median
    with probability ``1 - 2 P(B < k)``, ``B ~ Binomial(n, 1/2)`` (each round falls below the
    median with probability 1/2, whatever the noise's shape). The narrowest such interval of
    at least MEDIAN_LEVEL, or ``[min, max]`` when the rounds are too few for it; returns its
    ends and its exact level. A round's ratio moves with the host (the min-max spread never
    narrows), but this interval narrows with more rounds: it says what the median claims."""
    ordered = sorted(values)
    n = len(ordered)
    below = [math.comb(n, i) / 2**n for i in range(n + 1)]
    k = 1
    while k + 1 <= n + 1 - (k + 1) and 1 - 2 * sum(below[: k + 1]) >= MEDIAN_LEVEL:
        k += 1
    return ordered[k - 1], ordered[n - k], 1 - 2 * sum(below[:k])


def round_ratios(
    results: dict[str, list[dict[str, Any]]], num: str, den: str, key: str = "step_time_s"
) -> list[float]:
    """``key`` of variant ``num`` over variant ``den``, round by round.

    Interleaved rounds pair up: round i of both ran back to back, under the same load, so
    the ratio of a pair cancels most of the machine's drift that a ratio of medians keeps.
    """
    return [a[key] / b[key] for a, b in zip(results[num], results[den], strict=True)]


def format_spread(s: dict[str, float], fmt: str = ".3f") -> str:
    """``1.021 (1.004-1.050)``: the median, then the min and max over rounds."""
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def format_median_interval(s: dict[str, float], fmt: str = ".3f") -> str:
    """``1.010-1.030 at 93%``: where the median lies (:func:`median_interval`)."""
    return f"{s['median_low']:{fmt}}-{s['median_high']:{fmt}} at {s['median_level']:.0%}"


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
    from spotline.launch.bench.ladder import model_overrides

    return with_overrides(
        load_config(settings.config),
        {
            "spotline.training.steps": settings.steps,
            "spotline.tracking.wandb": "disabled",
            "spotline.tracking.progress": False,
            **(model_overrides(settings.model) if settings.model else {}),
            **overrides,
        },
    )


def write_config(cfg: Any, path: Path) -> Path:
    from spotline.atomic_files import write_json_atomic

    write_json_atomic(path, cfg.to_json())
    return path


def _error_line(log_text: str) -> str | None:
    for line in log_text.splitlines():
        if line.startswith("spotline: error: "):
            return line.removeprefix("spotline: error: ")
    return None


# --------------------------------------------------------------------------- running jobs


def _train_command(config: Path, run_dir: Path, extra_flags: Sequence[str]) -> list[str]:
    return [
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


def clear_earlier_run(run_dir: Path) -> None:
    """Remove what an earlier invocation's run left in ``run_dir``, a bench's own scratch
    folder (``spotline train`` refuses a directory holding an earlier run's output)."""
    for name in earlier_run_outputs(run_dir):
        path = run_dir / name.rstrip("/")
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def start_spotline_train(
    config: Path,
    run_dir: Path,
    extra_flags: Sequence[str],
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``spotline train`` started as a subprocess, its output to ``run_dir/bench.log``;
    :func:`finish_spotline_train` waits for it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    clear_earlier_run(run_dir)
    with open(run_dir / "bench.log", "wb") as log:
        return subprocess.Popen(
            _train_command(config, run_dir, extra_flags),
            env={**child_env(), **(extra_env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def finish_spotline_train(proc: subprocess.Popen[bytes], run_dir: Path) -> dict[str, Any]:
    """Wait for a job :func:`start_spotline_train` started; returns its summary.json.

    Raises RunFailed: exit 2 with the job's one-line error (a user mistake), exit 1
    otherwise.
    """
    import json

    code = proc.wait()
    log_path = run_dir / "bench.log"
    if code != 0:
        message = _error_line(log_path.read_text(errors="replace"))
        if code == EXIT_USAGE and message is not None:
            raise RunFailed(message, EXIT_USAGE)
        raise RunFailed(f"spotline train exited {code}; see {log_path} and {run_dir}/logs", 1)
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return with_per_rank_lists(summary)


def run_spotline_train(
    config: Path,
    run_dir: Path,
    extra_flags: Sequence[str],
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``spotline train`` as a subprocess (its own workers), to its end; returns its
    summary.json (see :func:`finish_spotline_train`)."""
    proc = start_spotline_train(config, run_dir, extra_flags, extra_env)
    try:
        return finish_spotline_train(proc, run_dir)
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): the job goes too
            proc.terminate()
            proc.wait()


def worker_id_order(worker_id: str) -> tuple[int, str]:
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
                float(by_worker[k]) for k in sorted(by_worker, key=worker_id_order)
            ]
        else:
            out[f"{name}_per_rank"] = [float(v) for v in by_worker]
    return out


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of one stock rank: what ``spotline train`` gives its workers.

    Every one of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK is needed: with one
    missing DeepSpeed falls back to MPI discovery (``deepspeed.init_distributed``).
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
    module: str,
    args: Sequence[str],
    num_ranks: int,
    run_dir: Path,
    label: str,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``num_ranks`` ranks of ``python -m module *args --output run_dir/result.json`` on one
    gloo group; returns the JSON rank 0 writes there.

    Each rank's output goes to ``run_dir/logs/worker-<rank>.log``. Raises RunFailed
    (exit 1, naming ``label``) when a rank fails.
    """
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
                        env={**rank_env(rank, num_ranks, port), **(extra_env or {})},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        codes = wait_ranks(procs)
    except BaseException:
        stop(procs)
        raise
    return rank_result(
        run_dir,
        all(c == 0 for c in codes),
        f"{label} ranks exited {codes}; see {logs_dir}/worker-*.log",
    )


def rank_result(run_dir: Path, succeeded: bool, failure: str) -> dict[str, Any]:
    """The JSON rank 0 wrote in ``run_dir`` (``result.json``); RunFailed (exit 1, with the
    ``failure`` message) when the ranks did not all succeed or it is missing."""
    import json

    result_path = run_dir / "result.json"
    if not succeeded or not result_path.exists():
        raise RunFailed(failure, 1)
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


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


def fail(message: str) -> int:
    print(f"spotline: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """A SIGTERM handler: leave as Ctrl-C would, through every ``finally`` (exit 143)."""
    raise SystemExit(128 + signum)


def run_guarded(
    name: str,
    parser: argparse.ArgumentParser,
    argv: list[str],
    work: Callable[[argparse.Namespace], int],
) -> int:
    """Parse ``argv`` and run ``work``: exit 2 with one line for a user mistake (in the
    arguments or in a job they started), 1 when a measured job failed.

    A SIGTERM ends ``work`` as Ctrl-C does, through its clean-ups: the jobs it started are
    continued (``--alternate`` may have stopped them) and stopped. Python's default would
    end this process alone and leave them running, or stopped, behind it."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except UserError as exc:
        return fail(str(exc))
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        return work(args)
    except UserError as exc:
        return fail(str(exc))
    except RunFailed as exc:
        if exc.exit_code == EXIT_USAGE:
            return fail(str(exc))
        print(f"spotline: {name} failed: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        signal.signal(signal.SIGTERM, previous)
