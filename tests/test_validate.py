"""The simulator against a recorded local trace replay, and `spotline calibrate`.

tests/data/replay-validation holds a real run recorded on a 2-core machine: the calibration
`spotline calibrate` measured there, and the summary of a `spotline train --trace` replay
on the same machine (the command is in replay.json). The simulator, given only the
calibration and the replay's settings, must predict the replay's goodput within 15%.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_spotline, small_config, write_config

from spotline.plan.traces import load_trace
from spotline.sim.calibration import load_calibration
from spotline.sim.validate import predict_cluster_replay, predict_replay, wall_clock_trace

DATA = Path(__file__).parent / "data" / "replay-validation"


def recorded() -> dict:
    return json.loads((DATA / "replay.json").read_text())


def test_the_simulator_predicts_a_recorded_local_replay_within_15_percent() -> None:
    run = recorded()
    trace = load_trace(DATA / run["trace"])
    prediction = predict_replay(
        trace,
        load_calibration(DATA / "calibration.json"),
        model="local",
        num_workers=run["workers"],
        max_workers=run["max_workers"],
        time_scale=run["time_scale"],
        train_wall_s=run["train_wall_s"],
        checkpoint_interval_steps=run["checkpoint_interval_steps"],
        warm_workers=run["warm_workers"],
    )
    measured = run["goodput_samples_per_s"]
    error = prediction.goodput_samples_per_s / measured - 1
    assert abs(error) <= 0.15, (prediction.goodput_samples_per_s, measured, prediction.result)
    # The simulated run met the same kinds of events as the real one.
    assert prediction.result.num_preemptions > 0
    assert (prediction.result.num_fatal_failures > 0) == (run["checkpoint_fallbacks"] > 0)


def test_wall_clock_trace_is_the_replay_the_coordinator_plays() -> None:
    from spotline.plan.chaos import replay_trace

    run = recorded()
    trace = load_trace(DATA / run["trace"])
    wall = wall_clock_trace(trace, max_workers=run["max_workers"], time_scale=run["time_scale"])
    replay = replay_trace(
        trace, max_workers=run["max_workers"], time_scale=run["time_scale"], removal="kill"
    )
    initial = sum(1 if e.kind == "add" else -1 for e in wall.events if e.t_s == 0)
    assert initial == replay.initial_workers
    later = [(e.t_s, e.kind) for e in wall.events if e.t_s > 0]
    timed = [(ev.at_s, ev.kind) for ev in replay.events for _ in range(ev.count)]
    assert sorted(later) == sorted(timed)
    assert wall.duration_s == pytest.approx(replay.duration_s)


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_calibrate_measures_this_machine(tmp_path: Path) -> None:
    # Seven short runs since calibrate measures three pipeline counts, at 12 steps (the fewest
    # calibrate accepts) of micro-batches of 2 short sequences, on one stage (1, 2 and 3
    # processes for the three counts, not 2, 4 and 6 on this machine's two cores): what is
    # tested is what each run measures and how the table is built, not this machine's
    # figures. Two stages' takeovers are the recovery tests'.
    out = tmp_path / "calibration.json"
    config = small_config(model={"seq_len": 16})
    config["train_micro_batch_size_per_gpu"] = 2
    proc = run_spotline(
        [
            "calibrate",
            "--config",
            str(write_config(tmp_path / "base.json", config)),
            "--stages",
            "1",
            "--workers",
            "2",
            "--steps",
            "12",
            "--output",
            str(out),
            "--runs",
            str(tmp_path / "runs"),
        ],
        timeout=980,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = load_calibration(out)
    model = table.model("local")
    assert model.num_stages == 1
    # Three pipeline counts measured (the default --pipelines 1,2,3), one degraded row: the
    # run's own 2 pipelines with one lost.
    assert model.measured_pipelines == (1, 2, 3)
    assert all(row.step_time_s > 0 for row in model.step_times)
    assert [row.num_pipelines for row in model.step_times if row.degraded] == [2]
    assert table.reconfigure_s > 0 and table.node_ready_s > 0
    assert model.checkpoint_load_s >= 0
    measured = json.loads(out.read_text())["measured"]
    assert measured["restore_s"] > 0 and measured["state_transfer_s"] >= 0
    assert table.state_transfer_s == round(measured["state_transfer_s"], 4)
    assert measured["param_sha256"]


def test_calibrate_rejects_a_bad_topology(tmp_path: Path) -> None:
    out = tmp_path / "calibration.json"
    proc = run_spotline(
        ["calibrate", "--stages", "2", "--workers", "3", "--output", str(out)], timeout=60
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("spotline: error:")]
    assert len(errors) == 1 and "--workers 3" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_replay_record_takes_what_a_prediction_needs_from_a_finished_run() -> None:
    from spotline.sim.validate import replay_record

    summary = {
        "workers": 2,
        "stages": 2,
        "steps": 1600,
        "checkpoint_interval_steps": 10,
        "train_wall_s": 135.6,
        "goodput_samples_per_s": 377.4,
        "preemptions": 6,
        "recoveries": 3,
        "checkpoint_fallbacks": 3,
        "steps_redone": 6,
        "param_sha256": "ab",
    }
    recovery = {
        "trace": "integration/assets/traces/p3-trace.csv",
        "time_scale": 30.0,
        "trace_clock": "wall",
        "max_workers": None,
        "warm_workers": 1,
    }
    record = replay_record(summary, {"spotline": {"recovery": recovery}})
    assert record["trace"] == "p3-trace.csv"
    assert record["max_workers"] == 2  # no cap given: the configured workers
    assert {k: record[k] for k in summary} == summary
    with pytest.raises(ValueError, match="no trace"):
        replay_record(summary, {"spotline": {"recovery": {**recovery, "trace": None}}})
    # The recorded run in tests/data was made by this function.
    assert set(recorded()) >= set(record)


CLUSTER = DATA / "cluster"


def test_the_simulator_predicts_recorded_namespace_cluster_replays_within_15_percent() -> None:
    # tests/data/replay-validation/cluster: `spotline bench cluster-replay` on a 2-core
    # machine (the command is in replay.json), every round it ran: p3-trace.csv scaled to 4
    # machines x 1 slot, 30x, each trace node a machine killed whole or booted cold, and each
    # round's cluster calibration (a machine's boot, a loss's recovery and an arrival's
    # generation change measured on the same namespaces, and the steady steps just before
    # the round; the checkpoint costs from `spotline calibrate`). The
    # simulator, given only that table and the replay's settings and window, must predict
    # the measured goodput within 15%, every round (their errors are in BENCHMARKS.md).
    run = json.loads((CLUSTER / "replay.json").read_text())
    trace = load_trace(DATA / run["trace"])
    errors = []
    for recorded_round in run["rounds"]:
        prediction = predict_cluster_replay(
            trace,
            load_calibration(CLUSTER / recorded_round["calibration"]),
            model="local",
            num_workers=recorded_round["workers"],
            machines=run["machines"],
            time_scale=run["time_scale"],
            window_s=recorded_round["window_s"],
            checkpoint_interval_steps=run["checkpoint_interval_steps"],
        )
        errors.append(
            prediction.goodput_samples_per_s / recorded_round["goodput_samples_per_s"] - 1
        )
        # The simulated run met the same kinds of events: machines lost, and a fatal loss
        # (the trace takes all four machines within 8 s) restored from the checkpoint.
        assert prediction.result.num_preemptions > 0 and recorded_round["machines_killed"] > 0
        assert (
            prediction.result.num_fatal_failures > 0 and recorded_round["checkpoint_fallbacks"] > 0
        )
        assert prediction.result.policy == "spotline"  # the runtime's own policy
    assert len(errors) >= 3
    assert all(abs(error) <= 0.15 for error in errors), errors
