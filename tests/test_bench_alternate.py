"""``spotline bench redundancy|foundation --alternate``: a round's jobs run at once, taking turns.

The pure parts without processes (which steps count, which turns are allowed); then one
real round of two ``spotline train`` jobs whose whole process trees are stopped and
continued (SIGSTOP, SIGCONT) every 2.5 s, checked for what it must show: the jobs really
stood still outside their turns, every pause was survived without a recovery (a receive
waiting across a pause used to time out: ``spotline.pipeline.group_setup.wait_p2p``), both modes
end on the same parameters, and the step time comes from steps inside the turns. The same
round profiles its instructions (``--profile``): lazy's CPU by instruction against off's.

The foundation's round adds the stock baseline, whose ranks have no coordinator: they run
under one root (``rank_group``), which must pass a stop to all of them and take them down
with it. One real round of the three jobs checks the same, on stand-in ranks first.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, run_spotline

from spotline.errors import UserError
from spotline.launch.bench.alternate import (
    MAX_PAUSE_S,
    Turn,
    check_alternation,
    heartbeat_timeout_for,
    process_tree,
    steps_in_turns,
)
from spotline.launch.bench.jobs import RunFailed
from spotline.launch.bench.rank_group import finish_rank_group, start_rank_group


def test_a_step_counts_only_inside_one_turn_from_start_to_end() -> None:
    turns = [Turn("off", 10.0, 14.0), Turn("off", 20.0, 24.0)]
    # (seconds, end) per step: inside, starting at a turn's start, straddling a turn's end,
    # between turns, across a whole pause, never reported, ending at a turn's end.
    times = [1.0, 1.0, 1.0, 1.0, 8.0, None, 2.0]
    ends = [12.0, 21.0, 14.5, 17.0, 22.0, 23.0, 24.0]
    assert steps_in_turns(times, ends, turns) == [0, 1, 6]
    assert steps_in_turns(times, ends, []) == []
    with pytest.raises(ValueError):
        steps_in_turns([1.0], [], turns)  # a time without an end is a broken summary


def test_turns_must_keep_every_pause_short() -> None:
    check_alternation(4.0, 2)
    check_alternation(MAX_PAUSE_S / 3, 4)
    with pytest.raises(UserError, match=r"--alternate 2\.66667 or less, or fewer --modes"):
        check_alternation(3.0, 4)
    # The foundation's three variants are not --modes: no fewer to choose.
    with pytest.raises(UserError, match=r"with 3 variants stops each job 10 s .* 4 or less$"):
        check_alternation(5.0, 3, "variants")
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(UserError, match="more than 0 seconds"):
            check_alternation(bad, 2)
    # Above every pause, never below what the config asked.
    assert heartbeat_timeout_for(2.5, 2, 5.0) == 10.0
    assert heartbeat_timeout_for(2.5, 2, 60.0) == 60.0


@pytest.fixture(scope="module")
def alternated(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    out = tmp_path_factory.mktemp("alternate")
    argv = ["bench", "redundancy", "--cases", "2x2", "--modes", "lazy", "--alternate", "2.5"]
    proc = run_spotline(
        [*argv, "--profile", "--steps", "200", "--repeats", "1", "--output", str(out)],
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "bench-redundancy.json").read_text()), out, proc.stdout


def _summary(out: Path, mode: str) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads(
        (out / "redundancy" / "2x2" / f"{mode}-r0" / "summary.json").read_text()
    )
    return summary


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_jobs_take_turns_survive_their_pauses_and_agree(
    alternated: tuple[dict[str, Any], Path, str],
) -> None:
    report, out, _ = alternated
    assert report["alternate_s"] == 2.5
    [case] = report["cases"]
    modes = case["modes"]
    assert sorted(modes) == ["lazy", "off"]
    summaries = {mode: _summary(out, mode) for mode in modes}
    turns = {mode: [Turn(mode, a, b) for a, b in modes[mode]["turns"][0]] for mode in modes}
    # Off went first and each job was stopped at least once while the other ran.
    assert len(turns["off"]) >= 2 and len(turns["lazy"]) >= 1
    for mode, other in (("off", "lazy"), ("lazy", "off")):
        s = summaries[mode]
        # Not one step of a job ended during the other's turns: it stood still.
        for t in turns[other]:
            assert not any(e is not None and t.start < e < t.end for e in s["step_ended_at_s"])
        # Every pause survived: one generation, nothing recovered, every step reported.
        assert (s["generations"], s["recoveries"], s["preemptions"]) == (1, 0, 0)
        assert None not in s["step_times_s"] and None not in s["step_ended_at_s"]
        inside = steps_in_turns(s["step_times_s"], s["step_ended_at_s"], turns[mode])
        # Timed on the steps inside its turns: some, and not every step (the start-up's
        # and those a stop cut through are left out).
        assert modes[mode]["steps_in_turns"] == [len(inside)]
        assert 3 <= len(inside) < s["steps"]
        assert modes[mode]["step_time_s"] == statistics.median(s["step_times_s"][i] for i in inside)
    # Redundancy never changes the math, paused or not.
    assert summaries["off"]["param_sha256"] == summaries["lazy"]["param_sha256"]
    assert modes["lazy"]["spread_to_off"]["min"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_round_profiles_where_lazys_cpu_goes(
    alternated: tuple[dict[str, Any], Path, str],
) -> None:
    """Each rank of each run wrote its profile, and lazy's CPU is paired with off's by
    instruction: its replica step, which off never runs, is lazy's own work, on the
    schedule's thread."""
    report, out, stdout = alternated
    modes = report["cases"][0]["modes"]
    for mode in modes:
        profiles = sorted((out / "redundancy" / "2x2" / f"{mode}-r0" / "instructions").iterdir())
        assert [p.name for p in profiles] == ["w0.json", "w1.json"]
    assert "cpu_vs_off_per_rank" not in modes["off"]
    ranks = modes["lazy"]["cpu_vs_off_per_rank"]
    assert len(ranks) == 2
    for rank in ranks:
        replica_step = rank["ReplicaStep"]
        assert replica_step["baseline_s"] == [0.0, 0.0] and replica_step["variant_s"][0] > 0
        assert replica_step["difference_s"][0]["median"] == replica_step["variant_s"][0]
        # Both ran the schedule's common instructions; the whole step is counted too.
        for name in ("ForwardPass", "BackwardPass", "step"):
            assert rank[name]["baseline_s"][0] > 0 and rank[name]["variant_s"][0] > 0
    assert "CPU per step by instruction, 2x2, lazy against off" in stdout
    assert "| 1 | the whole step |" in stdout
    # The wall-clock counters, which hold the pauses, are not shown as figures.
    [lazy_row] = [
        line for line in stdout.splitlines() if line.startswith("| 2x2 (2 procs) | lazy |")
    ]
    assert lazy_row.split(" | ").count("paused") == 2


