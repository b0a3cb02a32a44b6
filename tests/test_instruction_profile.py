"""spotline.pipeline.instruction_profile: every instruction an engine dispatches is timed on that
engine alone, and the figures reach the folder the environment names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotline.launch.bench.instruction_timeline import (
    cpu_split_per_step,
    format_paired_cpu,
    paired_cpu,
    read_profiles,
)
from spotline.launch.bench.profile import format_profile, mean_per_step, summarize
from spotline.pipeline.instruction_profile import (
    PROFILE_ENV,
    WHOLE_STEP,
    InstructionProfile,
    instrument,
    profile_dir,
    write_profile,
)


class ForwardPass:
    pass


class OptimizerStep:
    pass


class Engine:
    """A stand-in with DeepSpeed's dispatch: a class-level map, handlers called with self."""

    _INSTRUCTION_MAP = {
        ForwardPass: lambda self, buffer_id: self.ran.append(("fwd", buffer_id)),
        OptimizerStep: lambda self: self.ran.append(("opt", None)),
    }

    def __init__(self) -> None:
        self.ran: list[tuple[str, int | None]] = []

    def dispatch(self, cls: type, **kwargs: int) -> None:
        from types import MethodType

        MethodType(self._INSTRUCTION_MAP[cls], self)(**kwargs)


def test_instrumented_engine_times_every_instruction_and_others_stay_plain() -> None:
    profile = InstructionProfile()
    timed, plain = Engine(), Engine()
    instrument(timed, profile)
    for _ in range(3):
        timed.dispatch(ForwardPass, buffer_id=1)
        timed.dispatch(ForwardPass, buffer_id=0)
        timed.dispatch(OptimizerStep)
    plain.dispatch(ForwardPass, buffer_id=2)
    assert timed.ran[:3] == [("fwd", 1), ("fwd", 0), ("opt", None)]
    # The first step (its one-off costs) is left out; the whole step is timed from one
    # optimizer step's end to the next's, on the wall clock and in CPU time.
    assert profile.calls == {"ForwardPass": 4, "OptimizerStep": 2}
    assert (
        set(profile.seconds)
        == set(profile.cpu_seconds)
        == {"ForwardPass", "OptimizerStep", WHOLE_STEP}
    )
    assert profile.steps == 2 and all(s >= 0 for s in profile.seconds.values())
    assert profile.seconds[WHOLE_STEP] >= profile.seconds["ForwardPass"]
    assert Engine._INSTRUCTION_MAP[ForwardPass] is plain._INSTRUCTION_MAP[ForwardPass]
    assert plain.ran == [("fwd", 2)]


def test_profiles_are_written_where_the_environment_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    assert profile_dir() is None
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "prof"))
    a = InstructionProfile({"ForwardPass": 2.0, "OptimizerStep": 1.0}, {"OptimizerStep": 2})
    b = InstructionProfile({"ForwardPass": 4.0}, {"OptimizerStep": 2})
    write_profile(a, "w0")
    write_profile(b, "w1")
    assert json.loads((tmp_path / "prof" / "w0.json").read_text())["steps"] == 2
    profiles = read_profiles(tmp_path / "prof")
    assert mean_per_step(profiles) == {"ForwardPass": 1.5, "OptimizerStep": 0.25}


