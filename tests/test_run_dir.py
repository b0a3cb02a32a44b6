"""A run's output directory holds one run (``spotline.run_dir``), and a run in parts keeps
one record (``RunMetrics.record``/``continue_record``). Pure: no process starts here; the
real Ctrl-C + ``--resume`` run is in test_resume_and_disk.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import small_config
from test_control import DictStore

from spotline.config import parse_config
from spotline.errors import UserError
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.resume import earlier_record
from spotline.run_dir import (
    RECORD_NAME,
    RUN_OUTPUTS,
    earlier_run_outputs,
    refuse_earlier_run,
    refuse_finished_resume,
)


def test_a_directory_without_a_run_is_free(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()  # empty: nothing was committed
    (tmp_path / "my-notes.txt").write_text("mine")
    assert earlier_run_outputs(tmp_path) == []
    refuse_earlier_run(tmp_path, resume="spotline train --resume X")
    refuse_finished_resume(tmp_path)
    refuse_earlier_run(tmp_path / "not-yet", resume=None)


@pytest.mark.parametrize("name", RUN_OUTPUTS)
def test_any_output_of_an_earlier_run_refuses_a_new_one(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    if name in ("checkpoints", "logs", "model", "wandb", "eval-models", "hf-job"):
        path.mkdir()
        (path / "a-file").write_text("x")
    else:
        path.write_text("{}")
    with pytest.raises(UserError) as caught:
        refuse_earlier_run(tmp_path, resume=f"spotline train --resume {tmp_path}")
    message = str(caught.value)
    assert "\n" not in message and name in message and "fresh --output" in message
    if name == "summary.json":
        assert "holds a finished run" in message and "--resume" in message
    else:
        assert f"`spotline train --resume {tmp_path}`" in message


def test_a_finished_run_is_not_resumed(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 20}))
    with pytest.raises(UserError, match="that run finished all 20 steps"):
        refuse_finished_resume(tmp_path)
    with pytest.raises(UserError, match=r"--output_dir .* holds a finished run") as caught:
        refuse_earlier_run(tmp_path, flag="--output_dir", resume=None)
    assert "--resume" not in str(caught.value)  # this entry point has none


def _metrics() -> RunMetrics:
    cfg = parse_config(small_config(topology={"workers": 2, "stages": 2}, training={"steps": 8}))
    progress = [0]
    return RunMetrics(cfg, DictStore(), snapshot=lambda: (progress[0], 2, {"w0": "p0:s0"}))


def test_a_resumed_part_goes_on_with_the_stopped_parts_record() -> None:
    first = _metrics()
    first.event("start", workers=2, step=0)
    first.note_preemption()
    first.recovered(1, 2, 0.5, in_memory=True)
    first.step_times.update({0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4})
    # Stopped after 4 steps, its last checkpoint at step 3: a resume redoes step 4.
    record = json.loads(json.dumps(first.record(reached_step=4, how="interrupted")))

    second = _metrics()
    second.continue_record(record, resume_step=3)
    second.event("start", workers=2, step=3)
    assert [e.kind for e in second.events] == ["start", "recovered", "start"]
    assert second.events[-1].t_s >= second.events[-2].t_s  # one clock over the parts
    assert (second.preemptions, second.recoveries, second.steps_redone) == (1, 1, 1)
    assert second.step_times == {0: 0.1, 1: 0.2, 2: 0.3}  # step 4's time is the redo's
    summary = second.summary(
        wall=1.0,
        train_wall_s=1.0,
        layout=None,
        generations=1,
        checkpoint_interval_steps=0,
        resumed_from_step=3,
    )
    assert [(p["from_step"], p["reached_step"], p["how"]) for p in summary["parts"]] == [
        (0, 4, "interrupted"),
        (3, 8, "finished"),
    ]
    assert summary["recovery_summary"]["num_recoveries"] == summary["recoveries"] == 1
    assert summary["samples_per_s"] == 5 * second.cfg.samples_per_step  # this part's 5 steps


def test_a_resume_takes_the_record_with_the_most_parts(tmp_path: Path) -> None:
    one = {"parts": [{"from_step": 0, "reached_step": 30, "how": "stopped", "wall_s": 1}]}
    two = {"parts": [*one["parts"], {"from_step": 30, "reached_step": 50, "how": "running"}]}
    assert earlier_record(tmp_path, None) is None
    assert earlier_record(tmp_path, two) == two  # the part crashed before saving its own
    (tmp_path / RECORD_NAME).write_text(json.dumps(one))
    assert earlier_record(tmp_path, one) == one
    assert earlier_record(tmp_path, two) == two  # the saved one is an older part's
    assert earlier_record(tmp_path, None) == one
