"""The recovery policies' one home (spotline.sim.recovery_policies): each runtime policy is one
class, whose runtime face the coordinator calls and whose simulator face the replay calls."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from typing import ClassVar

from spotline.plan.layout import WorkerReport
from spotline.plan.policies import SIMULATED_RECOVERY
from spotline.plan.traces import Trace, TraceEvent
from spotline.sim.recovery_policies import RECOVERY_POLICIES, FailoverPolicy
from spotline.sim.sim_config import SimConfig
from spotline.sim.simulator import POLICY_MODELS, simulate

REPO = Path(__file__).resolve().parents[1]


def test_the_simulator_replays_the_runtime_s_own_policy_objects() -> None:
    assert all(policy.recovery == mode for mode, policy in RECOVERY_POLICIES.items())
    assert POLICY_MODELS["spotline"] is RECOVERY_POLICIES["failover"]
    assert POLICY_MODELS["checkpoint-restart"] is RECOVERY_POLICIES["checkpoint-restart"]
    # The rigid variant is the failover class with the planner's elastic mode off.
    assert isinstance(POLICY_MODELS["spotline-rigid"], FailoverPolicy)
    for name, mode in SIMULATED_RECOVERY.items():
        assert isinstance(POLICY_MODELS[name], type(RECOVERY_POLICIES[mode])), name


class Recorder:
    """A planner that records what a policy's runtime face asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def replan(
        self, reports: list[WorkerReport], *, failure: bool, reached: int, ready_t: float
    ) -> None:
        self.calls.append(("replan", tuple(reports), failure, reached, ready_t))

    def restart_all(self, reports: list[WorkerReport], reached: int) -> None:
        self.calls.append(("restart_all", tuple(reports), reached))


def test_a_failure_is_a_replan_under_failover_and_a_restart_under_checkpoint_restart() -> None:
    reports = [WorkerReport("w0"), WorkerReport("w1", machine="m1")]
    failover, restart = Recorder(), Recorder()
    RECOVERY_POLICIES["failover"].recover(failover, reports, reached=6, ready_t=2.5)
    RECOVERY_POLICIES["checkpoint-restart"].recover(restart, reports, reached=6, ready_t=2.5)
    assert failover.calls == [("replan", tuple(reports), True, 6, 2.5)]
    assert restart.calls == [("restart_all", tuple(reports), 6)]


def test_one_exposure_flag_drives_the_coordinator_and_the_replay(toy_config: SimConfig) -> None:
    """The flag the coordinator's planner reads (``exposure_checkpoints``) also decides
    whether the replay takes exposure checkpoints: a burst at 1000 s leaves one exposed
    pipeline (tests/test_sim.py has the timeline)."""

    class NoExposureCheckpoints(FailoverPolicy):
        exposure_checkpoints: ClassVar[bool] = False

    events = tuple(TraceEvent(0.0, "add", f"n{i}") for i in range(4)) + (
        TraceEvent(1000.0, "remove", "n0"),
        TraceEvent(1000.0, "remove", "n1"),
    )
    trace = Trace(events, 1200.0)
    exposed = simulate(trace, "spotline", toy_config)
    assert (exposed.exposure_checkpoints, exposed.checkpoint_s) == (2, 30.0)
    plain = NoExposureCheckpoints().simulate(trace, toy_config, None)
    # Only the long interval's checkpoint at 675 s.
    assert (plain.exposure_checkpoints, plain.checkpoint_s) == (0, 10.0)


def _package_files() -> list[Path]:
    return [
        path
        for root in ("integration", "launch", "patches")
        for path in sorted((REPO / root).rglob("*.py"))
        if "assets" not in path.parts
    ]


def test_the_simulator_s_files_and_classes_have_names_of_their_own() -> None:
    """No file or class of spotline.sim shares its name with another in the package (there
    were two CheckpointRestartPolicy classes, one in the simulator, one in the control)."""
    files = _package_files()
    sim = [path for path in files if path.parent == REPO / "integration" / "sim"]
    file_names = Counter(path.name for path in files if path.name != "__init__.py")
    assert [p.name for p in sim if file_names[p.name] > 1] == []
    classes: Counter[str] = Counter()
    sim_classes: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] += 1
                if path in sim:
                    sim_classes.add(node.name)
    assert sorted(name for name in sim_classes if classes[name] > 1) == []
