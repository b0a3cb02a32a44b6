"""spotline.instruction_profile: every instruction an engine dispatches is timed on that
engine alone, and the figures reach the folder the environment names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotline.instruction_profile import (
    PROFILE_ENV,
    WHOLE_STEP,
    InstructionProfile,
    instrument,
    profile_dir,
    write_profile,
)
from spotline.launch.bench.profile import format_profile, mean_per_step, read_profiles, summarize


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