def test_a_profile_splits_each_step_into_work_and_waiting() -> None:
    """Two ranks' figures: the instructions' wall and CPU means, what lies outside the
    schedule (the step less the instructions), the step's CPU over both ranks, and the
    idle core time the table derives from them."""
    a = InstructionProfile(
        {"RecvGrad": 0.8, "OptimizerStep": 0.4, WHOLE_STEP: 2.0},
        {"OptimizerStep": 2},
        {"RecvGrad": 0.2, "OptimizerStep": 0.4, WHOLE_STEP: 1.0},
    )
    b = InstructionProfile(
        {"RecvGrad": 0.4, "OptimizerStep": 0.4, WHOLE_STEP: 2.0},
        {"OptimizerStep": 2},
        {"RecvGrad": 0.2, "OptimizerStep": 0.4, WHOLE_STEP: 1.4},
    )
    assert InstructionProfile.from_json(json.loads(json.dumps(a.to_json()))) == a
    s = summarize([a, b])
    assert s["instructions_s_per_step"] == pytest.approx({"RecvGrad": 0.3, "OptimizerStep": 0.2})
    assert s["instructions_cpu_s_per_step"] == pytest.approx(
        {"RecvGrad": 0.1, "OptimizerStep": 0.2}
    )
    assert s["step_s"] == pytest.approx(1.0)
    assert s["outside_s_per_step"] == pytest.approx(0.5)
    assert s["outside_cpu_s_per_step"] == pytest.approx(0.3)
    assert s["step_cpu_s_all_ranks"] == pytest.approx(1.2)
    report = {
        "model": "m",
        "workers": 2,
        "stages": 2,
        "steps": 3,
        "cores": 2,
        "variants": {v: {"step_time_s": 1.0, **s} for v in ("spotline", "spotline-off", "stock")},
    }
    table = format_profile(report)
    assert "| RecvGrad | 300.0 / 100.0 |" in table
    assert "| idle core time (2 cores x step - CPU) | 800.0 |" in table


def _burn_in_thread(cpu_s: float) -> None:
    """Spend at least ``cpu_s`` of CPU on another thread, and join it."""
    import threading
    import time

    def burn() -> None:
        end = time.thread_time() + cpu_s
        while time.thread_time() < end:
            pass

    worker = threading.Thread(target=burn)
    worker.start()
    worker.join()


def test_other_threads_cpu_is_told_from_the_schedule_threads() -> None:
    """What another thread of the process does during an instruction (gloo's copies, the
    replica's sender) is its process CPU less the schedule thread's."""

    class Busy:
        _INSTRUCTION_MAP = {
            ForwardPass: lambda self: _burn_in_thread(0.05),
            OptimizerStep: lambda self: None,
        }

    engine, profile = Busy(), InstructionProfile()
    instrument(engine, profile)
    for _ in range(2):
        engine._INSTRUCTION_MAP[ForwardPass](engine)
        engine._INSTRUCTION_MAP[OptimizerStep](engine)
    split = cpu_split_per_step(profile)
    assert set(split) == {"ForwardPass", "OptimizerStep", WHOLE_STEP}
    schedule, others = split["ForwardPass"]
    # The burning thread's own clock passed 0.05 s; the schedule thread only waited.
    assert others >= 0.05 - 1e-4 and schedule < others
    assert split[WHOLE_STEP][1] >= others - 1e-4
    assert InstructionProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    # A profile written before the split has no schedule-thread figures to split by.
    old = InstructionProfile({"ForwardPass": 1.0}, {"OptimizerStep": 1}, {"ForwardPass": 1.0})
    with pytest.raises(AssertionError, match="schedule thread"):
        cpu_split_per_step(old)


