"""``spotline bench redundancy --alternate``: a round's modes run at once, taking turns.

The pure parts without processes (which steps count, which turns are allowed); then one
real round of two ``spotline train`` jobs whose whole process trees are stopped and
continued (SIGSTOP, SIGCONT) every 2.5 s, checked for what it must show: the jobs really
stood still outside their turns, every pause was survived without a recovery (a receive
waiting across a pause used to time out: ``spotline.group_setup.wait_p2p``), both modes
end on the same parameters, and the step time comes from steps inside the turns. The same
round profiles its instructions (``--profile``): lazy's CPU by instruction against off's.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from conftest import run_spotline

from spotline.errors import UserError
from spotline.launch.bench.alternate import (
    MAX_PAUSE_S,
    Turn,
    check_alternation,
    heartbeat_timeout_for,
    steps_in_turns,
)


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