# ------------------------------------------------------------------------ rank groups


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_rank_group_is_one_tree_that_takes_its_ranks_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stand-in ranks (tests/workers/agent_child.py): a terminated root leaves no rank
    behind (the bench's clean-up, Ctrl-C), and a failed rank is one RunFailed naming the
    logs."""
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests" / "workers"))
    proc = start_rank_group("agent_child", ["sleep"], 2, tmp_path / "sleep")
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(process_tree(proc.pid)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        ranks = process_tree(proc.pid)[1:]
        proc.terminate()
        assert proc.wait(timeout=30) != 0
        assert not any(_alive(pid) for pid in ranks), "a rank outlived its group's root"
    finally:
        for pid in [proc.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    failing = start_rank_group("agent_child", ["exit", "3"], 2, tmp_path / "exit")
    with pytest.raises(RunFailed, match=r"stand-in exited 1; see .*exit/bench\.log") as err:
        finish_rank_group(failing, tmp_path / "exit", "stand-in")
    assert err.value.exit_code == 1
    assert "ranks exited [3, 3]" in (tmp_path / "exit" / "bench.log").read_text()


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat[stat.rindex(")") + 2]


def test_a_terminated_bench_leaves_no_job_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM to a bench whose jobs take turns (tests/workers/alternating_bench.py: two
    rank groups of stand-in ranks that never end): it leaves through its clean-ups, as on
    Ctrl-C, so no process it started is left running, or stopped, behind it."""
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests" / "workers"))
    bench = subprocess.Popen(
        [sys.executable, "-m", "alternating_bench", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 60
        # Both groups up (the bench, 2 roots, 4 ranks), one of them stopped for the other.
        while len(tree) < 7 or "T" not in [_state(pid) for pid in tree]:
            assert bench.poll() is None and time.monotonic() < deadline, bench.returncode
            time.sleep(0.05)
            tree = process_tree(bench.pid)
        bench.terminate()
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while any(_alive(pid) and _state(pid) != "Z" for pid in tree[1:]):
            left = {pid: _state(pid) for pid in tree[1:] if _alive(pid)}
            assert time.monotonic() < deadline, f"left behind (pid: state): {left}"
            time.sleep(0.05)
    finally:
        for pid in [bench.pid, *tree]:
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        bench.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_foundations_three_jobs_take_turns(tmp_path: Path) -> None:
    """Spotline (lazy), redundancy off and the stock ranks in one round of 2.5 s turns:
    none ends a step in another's turn (the stock group stood still as one), each is timed
    on its own turns' steps, and both Spotline jobs end on the same parameters. The round
    profiles every rank (``--profile``, the stock ranks too, through their group's root),
    and pairs each Spotline job's CPU and idle cores with stock's, over its own turns."""
    out = tmp_path / "bench"
    argv = ["bench", "foundation", "--alternate", "2.5", "--steps", "60", "--repeats", "1"]
    proc = run_spotline([*argv, "--profile", "--output", str(out)], timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "bench-foundation.json").read_text())
    assert report["alternate_s"] == 2.5
    assert "median of 1 rounds taking turns of 2.5 s (steps inside the turns)" in proc.stdout
    work = out / "foundation"
    results = {
        "spotline": json.loads((work / "spotline-r0" / "summary.json").read_text()),
        "spotline-off": json.loads((work / "spotline-off-r0" / "summary.json").read_text()),
        "stock": json.loads((work / "stock-r0" / "result.json").read_text()),
    }
    variants = report["variants"]
    turns = {v: [Turn(v, a, b) for a, b in variants[v]["runs"][0]["turns"]] for v in results}
    for variant, result in results.items():
        for other in results.keys() - {variant}:
            for t in turns[other]:
                ends = result["step_ended_at_s"]
                assert not any(t.start < e < t.end for e in ends), (variant, other)
        inside = steps_in_turns(result["step_times_s"], result["step_ended_at_s"], turns[variant])
        assert variants[variant]["runs"][0]["steps_in_turns"] == len(inside)
        assert 3 <= len(inside) < 60
        assert variants[variant]["step_time_s"] == statistics.median(
            result["step_times_s"][i] for i in inside
        )
    assert results["spotline"]["param_sha256"] == results["spotline-off"]["param_sha256"]
    assert (results["spotline"]["generations"], results["spotline"]["recoveries"]) == (1, 0)

    _check_foundation_profile(report, work, turns, proc.stdout)


def _check_foundation_profile(
    report: dict[str, Any], work: Path, turns: dict[str, list[Turn]], stdout: str
) -> None:
    from spotline.launch.bench.instruction_timeline import ALL_WAITS

    for variant in ("spotline", "spotline-off", "stock"):
        assert len(list((work / f"{variant}-r0" / "instructions").glob("*.json"))) == 4
        [run] = report["variants"][variant]["runs"]
        # Each job is charged for idle cores inside its own turns only: never more time
        # than its turns held, and every step of its window counted.
        assert len(run["cpu_per_step_per_rank"]) == 4
        assert 0 < run["idle_window_s"] <= sum(t.end - t.start for t in turns[variant])
        assert run["idle_by_wait_s_per_step"], variant
    paired = report["profile_against_stock"]["against_stock"]
    assert sorted(paired) == ["spotline", "spotline-off"]
    # Every variant's stages met in their reduction at steps inside its turns: 2 stages, each
    # of two data-parallel ranks, a figure per stage and step.
    skews = report["profile_against_stock"]["reduction_skew_s"]
    for variant in ("spotline", "spotline-off", "stock"):
        assert skews[variant]["count"] >= 2 and skews[variant]["p90"] >= skews[variant]["median"]
    assert "How far apart a stage's data-parallel ranks reach the gradient reduction" in stdout
    for variant, figures in paired.items():
        ranks = figures["cpu_per_rank"]
        assert len(ranks) == 4
        for rank in ranks:
            # Both engines ran forward and backward passes; the logical workers' gradients
            # are kept by Spotline only.
            for name in ("ForwardPass", "BackwardPass", "step"):
                assert rank[name]["baseline_s"][0] > 0 and rank[name]["variant_s"][0] > 0
        assert any(r["KeepLogicalGradients"]["baseline_s"] == [0.0, 0.0] for r in ranks)
        idle = figures["idle_by_wait"]
        assert idle[ALL_WAITS]["variant_s"] > 0 and idle[ALL_WAITS]["baseline_s"] > 0
        assert f"{variant} against stock, paired by round: idle core time" in stdout
    assert "| waiting in | stock | spotline-off | spotline-off - stock" in stdout