def test_a_variants_cpu_is_paired_with_the_baselines_round_by_round() -> None:
    """Per rank and instruction: both medians, and the spread of the per-round differences
    (not the difference of the medians); an instruction one side never runs counts 0."""
    off = [
        [{"ForwardPass": (0.100, 0.001), WHOLE_STEP: (0.200, 0.002)}],
        [{"ForwardPass": (0.120, 0.001), WHOLE_STEP: (0.240, 0.002)}],
        [{"ForwardPass": (0.080, 0.001), WHOLE_STEP: (0.160, 0.002)}],
    ]
    lazy = [
        [{"ForwardPass": (0.102, 0.004), "ReplicaStep": (0.010, 0.0), WHOLE_STEP: (0.213, 0.006)}],
        [{"ForwardPass": (0.121, 0.005), "ReplicaStep": (0.012, 0.0), WHOLE_STEP: (0.254, 0.007)}],
        [{"ForwardPass": (0.083, 0.003), "ReplicaStep": (0.011, 0.0), WHOLE_STEP: (0.175, 0.005)}],
    ]
    [rank0] = paired_cpu(list(zip(lazy, off, strict=True)))
    fwd = rank0["ForwardPass"]
    assert fwd["baseline_s"] == [0.100, 0.001]
    assert fwd["variant_s"] == [0.102, 0.004]
    thread, others = fwd["difference_s"]
    # Per round +2, +1, +3 ms: median 2 ms; the medians' difference would also be 2 ms, but
    # the whole step's per-round differences (13, 14, 15) differ from its medians' (13).
    assert (thread["min"], thread["median"], thread["max"]) == pytest.approx((0.001, 0.002, 0.003))
    assert others["median"] == pytest.approx(0.003)
    step = rank0[WHOLE_STEP]["difference_s"][0]
    assert (step["min"], step["median"], step["max"]) == pytest.approx((0.013, 0.014, 0.015))
    assert rank0["ReplicaStep"]["baseline_s"] == [0.0, 0.0]
    assert rank0["ReplicaStep"]["difference_s"][0]["median"] == pytest.approx(0.011)
    table = format_paired_cpu([rank0], "lazy", "off")
    lines = table.splitlines()
    assert lines[0].startswith("| rank | instruction | off | lazy | lazy - off")
    assert (
        "| 0 | ReplicaStep | 0.0 / 0.0 | 11.0 / 0.0 | +11.0 (+10.0..+12.0) | +0.0 (+0.0..+0.0) |"
        in lines
    )
    assert lines[-1].startswith("| 0 | the whole step | 200.0 / 2.0 | 213.0 / 6.0 | +14.0")
    with pytest.raises(AssertionError, match="ranks differ"):
        paired_cpu([(lazy[0], off[0] + off[1])])


class Barrier(Engine):
    """A stand-in whose optimizer step passes a commit barrier, as Spotline's does."""

    _INSTRUCTION_MAP = {
        **Engine._INSTRUCTION_MAP,
        OptimizerStep: lambda self: (self.commit_barrier(), self.ran.append(("opt", None))),
    }

    def __init__(self) -> None:
        super().__init__()
        self.commit_barrier = lambda: self.ran.append(("barrier", None))


def test_the_timeline_puts_each_instruction_and_the_commit_barrier_on_the_hosts_clock() -> None:
    import time

    profile, engine = InstructionProfile(), Barrier()
    instrument(engine, profile)
    before = time.time()
    for _ in range(3):
        engine.dispatch(ForwardPass, buffer_id=0)
        engine.dispatch(OptimizerStep)
    after = time.time()
    # The first step is left out, as from the figures; each later event is numbered by its
    # step and lies inside the run, the barrier inside its optimizer step.
    names = [(e.name, e.step) for e in profile.events]
    assert names == [
        ("ForwardPass", 0),
        ("CommitBarrier", 0),
        ("OptimizerStep", 0),
        ("ForwardPass", 1),
        ("CommitBarrier", 1),
        ("OptimizerStep", 1),
    ]
    assert all(before <= e.start <= e.end <= after for e in profile.events)
    barrier, step = profile.events[1], profile.events[2]
    assert step.start <= barrier.start and barrier.end <= step.end
    assert engine.ran.count(("barrier", None)) == 3
    again = InstructionProfile.from_json(json.loads(json.dumps(profile.to_json())))
    assert again.events == profile.events
    # A pipeline engine's stage is noted (which ranks are data-parallel peers); a stand-in
    # without one has none.
    assert profile.stage is None and again.stage is None
    staged = Barrier()
    staged.stage_id = 1  # type: ignore[attr-defined]
    instrument(staged, profile)
    assert profile.stage == 1
    assert InstructionProfile.from_json(json.loads(json.dumps(profile.to_json()))).stage == 1


