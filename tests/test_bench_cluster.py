"""``spotline bench cluster`` without a cluster: its command line, its bad input, the log
watch it times losses with, and the report it builds and prints (pure: no processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spotline.launch.bench import cluster, command
from spotline.launch.bench import cluster_processes as machines


def test_command_line_defaults_and_flags() -> None:
    args = command.build_parser().parse_args(["cluster", "--output", "out"])
    assert (args.victim, args.kill_after, args.heartbeat_timeout) == ("w1", 2, None)
    assert (args.transfer_mib, args.transfer_repeats) == (256, 5)
    settings = command.settings_from_args(args)
    # Its own default length: a few steps around the loss, not the 30 steady ones.
    assert (settings.steps, settings.repeats) == (command.CLUSTER_DEFAULT_STEPS, 3)
    args = command.build_parser().parse_args(
        ["cluster", "--victim", "w3", "--kill-after", "4", "--heartbeat-timeout", "2.5",
         "--transfer-mib", "8", "--transfer-repeats", "2", "--steps", "10"]
    )  # fmt: skip
    assert (args.victim, args.kill_after, args.heartbeat_timeout) == ("w3", 4, 2.5)
    assert (args.transfer_mib, args.transfer_repeats) == (8, 2)
    assert command.settings_from_args(args).steps == 10


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kill-after", "0"], "--kill-after 0"),
        (["--steps", "6", "--kill-after", "5"], "a step must follow"),
        (["--steps", "20"], "at most 19"),
        (["--victim", "w4"], "--victim 'w4'"),
        (["--transfer-mib", "0"], "positive"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert command.main(["cluster", "--output", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spotline: error: ") and message in err, err
    assert err.count("\n") == 1
    assert not list(tmp_path.iterdir())  # nothing was run or written


def test_log_watch_keeps_complete_lines_with_the_time_first_seen(tmp_path: Path) -> None:
    path = tmp_path / "err"
    watch = machines.LogWatch(path)
    watch.poll()  # not there yet: nothing
    path.write_text("spotline: step 1/8 loss 4\nspotline: [  1.00s] recov")
    watch.poll()
    assert [line for _, line in watch.lines] == ["spotline: step 1/8 loss 4"]
    with open(path, "a") as f:
        f.write("ered {'generation': 1}\n")
    watch.poll()
    seen, line = watch.first(r"\] recovered ") or (0.0, "")
    assert line == "spotline: [  1.00s] recovered {'generation': 1}"
    assert watch.first(r"\] recovered ", after=seen + 1) is None


def _run(commit: float, detect: float | None, recovery: float) -> dict[str, Any]:
    return {
        "loss_to_commit_s": commit,
        "loss_to_detect_s": detect,
        "coordinator_recovery_s": recovery,
        "in_memory": True,
        "checkpoint_fallbacks": 0,
        "param_sha256": "abc",
    }


def test_report_medians_targets_and_table() -> None:
    runs = {
        "machine-kill": [_run(5.3, 5.0, 0.3), _run(5.5, 5.1, 0.3), _run(5.1, 4.9, 0.2)],
        "link-down": [_run(5.9, 5.0, 0.9), _run(6.4, 5.1, 1.0), _run(5.8, 5.0, 0.8)],
        "single-machine": [_run(0.8, 0.1, 0.7), _run(0.9, 0.1, 0.8), _run(0.7, None, 0.6)],
    }
    mib = 2**20
    transfer = {"bytes": 64 * mib, "repeats": 3, "gloo": [0.1, 0.2, 0.05], "tcp": [0.05] * 3}
    report = cluster.build_report(
        runs, transfer, heartbeat_timeout_s=5.0, steps=8, repeats=3, victim="w1", kill_after=2
    )
    rows, targets, x = report["rows"], report["targets"], report["transfer"]
    assert rows["machine-kill"]["loss_to_commit_s"] == 5.3
    assert rows["single-machine"]["loss_to_detect_s"] == 0.1  # a missing value is left out
    assert targets["machine_kill_minus_single_s"] == pytest.approx(4.5)
    assert targets["machine_kill_met"] is False
    assert targets["link_down_minus_heartbeat_s"] == pytest.approx(0.9)
    assert targets["link_down_met"] is True
    assert x["gloo_mib_per_s"] == pytest.approx(640.0) and x["tcp_mib_per_s"] == 1280.0
    assert x["gloo_over_tcp"] == pytest.approx(0.5)
    assert report["hashes_agree"] is True
    table = cluster.format_cluster(report)
    assert "| machine-kill | 5.30 | 5.00 | 0.30 | yes | 0 |" in table
    assert "machine-kill - single-machine: 4.50 s (target <= 1 s: NOT met)" in table
    assert "link-down - heartbeat timeout (5 s): 0.90 s (target <= 1 s: met)" in table
    assert "| gloo batch_isend_irecv | 640 | 0.100 |" in table
    assert "gloo / tcp rate: 0.50x" in table


# ------------------------------------------------------------------ spotline bench cluster-replay


def test_replay_command_line_defaults() -> None:
    args = command.build_parser().parse_args(["cluster-replay"])
    assert (args.machines, args.time_scale, args.checkpoint_interval) == (4, 30.0, 10)
    assert args.trace.endswith("p3-trace.csv") and args.calibration is None
    settings = command.settings_from_args(args)
    # One long replay, not three short timed rounds.
    assert (settings.steps, settings.repeats) == (command.REPLAY_DEFAULT_STEPS, 1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--machines", "1"], "--machines 1"),
        (["--machines", "13"], "at most 12"),
        (["--time-scale", "0"], "--time-scale 0"),
        (["--checkpoint-interval", "-1"], "--checkpoint-interval -1"),
        (["--trace", "no-such-trace.csv"], "no-such-trace.csv"),
        (["--calibration", "no-such-table.json"], "no-such-table.json"),
    ],
)
def test_replay_bad_input_is_one_line_and_exit_2_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert command.main(["cluster-replay", "--output", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spotline: error: ") and message in err, err
    assert err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_machine_actions_are_the_trace_node_by_node() -> None:
    from spotline.plan.traces import Trace, TraceEvent

    ev = TraceEvent
    wall = Trace(
        (
            ev(0.0, "add", "a"),
            ev(0.0, "add", "b"),
            ev(3.0, "add", "c"),
            ev(5.0, "add", "d"),  # listed before b's removal at the same instant
            ev(5.0, "remove", "b"),
            ev(7.0, "remove", "a"),
            ev(9.0, "add", "a"),  # a third life of a: another new machine
        ),
        10.0,
        "toy",
    )
    initial, actions = replay_machine_actions(wall)
    assert initial == ("a#1", "b#1")
    assert [(a.t_s, a.kind, a.node) for a in actions] == [
        (3.0, "boot", "c#1"),
        (5.0, "kill", "b#1"),
        (5.0, "boot", "d#1"),
        (7.0, "kill", "a#1"),
        (9.0, "boot", "a#2"),
    ]


def replay_machine_actions(wall: Any) -> Any:
    from spotline.launch.bench import cluster_replay

    return cluster_replay.machine_actions(wall)


def test_machine_actions_of_a_shipped_trace_keep_every_machine_once_alive() -> None:
    # The real trace the validation replays: every kill is of a machine booted before it
    # and not yet killed, and no more machines live at once than the cap.
    from spotline.launch.bench import cluster_replay
    from spotline.plan.traces import load_trace
    from spotline.sim.validate import wall_clock_trace

    wall = wall_clock_trace(load_trace(command.DEFAULT_TRACE), max_workers=4, time_scale=30)
    initial, actions = cluster_replay.machine_actions(wall)
    live = set(initial)
    assert 1 <= len(live) <= 4
    for action in actions:
        if action.kind == "boot":
            assert action.node not in live
            live.add(action.node)
        else:
            live.remove(action.node)
        assert len(live) <= 4
    assert [a.t_s for a in actions] == sorted(a.t_s for a in actions)
    assert sum(a.kind == "kill" for a in actions) > 10


def test_the_cluster_table_is_the_local_one_with_the_clusters_steps_and_boots() -> None:
    import json

    from spotline.launch.bench import cluster_replay

    local = json.loads(
        (Path(__file__).parent / "data" / "replay-validation" / "calibration.json").read_text()
    )
    rows = [
        {"num_stages": 2, "num_pipelines": p, "degraded": False, "step_time_s": t}
        for p, t in ((1, 0.25), (2, 0.27))
    ]
    changes = cluster_replay.ClusterChanges((5.0, 9.0, 6.0), (1.5, 0.5, 1.0), (3.0,))
    table = cluster_replay.cluster_table(local, rows, changes, 4)
    model = table["models"]["local"]
    assert model["step_times"][:2] == rows
    (degraded,) = model["step_times"][2:]
    assert degraded["degraded"] and degraded["num_pipelines"] == 1
    assert degraded["step_time_s"] == round(0.25 * local["degraded_slowdown"], 5)
    assert table["node_ready_s"] == 6.0  # the median boot
    assert table["reconfigure_s"] == table["fatal_rendezvous_s"] == 1.0  # the median recovery
    assert table["state_transfer_s"] == 2.0  # an arrival's change beyond a recovery
    # What a checkpoint costs and the degraded slowdown stay the local table's.
    for key in ("degraded_slowdown", "spotline_checkpoint_interval_s"):
        assert table[key] == local[key]
    assert (
        table["models"]["local"]["checkpoint_load_s"]
        == local["models"]["local"]["checkpoint_load_s"]
    )
    assert local["models"]["local"]["step_times"] != model["step_times"]  # not changed in place
