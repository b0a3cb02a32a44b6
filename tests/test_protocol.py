"""spotline.wire.protocol: the one place a store key is spelled, and its messages' JSON forms."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from spotline.plan.grid import Layout
from spotline.plan.layout import Holding
from spotline.wire.protocol import (
    CHECKPOINT_ERRORS_COUNTER,
    FINAL_HASH_KEY,
    KEY_PREFIXES,
    CheckpointWriteError,
    GenerationSetup,
    ModelStateBytes,
    PlanMessage,
    Rebalance,
    ReplicaMismatch,
    Report,
    WorkerStats,
    abort_key,
    abort_watch_key,
    checkpoint_error_key,
    entry_key,
    error_key,
    heartbeat_key,
    joined_key,
    leaving_key,
    loss_key,
    lr_key,
    plan_key,
    process_group_prefix,
    progress_key,
    ready_key,
    report_key,
    stop_checkpoint_key,
    stop_key,
)

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("integration", "launch", "patches")
LAYOUT = Layout(2, 2, ((0,), (1,)), (("w0", "w2"), ("w1", "w3")), ("w4",))


def test_keys_are_spelled_as_the_workers_and_the_coordinator_expect() -> None:
    assert [
        entry_key("w1"),
        plan_key(3),
        stop_key(3),
        stop_checkpoint_key(3),
        abort_key(3),
        abort_watch_key(3, "w1"),
        joined_key("w1"),
        heartbeat_key("w1"),
        leaving_key("w1"),
        progress_key(3, "w1"),
        ready_key(3, "w1"),
        report_key(3, "w1"),
        error_key("w1"),
        checkpoint_error_key(2),
        loss_key(7),
        lr_key(7),
        process_group_prefix(3),
        FINAL_HASH_KEY,
        CHECKPOINT_ERRORS_COUNTER,
    ] == [
        "entry/w1",
        "plan/3",
        "stop/3",
        "stop-checkpoint/3",
        "abort/3",
        "abort-watch/3/w1",
        "joined/w1",
        "hb/w1",
        "leaving/w1",
        "progress/3/w1",
        "ready/3/w1",
        "report/3/w1",
        "error/w1",
        "checkpoint-error/2",
        "loss/7",
        "lr/7",
        "pg/3",
        "final/param_sha256",
        "checkpoint-errors",
    ]


def test_layout_json_round_trip() -> None:
    raw = LAYOUT.to_json()
    assert raw == {
        "num_stages": 2,
        "num_pipelines": 2,
        "groups": [[0], [1]],
        "slots": [["w0", "w2"], ["w1", "w3"]],
        "standby": ["w4"],
    }
    assert Layout.from_json(raw) == LAYOUT


@pytest.mark.parametrize(
    "plan",
    [
        PlanMessage.finish(),
        PlanMessage("train", None, None, 4, {0: ("w0",), 1: ()}, ()),
        PlanMessage(
            "train",
            LAYOUT,
            {"p0000": (0,), "p0001": (1, 2)},
            5,
            {0: ("w0", "w2"), 1: ("w1",)},
            ((0, "w0"), (1, "w1")),
            checkpoint_interval=3,
        ),
        # An exposed plan's schedule: its first committed step, then every 3 (exposure).
        PlanMessage("train", LAYOUT, {"p0000": (0,)}, 5, checkpoint_interval=3, checkpoint_from=6),
        PlanMessage(
            "restore",
            LAYOUT,
            {"p0000": (0,), "p0001": (1,)},
            6,
            {0: ("w0",), 1: ("w0",)},
            ((0, "w0"), (1, "w0")),
            checkpoint_interval=2,
            checkpoint_step=6,
        ),
    ],
)
def test_plan_json_round_trip(plan: PlanMessage) -> None:
    assert PlanMessage.decode(plan.encode()) == plan


def test_plan_json_is_the_wire_form() -> None:
    plan = PlanMessage("restore", LAYOUT, {"p0000": (0,)}, 6, {0: ("w0",)}, ((0, "w0"),), 2, 6)
    assert plan.to_json() == {
        "action": "restore",
        "layout": LAYOUT.to_json(),
        "logical": {"p0000": [0]},
        "resume_step": 6,
        "holders": {"0": ["w0"]},
        "sources": [[0, "w0"]],
        "checkpoint_interval": 2,
        "checkpoint_step": 6,
    }
    assert PlanMessage.finish().to_json() == {"action": "finish"}


def test_a_restore_plan_and_only_one_names_its_checkpoint() -> None:
    with pytest.raises(AssertionError):
        PlanMessage("restore", LAYOUT, {"p0000": (0,)}, 6)
    with pytest.raises(AssertionError):
        PlanMessage("train", LAYOUT, {"p0000": (0,)}, 6, checkpoint_step=6)


def test_report_json_round_trip() -> None:
    report = Report(
        worker="w3",
        outcome="failed",
        holdings=(Holding(0, 5, True), Holding(1, 6, False)),
        previous_slot=(1, 0),
        losses={4: 2.5, 5: 2.25},
        step_times={5: 0.125},
        step_ends={5: 1_780_000_000.5},
        peak_rss_mib=812.5,
        stats=WorkerStats(
            train_start_t=10.0,
            train_end_t=12.5,
            replica_checks=3,
            replica_mismatches=(ReplicaMismatch(4, 1),),
            redundant_compute_s=0.5,
            replica_sync_s=0.25,
            replica_sends_in_backward=6,
            seconds_per_logical_worker=0.1,
            rebalances=(Rebalance(4, ((0, 1), (2,))),),
            model_state=ModelStateBytes(parameters=40, optimizer=80, replica_parameters=40),
            setups=(
                GenerationSetup(0, join_s=0.5, build_s=1.25, state_s=0.0, state_bytes=0),
                GenerationSetup(2, join_s=0.25, build_s=1.0, state_s=0.5, state_bytes=4096),
            ),
        ),
        error="RuntimeError: a peer is gone",
    )
    assert Report.decode(report.encode()) == report
    view = report.planner_view()
    assert (view.worker, view.holdings, view.previous_slot) == ("w3", report.holdings, (1, 0))
    standby = Report("w4", "standby")
    assert Report.decode(standby.encode()) == standby


def test_checkpoint_write_error_json_round_trip() -> None:
    entry = CheckpointWriteError(4, "/x/step-4/stage-1.pt", "No space left", "w1")
    assert CheckpointWriteError.decode(entry.encode()) == entry
    assert entry.to_json() == {
        "step": 4,
        "path": "/x/step-4/stage-1.pt",
        "error": "No space left",
        "worker": "w1",
    }


def _key_literals(path: Path) -> list[tuple[int, str]]:
    """String literals and f-strings of ``path`` that begin like a store key."""
    heads = tuple(f"{prefix}/" for prefix in KEY_PREFIXES)
    whole = (CHECKPOINT_ERRORS_COUNTER, FINAL_HASH_KEY)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        text: str | None = None
        if isinstance(node, ast.JoinedStr):
            first = node.values[0] if node.values else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                text = first.value
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        if text is not None and (text.startswith(heads) or text in whole):
            found.append((node.lineno, text))
    return found


def test_only_the_protocol_module_spells_a_store_key() -> None:
    protocol = REPO / "integration" / "wire" / "protocol.py"
    assert _key_literals(protocol), "the scan must find the protocol's own keys"
    spelled = [
        f"{path.relative_to(REPO)}:{line}: {text!r}"
        for folder in PACKAGE_DIRS
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != protocol
        for line, text in _key_literals(path)
    ]
    assert not spelled, "store keys spelled outside spotline.wire.protocol:\n" + "\n".join(spelled)


def test_the_coordinator_imports_no_torch_deepspeed_or_transformers() -> None:
    code = (
        "import sys\n"
        "import spotline.launch.coordinator\n"
        "import spotline.launch.control.recovery\n"
        "import spotline.launch.control.input_check\n"
        "heavy = sorted(m for m in sys.modules\n"
        "               if m.split('.')[0] in ('torch', 'deepspeed', 'transformers'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_runtime_and_the_simulator_share_one_policy_vocabulary() -> None:
    import typing

    from spotline.config import RecoverySection
    from spotline.plan.policies import (
        RECOVERY_MODES,
        SIM_POLICIES,
        SIMULATED_RECOVERY,
        SIMULATOR_ONLY,
    )
    from spotline.sim.recovery_policies import RECOVERY_POLICIES as POLICIES
    from spotline.sim.sim_config import POLICIES as SIMULATED

    mode = typing.get_type_hints(RecoverySection)["mode"]
    assert typing.get_args(mode) == RECOVERY_MODES == ("failover", "checkpoint-restart")
    assert tuple(POLICIES) == RECOVERY_MODES
    assert all(policy.recovery == name for name, policy in POLICIES.items())
    assert SIMULATED == SIM_POLICIES
    # Every simulated policy but the references (the on-demand baseline, the ideal bound)
    # runs one of the runtime's policies.
    assert SIMULATOR_ONLY == ("on-demand", "ideal")
    assert set(SIMULATED_RECOVERY) == set(SIM_POLICIES) - set(SIMULATOR_ONLY)
    assert not set(SIMULATOR_ONLY) & set(RECOVERY_MODES)
    assert set(SIMULATED_RECOVERY.values()) == set(RECOVERY_MODES)


@pytest.mark.parametrize("name", ["ideal", "on-demand"])
def test_the_runtime_refuses_a_simulator_only_policy(name: str) -> None:
    """The references exist only in the simulator: a config that names one as the
    runtime's recovery mode is refused when it loads, in one line naming the real modes."""
    from conftest import small_config

    from spotline.config import parse_config
    from spotline.errors import UserError
    from spotline.plan.policies import SIMULATOR_ONLY

    assert name in SIMULATOR_ONLY
    with pytest.raises(UserError) as refused:
        parse_config(small_config(recovery={"mode": name}))
    assert str(refused.value) == (
        f"config key 'spotline.recovery.mode' is \"{name}\"; "
        'expected "failover" or "checkpoint-restart"'
    )