def test_idle_cores_are_charged_to_the_waits_that_leave_them_idle() -> None:
    from spotline.launch.bench.instruction_timeline import format_idle, idle_account
    from spotline.pipeline.instruction_profile import InstructionSpan

    def ev(name: str, start_ms: int, end_ms: int, step: int = 0) -> InstructionSpan:
        return InstructionSpan(name, step, start_ms / 1000, end_ms / 1000)

    # Three ranks on two cores over 100 ms. Rank a computes throughout; rank b waits in
    # RecvGrad for 0-40 ms, then computes; rank c computes 0-40 ms, then waits in
    # ReduceGrads (and inside it, for 80-100 ms, the commit barrier of its optimizer step).
    a = [ev("ForwardPass", 0, 100)]
    b = [ev("RecvGrad", 0, 40), ev("BackwardPass", 40, 100)]
    c = [
        ev("BackwardPass", 0, 40),
        ev("ReduceGrads", 40, 80),
        ev("OptimizerStep", 80, 100),
        ev("CommitBarrier", 80, 100),
    ]
    account = idle_account([a, b, c], cores=2)
    # 0-40: a and c compute (no core idle) while b waits; 40-80: a and b compute; 80-100:
    # the same. No core was ever idle: the waits overlapped others' work.
    assert account.idle_s == {}
    # On three cores, each wait leaves one idle: b's 40 ms, c's 40 ms and its barrier's 20.
    account = idle_account([a, b, c], cores=3)
    assert {k: round(v * 1000) for k, v in account.idle_s.items()} == {
        "RecvGrad": 40,
        "ReduceGrads": 40,
        "CommitBarrier": 20,
    }
    assert account.steps == pytest.approx(1 / 3)  # c's optimizer step ends inside the window
    rows = format_idle({"x": account.per_step()})
    assert rows[-1] == f"| all | {sum(account.per_step().values()) * 1000:.1f} |"
    # Between instructions counts as waiting too; only the window every rank covers counts.
    gap = [ev("ForwardPass", 0, 30), ev("ForwardPass", 50, 100)]
    late = [ev("BackwardPass", 20, 120)]
    account = idle_account([gap, late], cores=2)
    assert {k: round(v * 1000) for k, v in account.idle_s.items()} == {"(between instructions)": 20}
    assert round(account.window_s * 1000) == 80


def test_a_job_that_takes_turns_is_charged_only_inside_its_turns() -> None:
    """While a job is stopped its ranks stand in whatever they were in: the idle account
    over its turns leaves those slices out, and counts only the steps that end inside."""
    from spotline.launch.bench.instruction_timeline import idle_account
    from spotline.pipeline.instruction_profile import InstructionSpan

    def ev(name: str, start_ms: int, end_ms: int) -> InstructionSpan:
        return InstructionSpan(name, 0, start_ms / 1000, end_ms / 1000)

    # Two ranks on two cores. Rank a computes throughout and ends optimizer steps at 30 and
    # 90 ms; rank b waits in RecvGrad 0-50 ms (stopped 20-60 ms: another job's turn), then
    # in ReduceGrads 50-100 ms.
    a = [ev("ForwardPass", 0, 20), ev("OptimizerStep", 20, 30), ev("BackwardPass", 30, 80)]
    a.append(ev("OptimizerStep", 80, 90))
    a.append(ev("ForwardPass", 90, 100))
    b = [ev("RecvGrad", 0, 50), ev("ReduceGrads", 50, 100)]
    whole = idle_account([a, b], cores=2)
    assert {k: round(v * 1000) for k, v in whole.idle_s.items()} == {
        "RecvGrad": 50,
        "ReduceGrads": 50,
    }
    assert whole.steps == pytest.approx(1.0)  # a's two steps over two ranks
    turns = [(0.0, 0.020), (0.060, 0.100)]
    account = idle_account([a, b], cores=2, windows=turns)
    assert {k: round(v * 1000) for k, v in account.idle_s.items()} == {
        "RecvGrad": 20,
        "ReduceGrads": 40,
    }
    assert round(account.window_s * 1000) == 60
    assert account.steps == pytest.approx(0.5)  # the step ending at 30 ms fell in the pause
    # A window partly before the timelines counts from where every rank's begins.
    assert idle_account([a, b], cores=2, windows=[(-1.0, 0.010)]).window_s == pytest.approx(0.01)


