"""Rounds whose jobs take turns on the host: ``spotline bench redundancy|foundation --alternate SECONDS``.

Why: a shared host drifts over tens of seconds (neighbours, frequency, the page cache), and
that drift is wider than a 2% effect. Jobs run one after another see different hosts;
longer runs do not help, the drift only averages out over longer spans. Here every mode's
job of a round starts at once, and once each is past its start-up they take turns: one runs
for ``turn_s`` seconds while every process of the others is stopped (SIGSTOP on the whole
process tree: coordinator, agent, workers), then the next. Each mode then sees the same
host, seconds apart.

A step counts only if it ran inside one of its own job's turns, from its start to its end
(``summary.json``'s ``step_times_s`` and ``step_ended_at_s``): a step a stop cut through,
and every step of the start-up, when the jobs shared the cores, is left out.

What a stop costs a job: its own clocks run on, so its coordinator sees heartbeats as old as
the pause. The runs' heartbeat timeout is raised above it (the beat's interval, and the
step, do not depend on it), and the pause is kept under what the local agent allows a
silent store (:data:`MAX_PAUSE_S`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotline.errors import UserError
from spotline.launch.bench.jobs import (
    RunFailed,
    finish_spotline_train,
    median,
    progress,
    start_spotline_train,
)

MAX_PAUSE_S = 8.0
"""The longest a job may stay stopped: a store operation the local agent had under way when
it was stopped expires on its own clock, and after 10 s without an answer the agent takes
the coordinator for lost (``coordinator.LOCAL_AGENT_LOST_AFTER_S``)."""

READY_MARK = b"spotline: step "
"""A job is past its start-up once it printed a progress line (a ``spotline train``
coordinator, or rank 0 of the stock baseline): steps were committed, so its set-up (gloo
operations with a short timeout, which a stop would expire) is behind it."""

MIN_STEPS_IN_TURNS = 3
"""The fewest steps inside its turns a variant's alternated run may give: a median of fewer
says little."""


@dataclass(frozen=True)
class Turn:
    """``job`` ran alone from ``start`` to ``end`` (Unix time): by ``start`` every process of
    the other jobs was seen stopped, and its own stop was sent after ``end``."""

    job: str
    start: float
    end: float


def check_alternation(turn_s: float, num_jobs: int, jobs: str = "modes") -> None:
    """Raise UserError unless ``num_jobs`` jobs (a round's ``jobs``: the redundancy bench's
    ``--modes``, or the foundation's three variants) can take turns of ``turn_s`` seconds."""
    if not turn_s > 0:
        raise UserError(f"--alternate {turn_s:g}: give a turn of more than 0 seconds, e.g. 4")
    pause_s = (num_jobs - 1) * turn_s
    if pause_s > MAX_PAUSE_S:
        fewer = ", or fewer --modes" if jobs == "modes" else ""
        raise UserError(
            f"--alternate {turn_s:g} with {num_jobs} {jobs} stops each job {pause_s:g} s at a "
            f"time, over the {MAX_PAUSE_S:g} s a job may stay stopped; use --alternate "
            f"{MAX_PAUSE_S / (num_jobs - 1):g} or less{fewer}"
        )


def heartbeat_timeout_for(turn_s: float, num_jobs: int, configured_s: float) -> float:
    """The heartbeat timeout of an alternated run: well above its pauses, never lowered."""
    return max(configured_s, 4 * (num_jobs - 1) * turn_s)


def alternation_overrides(turn_s: float, num_jobs: int, configured_s: float) -> dict[str, Any]:
    """The config overrides a ``spotline train`` job needs to take turns with
    ``num_jobs - 1`` others (``configured_s``: its heartbeat timeout as configured)."""
    return {
        # Its progress lines say a job is past its start-up (READY_MARK).
        "spotline.tracking.progress": True,
        "spotline.recovery.heartbeat_timeout_s": heartbeat_timeout_for(
            turn_s, num_jobs, configured_s
        ),
    }


def steps_in_turns(
    step_times: Sequence[float | None],
    step_ends: Sequence[float | None],
    turns: Sequence[Turn],
) -> list[int]:
    """The steps (by index) that ran inside one of ``turns``, from start to end; a step
    without a time or an end (never reported) is left out."""
    inside = []
    for step, (seconds, end) in enumerate(zip(step_times, step_ends, strict=True)):
        if seconds is None or end is None:
            continue
        start = end - seconds
        if any(t.start <= start and end <= t.end for t in turns):
            inside.append(step)
    return inside


# ------------------------------------------------------------------------ process trees


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from the state on (None: the process is gone). The command name
    in parentheses may hold spaces: split after its closing one."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2 :].split()


def process_tree(root: int) -> list[int]:
    """``root`` and every live process below it (a parent before its children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def signal_tree(root: int, sig: signal.Signals) -> list[int]:
    """Send ``sig`` to ``root``'s tree; returns the processes it was sent to."""
    pids = process_tree(root)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass  # exited between the listing and the signal
    return pids


def wait_stopped(pids: Sequence[int], timeout_s: float = 10.0) -> None:
    """Wait until every one of ``pids`` is stopped (or gone): a stop is delivered when the
    process next runs, not when ``kill`` returns."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while True:
            fields = _stat_fields(pid)
            if fields is None or fields[0] in ("T", "t", "Z", "X"):
                break
            assert time.monotonic() < deadline, f"process {pid} did not stop in {timeout_s} s"
            time.sleep(0.001)


# ------------------------------------------------------------------------ taking turns


@dataclass(frozen=True)
class AlternatedJob:
    """A job started by the caller: its root process and how to tell it is past start-up."""

    name: str
    proc: subprocess.Popen[bytes]
    ready: Callable[[], bool]


def log_ready(log: Path) -> Callable[[], bool]:
    """A ``ready`` for a ``spotline train`` job logging to ``log`` (see :data:`READY_MARK`)."""

    def ready() -> bool:
        try:
            return READY_MARK in log.read_bytes()
        except FileNotFoundError:
            return False

    return ready


HOLD_S = MAX_PAUSE_S / 2
"""How long a job past its start-up is held stopped at a time while another is still
starting, before a :data:`SLICE_S` of running."""

SLICE_S = 0.5
"""How long a held job runs between holds, and every job together before the turns: long
enough for what its agent asked its coordinator before the stop to be answered, so that no
later pause adds to that question's wait."""


def _hold_until_ready(jobs: Sequence[AlternatedJob], poll_s: float) -> bool:
    """Wait until every job is ready, holding those ready early (see :func:`take_turns`);
    False when a job exited first. The held jobs are left stopped or running."""
    # job index -> (stopped?, since when): the ready jobs, held or in a slice.
    held: dict[int, tuple[bool, float]] = {}
    while True:
        # A job once ready stays so: its log is read only until it is.
        ready = [index in held or job.ready() for index, job in enumerate(jobs)]
        if all(ready):
            return True
        if any(job.proc.poll() is not None for job in jobs):
            return False
        now = time.monotonic()
        for index, job in enumerate(jobs):
            if not ready[index]:
                continue
            stopped, since = held.get(index, (False, now))
            if not stopped and (index not in held or now - since >= SLICE_S):
                wait_stopped(signal_tree(job.proc.pid, signal.SIGSTOP))
                held[index] = (True, time.monotonic())
            elif stopped and now - since >= HOLD_S:
                signal_tree(job.proc.pid, signal.SIGCONT)
                held[index] = (False, now)
        time.sleep(poll_s)


def take_turns(
    jobs: Sequence[AlternatedJob], turn_s: float, poll_s: float = 0.02
) -> dict[str, list[Turn]]:
    """Run ``jobs`` in turns of ``turn_s`` seconds, in their order, from the moment every
    one is past its start-up until one of them exits (then the others run on together, to
    their end). Returns each job's turns. Every job is running again when this returns,
    also on an error.

    Jobs start at different speeds (the stock baseline's bare ranks are ready well before a
    ``spotline train`` job's coordinator, agent and workers): one ready early is held
    stopped, with a short run every :data:`HOLD_S` (a pause may not exceed
    :data:`MAX_PAUSE_S`), so that it does not spend its steps while the others start."""
    turns: dict[str, list[Turn]] = {job.name: [] for job in jobs}

    try:
        if not _hold_until_ready(jobs, poll_s):
            return turns  # one ended (or failed) in its start-up: no turns to take
        for job in jobs:
            signal_tree(job.proc.pid, signal.SIGCONT)
        time.sleep(SLICE_S)
        for job in jobs[1:]:
            wait_stopped(signal_tree(job.proc.pid, signal.SIGSTOP))
        current = 0
        while True:
            job = jobs[current]
            signal_tree(job.proc.pid, signal.SIGCONT)
            start = time.time()
            deadline = time.monotonic() + turn_s
            while time.monotonic() < deadline and job.proc.poll() is None:
                time.sleep(poll_s)
            turns[job.name].append(Turn(job.name, start, time.time()))
            if job.proc.poll() is not None:
                return turns  # its steps ended before it exited: that turn counts too
            wait_stopped(signal_tree(job.proc.pid, signal.SIGSTOP))
            current = (current + 1) % len(jobs)
    finally:
        for job in jobs:
            if job.proc.poll() is None:
                signal_tree(job.proc.pid, signal.SIGCONT)


# ------------------------------------------------------------------------ rounds


@dataclass(frozen=True)
class Launcher:
    """How one variant's job runs in a round: ``start`` it in its run folder, tell when it is
    ``ready`` (past start-up), ``finish`` it (wait; its result, with ``step_times_s`` and
    ``step_ended_at_s``, the time and the end of each step; raises RunFailed)."""

    start: Callable[[Path], subprocess.Popen[bytes]]
    ready: Callable[[Path], Callable[[], bool]]
    finish: Callable[[subprocess.Popen[bytes], Path], dict[str, Any]]


def spotline_launcher(
    config: Path,
    flags: Sequence[str],
    env_for: Callable[[Path], dict[str, str]] = lambda run_dir: {},
) -> Launcher:
    """A ``spotline train`` job with ``flags`` on ``config`` (and ``env_for(run_dir)`` added
    to its environment), ready once its coordinator printed a progress line."""
    return Launcher(
        start=lambda run_dir: start_spotline_train(config, run_dir, flags, env_for(run_dir)),
        ready=lambda run_dir: log_ready(run_dir / "bench.log"),
        finish=finish_spotline_train,
    )


def run_alternated_rounds(
    launchers: dict[str, Launcher],
    repeats: int,
    work: Path,
    turn_s: float,
    label: str,
    samples_per_step: int,
) -> dict[str, list[dict[str, Any]]]:
    """``repeats`` rounds, each starting every variant's job at once (in
    ``work/<variant>-r<round>``) and running them in turns of ``turn_s`` seconds; a result's
    ``step_time_s`` is the median of its steps inside its turns (and ``samples_per_s`` is
    ``samples_per_step`` over it). ``wall_s`` and ``process_s`` include the pauses."""
    variants = list(launchers)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for round_idx in range(repeats):
        t0 = time.perf_counter()
        started: list[tuple[str, Path, subprocess.Popen[bytes]]] = []
        try:
            for variant in variants:
                run_dir = work / f"{variant}-r{round_idx}"
                started.append((variant, run_dir, launchers[variant].start(run_dir)))
            jobs = [AlternatedJob(v, proc, launchers[v].ready(d)) for v, d, proc in started]
            # Each round another variant takes the first turn: none is always the one that
            # runs right after the start-ups.
            first = round_idx % len(jobs)
            turns = take_turns(jobs[first:] + jobs[:first], turn_s)
            finished = {v: launchers[v].finish(proc, d) for v, d, proc in started}
        finally:
            for _, _, proc in started:
                if proc.poll() is None:  # another job failed, or Ctrl-C
                    proc.terminate()
                    proc.wait()
        process_s = time.perf_counter() - t0
        for variant, result in finished.items():
            inside = steps_in_turns(
                result["step_times_s"], result["step_ended_at_s"], turns[variant]
            )
            if len(inside) < MIN_STEPS_IN_TURNS:
                raise RunFailed(
                    f"--alternate: {variant}'s run (round {round_idx + 1}) ran {len(inside)} "
                    f"step(s) inside its turns, fewer than {MIN_STEPS_IN_TURNS}; give more "
                    "--steps",
                    2,
                )
            step_s = median([result["step_times_s"][s] for s in inside])
            result.update(
                step_time_s=step_s,
                samples_per_s=samples_per_step / step_s,
                process_s=process_s,
                steps_in_turns=len(inside),
                turns=[[turn.start, turn.end] for turn in turns[variant]],
            )
            results[variant].append(result)
        progress(
            f"{label} round {round_idx + 1}/{repeats} ({process_s:.1f} s): "
            + ", ".join(
                f"{v} {results[v][-1]['step_time_s'] * 1000:.1f} ms over "
                f"{results[v][-1]['steps_in_turns']} steps in {len(results[v][-1]['turns'])} turns"
                for v in variants
            )
        )
    return results
