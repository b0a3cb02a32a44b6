"""Calibration tables (issue 14, point 5): rows for the pipeline counts they measure,
interpolated between them, refused outside them (the simulator's bound is flagged in its
results), and Bamboo's two GPT-2 tables as named calibrations citing where they come from.
Pure logic: no process is started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TOY

from spotline.errors import UserError
from spotline.launch.simulate import main as simulate_main
from spotline.launch.simulate_report import uncalibrated_note
from spotline.plan.traces import Trace
from spotline.sim.calibration import (
    DEFAULT_CALIBRATION,
    NAMED_CALIBRATIONS,
    ModelCalibration,
    OutsideCalibration,
    StepTimeRow,
    load_calibration,
)
from spotline.sim.sim_config import SimConfig
from spotline.sim.simulator import simulate


def model(rows: dict[int, float], degraded: dict[int, float] | None = None) -> ModelCalibration:
    """A 4-stage model with non-degraded ``rows`` (pipelines -> seconds), a degraded
    slowdown of 1.5 and optional degraded rows."""
    step_times = [StepTimeRow(4, p, False, t) for p, t in rows.items()]
    step_times += [StepTimeRow(4, p, True, t) for p, t in (degraded or {}).items()]
    # A row for another stage count is not this model's: it must not widen the range.
    step_times.append(StepTimeRow(8, 16, False, 0.5))
    return ModelCalibration("m", 4, 64, 1.0, 1.0, tuple(step_times), 1.5)


def test_measured_rows_are_returned_exactly_and_define_the_range() -> None:
    m = model({4: 4.0, 1: 10.0, 2: 7.0})  # rows in any order
    assert m.pipeline_range == (1, 4)
    assert m.measured_pipelines == (1, 2, 4)
    assert [m.step_time_s(p, False) for p in (1, 2, 4)] == [10.0, 7.0, 4.0]
    assert m.covers(3) and not m.covers(5) and not m.covers(16)


def test_between_rows_the_step_time_is_linear_in_one_over_p_between_the_neighbours() -> None:
    # Rows on t = 2 + 8/P at P = 1 and 4: the interpolation reproduces that line exactly.
    m = model({1: 10.0, 4: 4.0})
    assert m.step_time_s(2, False) == pytest.approx(6.0, abs=1e-12)
    assert m.step_time_s(3, False) == pytest.approx(2.0 + 8.0 / 3.0, abs=1e-12)
    # With a middle row only the two neighbours count: P=3 lies on the line through
    # (1/2, 7.0) and (1/4, 4.0): 7 + (4 - 7) * (1/3 - 1/2) / (1/4 - 1/2) = 5.0; the old
    # least-squares a + b/P over all three rows gave about 5.07.
    m = model({1: 10.0, 2: 7.0, 4: 4.0})
    assert m.step_time_s(3, False) == pytest.approx(5.0, abs=1e-12)
    assert m.step_time_bound_s(3, False) == (m.step_time_s(3, False), True)


def test_outside_the_rows_step_time_is_refused_in_one_line() -> None:
    m = model({2: 6.0, 4: 4.0})
    for pipelines in (1, 5, 8):
        with pytest.raises(OutsideCalibration) as error:
            m.step_time_s(pipelines, False)
        message = str(error.value)
        assert "\n" not in message
        assert "2-4 pipelines of 4 stages" in message and f"not {pipelines}" in message
        assert "spotline calibrate --pipelines" in message
        # A user mistake: entry points print it as one line and exit 2.
        assert isinstance(error.value, UserError)
        with pytest.raises(OutsideCalibration):
            m.step_time_s(pipelines, True)
    with pytest.raises(ValueError, match="num_pipelines must be >= 1"):
        m.step_time_s(0, False)


def test_the_bound_outside_the_rows_never_flatters_and_is_flagged() -> None:
    m = model({2: 6.0, 4: 4.0})
    # Above the rows: no speed-up is assumed beyond the most pipelines measured.
    assert m.step_time_bound_s(8, False) == (4.0, False)
    # Below the rows: the slowest a fixed global batch can get (all work scaling as 1/P).
    assert m.step_time_bound_s(1, False) == (12.0, False)
    # Degraded outside: the bound times the slowdown, still flagged.
    assert m.step_time_bound_s(8, True) == (6.0, False)


def test_a_single_row_covers_only_its_own_pipeline_count() -> None:
    """The shape of an old one-row spotline calibrate table: it no longer scales linearly
    to any pipeline count (issue 14: 'scales perfectly linearly down to millisecond steps')."""
    m = model({1: 0.07})
    assert m.step_time_s(1, False) == 0.07
    with pytest.raises(OutsideCalibration, match="1-1 pipelines"):
        m.step_time_s(8, False)
    assert m.step_time_bound_s(8, False) == (0.07, False)


def test_degraded_rows_win_otherwise_the_slowdown_of_the_interpolated_time() -> None:
    m = model({1: 10.0, 4: 4.0}, degraded={1: 11.0})
    assert m.step_time_s(1, True) == 11.0
    assert m.step_time_s(2, True) == pytest.approx(6.0 * 1.5, abs=1e-12)
    assert m.step_time_s(4, True) == 4.0 * 1.5


def test_two_different_times_for_one_row_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="two step times for 4 stages x 2 pipelines"):
        ModelCalibration(
            "m",
            4,
            64,
            1.0,
            1.0,
            (StepTimeRow(4, 2, False, 3.0), StepTimeRow(4, 2, False, 3.5)),
            1.5,
        )
    raw = json.loads(NAMED_CALIBRATIONS["bamboo-gpt2-8stage"].read_text())
    raw["models"]["gpt2"]["step_times"].append(
        {"num_stages": 8, "num_pipelines": 2, "degraded": False, "step_time_s": 5.0}
    )
    path = tmp_path / "twice.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(UserError, match="two step times"):
        load_calibration(path)


def test_bamboos_earlier_table_is_the_default_and_cites_its_revision() -> None:
    assert DEFAULT_CALIBRATION == "bamboo-gpt2-8stage"
    default = load_calibration()
    named = load_calibration("bamboo-gpt2-8stage")
    assert default.name == named.name == "bamboo-gpt2-8stage"
    gpt2 = named.model("gpt2")
    # The figures of uclasystem/bamboo's simulator at the cited commit.
    assert (gpt2.num_stages, gpt2.samples_per_step) == (8, 264)
    assert [gpt2.step_time_s(p, False) for p in (1, 2, 3)] == [7.7, 4.2, 3.08]
    assert gpt2.pipeline_range == (1, 3)
    revision = dict(named.sources)["revision"]
    assert "uclasystem/bamboo" in revision
    assert "project_pactum/simulation/simulator.py" in revision
    assert "1057ba80fb6368e7b477e940b28be9ffeb75792e" in revision
    assert "extrapolation" not in dict(named.sources)  # the a + b/P fit is gone


def test_bamboos_later_12_stage_table_is_named_and_says_what_is_known_of_its_source() -> None:
    later = load_calibration("bamboo-gpt2-12stage")
    assert later.name == "bamboo-gpt2-12stage"
    gpt2 = later.model("gpt2")
    assert (gpt2.num_stages, gpt2.samples_per_step) == (12, 32)
    assert [gpt2.step_time_s(p, False) for p in (1, 2, 3, 4)] == [1.2, 1.085, 1.046, 1.008]
    sources = dict(later.sources)
    assert "gpt_2_simulate_step_delta" in sources["revision"]
    # The commit could not be identified: the table says so instead of naming one.
    assert "NOT VERIFIED" in sources["provenance"]
    assert "uclasystem/bamboo" in sources["provenance"]


def test_an_unknown_calibration_name_is_one_line_naming_the_shipped_ones() -> None:
    with pytest.raises(UserError) as error:
        load_calibration("bamboo-gpt3")
    message = str(error.value)
    assert "\n" not in message
    assert all(name in message for name in NAMED_CALIBRATIONS)
    with pytest.raises(UserError, match="does not exist"):
        load_calibration("missing.json")


# test_sim's toy calibration with only its first row (1 pipeline, not degraded).
TOY_ONE_ROW = {
    **TOY,
    "models": {
        "toy": {**TOY["models"]["toy"], "step_times": TOY["models"]["toy"]["step_times"][:1]}
    },
}


def test_the_simulator_counts_training_outside_the_rows(tmp_path: Path) -> None:
    path = tmp_path / "one-row.json"
    path.write_text(json.dumps(TOY_ONE_ROW))
    calibration = load_calibration(path)
    assert calibration.name == ""  # a file, not a shipped name
    trace = Trace((), 3600.0, "empty")
    # 4 nodes: on demand runs 2 pipelines, outside the one measured row, all the time, at
    # the 1-pipeline step time (the bound): (3600 - 45 - 30) / 2.0 = 1762 whole steps.
    wide = simulate(trace, "on-demand", SimConfig(calibration, calibration.model("toy"), 4))
    assert wide.uncalibrated_s == wide.running_s == pytest.approx(3525.0)
    assert wide.committed_samples == 1762 * 10
    assert wide.summary()["uncalibrated_s"] == wide.uncalibrated_s
    # 2 nodes: one pipeline, inside the row: nothing flagged.
    narrow = simulate(trace, "on-demand", SimConfig(calibration, calibration.model("toy"), 2))
    assert narrow.uncalibrated_s == 0.0 and narrow.running_s > 0


def test_the_note_under_the_table_names_each_flagged_policy_and_the_range() -> None:
    m = model({1: 10.0, 2: 7.0})
    rows = [
        ("spotline", {"uncalibrated_s": 25.0, "running_s": 100.0}),
        ("checkpoint-restart", {"uncalibrated_s": 0.0, "running_s": 100.0}),
    ]
    note = uncalibrated_note(rows, m)
    assert "spotline 25%" in note and "checkpoint-restart" not in note
    assert "1-2 pipelines of 4 stages" in note and "\n" not in note
    assert uncalibrated_note(rows[1:], m) == ""


def test_cli_selects_a_named_calibration_and_flags_64_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("\n".join(f"0,add,n{i}" for i in range(64)) + "\n3600000,remove,n1\n")
    output = tmp_path / "out"
    argv = ["--trace", str(trace), "--nodes", "64", "--output", str(output), "--no-progress"]
    code = simulate_main([*argv, "--calibration", "bamboo-gpt2-12stage", "--policies", "on-demand"])
    out = capsys.readouterr().out
    assert code == 0
    document = json.loads((output / "results.json").read_text())
    assert document["assumptions"]["calibration"] == "bamboo-gpt2-12stage"
    assert document["assumptions"]["measured pipeline counts"] == [1, 2, 3, 4]
    # 64 nodes of 12 stages: 5 pipelines, outside the 1-4 measured: flagged, not extrapolated.
    result = document["results"]["on-demand"]
    assert result["uncalibrated_s"] == pytest.approx(result["running_s"])
    assert "note: uncal. s" in out and "1-4 pipelines of 12 stages" in out
    assert document["uncalibrated_note"].startswith("note: uncal. s")


def test_cli_unknown_calibration_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--preempt-rate", "0.1", "--nodes", "16", "--output", str(tmp_path / "o")]
    code = simulate_main([*argv, "--calibration", "bamboo-nope"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown calibration 'bamboo-nope'" in lines[0], err
    assert "Traceback" not in err


def test_calibrate_measures_at_least_three_pipeline_counts() -> None:
    from spotline.launch.calibrate import parse_pipelines

    assert parse_pipelines("1,2,3", 1) == (1, 2, 3)
    assert parse_pipelines("4, 2,1", 1) == (1, 2, 4)
    # The run's own pipeline count (workers / stages) is always measured.
    assert parse_pipelines("1,3", 2) == (1, 2, 3)
    for text, words in (("1,2", "at least 3"), ("1,1,1", "at least 3"), ("0,1,2", ">= 1")):
        with pytest.raises(UserError, match=words) as error:
            parse_pipelines(text, 1)
        assert "--pipelines" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UserError, match="'x' is not a whole number"):
        parse_pipelines("1,x,3", 1)


def test_calibrate_writes_a_row_per_measured_pipeline_count(tmp_path: Path) -> None:
    """spotline calibrate's table from measured numbers (no run): a row per pipeline count,
    the degraded row at the run's own, interpolated between them by the simulator."""
    from spotline.launch.calibrate import calibration_table

    measured = {
        "stages": 2,
        "workers": 2,
        "pipelines": 1,
        "logical_workers": 6,
        "steps": 30,
        "samples_per_step": 192,
        "step_time_s": 0.6,
        "pipeline_step_times_s": {"1": 0.6, "2": 0.35, "3": 0.3},
        "degraded_step_time_s": 0.75,
        "checkpoint_save_s": 0.01,
        "reconfigure_s": 0.4,
        "state_transfer_s": 1.5,
        "restore_s": 1.6,
        "restore_from": "checkpoint",
        "node_ready_s": 6.0,
        "checkpoint_interval_steps": 5,
        "param_sha256": "ab",
        "model": "gpt2-tiny",
    }
    table = calibration_table(measured)
    rows = table["models"]["local"]["step_times"]
    assert [(r["num_pipelines"], r["degraded"], r["step_time_s"]) for r in rows] == [
        (1, False, 0.6),
        (2, False, 0.35),
        (3, False, 0.3),
        (1, True, 0.75),
    ]
    assert table["degraded_slowdown"] == 1.25
    assert "2 stages x 1, 2, 3 pipelines" in table["description"]
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(table))
    model_ = load_calibration(path).model("local")
    assert model_.pipeline_range == (1, 3)
    assert model_.step_time_s(2, True) == pytest.approx(0.35 * 1.25)
    with pytest.raises(OutsideCalibration):
        model_.step_time_s(4, False)


def test_cli_sweep_flags_seeds_outside_the_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The synthetic path: 32 nodes of Bamboo's 8 stages plan 4 pipelines, beyond its 3."""
    output = tmp_path / "out"
    argv = ["--preempt-rate", "0.1", "--seeds", "1", "--hours", "1", "--nodes", "32"]
    code = simulate_main(
        [*argv, "--policies", "on-demand", "--output", str(output), "--no-progress"]
    )
    out = capsys.readouterr().out
    assert code == 0
    document = json.loads((output / "results.json").read_text())
    [result] = document["results"]["on-demand"]
    assert (
        result["uncalibrated_s"] == pytest.approx(result["running_s"]) and result["running_s"] > 0
    )
    assert "1-3 pipelines of 8 stages" in document["uncalibrated_note"]
    assert "note: uncal. s" in out