def test_idle_time_is_paired_by_round_wait_by_wait() -> None:
    from spotline.launch.bench.instruction_timeline import (
        ALL_WAITS,
        format_paired_idle,
        paired_idle,
    )

    rounds = [
        ({"ReduceGrads": 0.150, "CommitBarrier": 0.010}, {"ReduceGrads": 0.100}),
        ({"ReduceGrads": 0.120, "CommitBarrier": 0.006}, {"ReduceGrads": 0.130}),
        ({"ReduceGrads": 0.160, "CommitBarrier": 0.008}, {"ReduceGrads": 0.110}),
    ]
    paired = paired_idle(rounds)
    reduce = paired["ReduceGrads"]
    assert reduce["variant_s"] == pytest.approx(0.150)
    assert reduce["baseline_s"] == pytest.approx(0.110)
    # The differences are taken round by round (+50, -10, +50), not between the medians.
    diff = reduce["difference_s"]
    assert (diff["min"], diff["median"], diff["max"]) == pytest.approx((-0.010, 0.050, 0.050))
    # A wait the baseline never stood in counts 0 there.
    assert paired["CommitBarrier"]["baseline_s"] == 0.0
    assert paired["CommitBarrier"]["difference_s"]["median"] == pytest.approx(0.008)
    total = paired[ALL_WAITS]
    assert total["variant_s"] == pytest.approx(0.160)  # of 0.160, 0.126, 0.168
    assert total["difference_s"]["median"] == pytest.approx(0.058)
    table = format_paired_idle(paired, "spotline-off", "stock").splitlines()
    assert (
        table[0]
        == "| waiting in | stock | spotline-off | spotline-off - stock, median (min..max) |"
    )
    assert [row.split(" | ")[0] for row in table[2:]] == [
        "| ReduceGrads",
        "| CommitBarrier",
        "| all",
    ]
    assert table[2] == "| ReduceGrads | 110.0 | 150.0 | +50.0 (-10.0..+50.0) |"


def test_a_stages_peers_are_timed_apart_at_their_reduction() -> None:
    """Per stage and step, from the first data-parallel peer's arrival at ReduceGrads to the
    last's; a step whose arrivals a pause (outside the job's turns) separates is left out,
    and a stage with one rank has no peers to wait for."""
    from spotline.launch.bench.instruction_timeline import reduction_skew
    from spotline.pipeline.instruction_profile import InstructionSpan

    def rank(stage: int, *starts_ms: int) -> InstructionProfile:
        events = [
            InstructionSpan("ReduceGrads", step, start / 1000, (start + 5) / 1000)
            for step, start in enumerate(starts_ms)
        ]
        return InstructionProfile(events=events, stage=stage)

    # Stage 0's peers arrive 10 ms then 40 ms apart; stage 1's 0 then 25 ms apart.
    ranks = [rank(0, 100, 300), rank(0, 110, 340), rank(1, 120, 320), rank(1, 120, 345)]
    assert [round(s * 1000) for s in reduction_skew(ranks)] == [10, 40, 0, 25]
    # A job's turn ending at 330 ms: the second step's arrivals straddle the pause.
    turns = [(0.0, 0.330)]
    assert [round(s * 1000) for s in reduction_skew(ranks, turns)] == [10, 0]
    # One pipeline: every stage has one rank.
    assert reduction_skew([rank(0, 100), rank(1, 130)]) == []
