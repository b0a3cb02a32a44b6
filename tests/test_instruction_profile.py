"""spotline.instruction_profile: every instruction an engine dispatches is timed on that
engine alone, and the figures reach the folder the environment names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotline.instruction_profile import (
    PROFILE_ENV,
    InstructionProfile,
    instrument,
    profile_dir,
    write_profile,
)
from spotline.launch.bench.profile import mean_per_step, read_profiles


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
    assert profile.calls == {"ForwardPass": 6, "OptimizerStep": 3}
    assert profile.steps == 3 and all(s >= 0 for s in profile.seconds.values())
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