def test_the_checkpoint_interval_is_the_policy_s() -> None:
    from conftest import small_config

    from spotline.config import parse_config
    from spotline.sim.recovery_policies import RECOVERY_POLICIES as POLICIES

    failover, restart = POLICIES["failover"], POLICIES["checkpoint-restart"]
    given = parse_config(small_config(checkpoints={"interval_steps": 3}))
    unset = parse_config(small_config())
    assert (
        failover.checkpoint_interval(given, 10.0) == restart.checkpoint_interval(given, 10.0) == 3
    )
    assert failover.checkpoint_interval(unset, 10.0) == 0  # failover needs none by default
    assert restart.checkpoint_interval(unset, None) == 0  # no preemptions expected
    assert restart.checkpoint_interval(unset, 3600.0) > 0  # Young/Daly


def test_an_abort_is_written_for_the_record_and_for_every_members_watch() -> None:
    from spotline.wire.protocol import WATCH_RELEASED, abort_entries

    assert abort_entries(4, ["w0", "w2"], "w1") == [
        (abort_key(4), "w1"),
        (abort_watch_key(4, "w0"), "w1"),
        (abort_watch_key(4, "w2"), "w1"),
    ]
    assert abort_watch_key(4, "w0") != abort_key(4)
    with pytest.raises(AssertionError):
        abort_entries(4, ["w0"], WATCH_RELEASED)
