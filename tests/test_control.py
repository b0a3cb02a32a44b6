"""The coordinator's parts read and run alone: the planner against an in-memory store.

No process is started: the store is a dict, the supervisor and the generation loop are
stand-ins with the calls the planner makes. What a plan says is read back through
spotline.wire.protocol, as a worker reads it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from conftest import small_config

from spotline.config import RunConfig, parse_config
from spotline.launch.control.checkpoints import CheckpointCommits
from spotline.launch.control.job_state import JobState
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.recovery import GenerationPlanner, LoopHooks
from spotline.plan.layout import WorkerReport, initial_layout, member_holdings
from spotline.plan.placement import exposures
from spotline.reports.timeline import summarize_recoveries
from spotline.sim.recovery_policies import RECOVERY_POLICIES as POLICIES
from spotline.wire.protocol import PlanMessage, entry_key, plan_key


class DictStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, key: str, value: int) -> int:
        total = int(self.data.get(key, b"0")) + value
        self.data[key] = str(total).encode()
        return total


class Loop:
    """The generation loop as the planner sees it: generation 1, training goes on at once."""

    def __init__(self, state: JobState) -> None:
        self.state = state

    def hooks(self) -> LoopHooks:
        return LoopHooks(
            max_progress=self.max_progress,
            wait_for_joiners=self.wait_for_joiners,
            poll_workers=self.poll_workers,
            stop_keys=self.stop_keys,
        )

    def max_progress(self) -> int:
        return self.state.resume_step + 1  # the first step after the plan started

    def wait_for_joiners(self) -> list[str]:
        raise AssertionError("no wait expected")

    def stop_keys(self, generation: int) -> None:
        pass

    def poll_workers(self) -> list[str]:
        return []


class NoExits:
    """Workers that never exit, each on its own machine."""

    def poll(self) -> list[str]:
        return []

    def machine_of(self, wid: str) -> str:
        return f"machine-of-{wid}"


def _planner(cfg: RunConfig, tmp_path: Path) -> tuple[GenerationPlanner, DictStore, RunMetrics]:
    store = DictStore()
    metrics = RunMetrics(cfg, store, snapshot=lambda: (0, 4, {}))
    checkpoints = CheckpointCommits(cfg, store, metrics, tmp_path, interval_steps=0)
    state = JobState(generation=1)
    supervisor: Any = NoExits()
    planner = GenerationPlanner(
        cfg, store, supervisor, metrics, checkpoints, state, Loop(state).hooks()
    )
    return planner, store, metrics


def _cfg() -> RunConfig:
    return parse_config(small_config(topology={"stages": 2, "workers": 4}))


def test_a_lost_member_is_taken_over_in_memory(tmp_path: Path) -> None:
    cfg = _cfg()
    planner, store, metrics = _planner(cfg, tmp_path)
    layout = initial_layout(2, 2, ["w0", "w1", "w2", "w3"], elastic=True)
    assert layout is not None
    held = member_holdings(layout, 5, replicas=True)
    survivors = [WorkerReport(w, held[w], layout.slot_of(w)) for w in ("w0", "w2", "w3")]
    metrics.note_preemption()
    POLICIES["failover"].recover(planner, survivors, reached=6, ready_t=0.0)
    plan = PlanMessage.decode(store.get(plan_key(1)))
    assert plan.action == "train" and plan.resume_step == 5 and plan.layout is not None
    assert "w1" not in plan.layout.members
    assert all(store.check([entry_key(w)]) for w in ("w0", "w2", "w3"))
    assert metrics.recoveries == 1 and metrics.steps_redone == 1 and metrics.fallbacks == 0
    assert [e["in_memory"] for e in metrics.recovery_events] == [True]


def _exposure_planner(
    workers: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[GenerationPlanner, DictStore]:
    """A planner of 2 stages on ``workers`` local workers, checkpoints every 100 steps, its
    clock stopped at 250 s (the exposed interval is Young/Daly of the bursts so far)."""
    cfg = parse_config(
        small_config(
            topology={"stages": 2, "workers": workers}, checkpoints={"interval_steps": 100}
        )
    )
    store = DictStore()
    metrics = RunMetrics(cfg, store, snapshot=lambda: (0, workers, {}))
    monkeypatch.setattr(metrics, "now", lambda: 250.0)
    checkpoints = CheckpointCommits(cfg, store, metrics, tmp_path, interval_steps=100)
    state = JobState(generation=1)
    supervisor: Any = NoExits()
    planner = GenerationPlanner(
        cfg, store, supervisor, metrics, checkpoints, state, Loop(state).hooks()
    )
    return planner, store


def _lose(planner: GenerationPlanner, store: DictStore, lost: set[str]) -> PlanMessage:
    """The running layout (held at step 5) loses ``lost`` at once; the plan after it."""
    layout = planner.layout
    assert layout is not None
    held = member_holdings(layout, 5, replicas=True)
    survivors = [WorkerReport(w, held[w], layout.slot_of(w)) for w in layout.members]
    survivors = [r for r in survivors if r.worker not in lost]
    POLICIES["failover"].recover(planner, survivors, reached=6, ready_t=0.0)
    return PlanMessage.decode(store.get(plan_key(1)))


def test_an_exposed_plan_checkpoints_at_its_first_committed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two pipelines of two stages lose w1: one pipeline is left, each stage on two workers
    (exposed: spotline.plan.exposure). Its first committed step is checkpointed, then the
    interval counts from there (no burst seen: the 100 steps)."""
    planner, store = _exposure_planner(4, tmp_path, monkeypatch)
    planner.layout = initial_layout(2, 2, ["w0", "w1", "w2", "w3"], elastic=True)
    plan = _lose(planner, store, {"w1"})
    assert plan.layout is not None and plan.layout.num_pipelines == 1
    assert (plan.resume_step, plan.checkpoint_from, plan.checkpoint_interval) == (5, 6, 100)
    # The coordinator commits those steps too, up to where the next plan resumes.
    assert planner.checkpoints.exposed_steps(300) == {6, 106, 206}
    assert planner.bursts == 0


def test_a_burst_shortens_the_exposed_interval_to_young_daly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planner, store = _exposure_planner(6, tmp_path, monkeypatch)
    planner.layout = initial_layout(2, 3, [f"w{i}" for i in range(6)], elastic=True)
    # One worker lost: two pipelines left, four copies of each stage: not exposed.
    plan = _lose(planner, store, {"w5"})
    assert plan.layout is not None and plan.layout.num_pipelines == 2
    assert (plan.checkpoint_from, plan.checkpoint_interval) == (0, 100)
    # Then two at once (a burst): one pipeline, exposed; Young/Daly with 250 s over one
    # burst and recovery.checkpoint_cost_s 0.05 s, in steps of step_time_estimate_s 0.1 s.
    plan = _lose(planner, store, set(plan.layout.members[:2]))
    assert plan.layout is not None and plan.layout.num_pipelines == 1
    assert planner.bursts == 1
    assert math.floor(math.sqrt(2 * 0.05 * 250.0) / 0.1) == 50
    assert (plan.resume_step, plan.checkpoint_from, plan.checkpoint_interval) == (5, 6, 50)
    assert planner.checkpoints.exposed_steps(120) == {6, 56, 106}
    # checkpoint-restart restarts from the checkpoint at every loss: no exposure rule.
    assert not POLICIES["checkpoint-restart"].exposure_checkpoints


def test_a_fatal_loss_without_a_checkpoint_starts_over(tmp_path: Path) -> None:
    cfg = _cfg()
    planner, store, metrics = _planner(cfg, tmp_path)
    planner.resume_step = 5
    layout = initial_layout(2, 2, ["w0", "w1", "w2", "w3"], elastic=True)
    assert layout is not None
    held = member_holdings(layout, 5, replicas=False)
    # Only stage 0's holders survive: stage 1 is held by nobody.
    survivors = [WorkerReport(w, held[w]) for w in layout.members if 0 in layout.stages_of(w)]
    POLICIES["failover"].recover(planner, survivors, reached=6, ready_t=0.0)
    plan = PlanMessage.decode(store.get(plan_key(1)))
    assert plan.action == "train" and plan.resume_step == 0 and dict(plan.holders) == {}
    assert metrics.fallbacks == 1 and metrics.steps_redone == 6
    kinds = [e.kind for e in metrics.events]
    assert kinds[-3:] == ["fatal-loss", "restart-from-scratch", "recovered"]
    assert [e["in_memory"] for e in metrics.recovery_events] == [False]
    # A fallback is a recovery too: the run's count, its recovery_events and the timeline's
    # recovery_summary are one number (the count left fallbacks out: 2 against 3).
    assert metrics.recoveries == 1 == len(metrics.recovery_events)
    assert summarize_recoveries(metrics.timeline.rows)["num_recoveries"] == 1


def test_the_coordinator_commits_the_workers_files_and_finds_the_checkpoint(
    tmp_path: Path,
) -> None:
    """The coordinator's half of a checkpoint (spotline.checkpointing.manifest, no torch): it
    commits a step once every stage's file and sidecar is there, with the losses and
    learning rates before it, and finds it again (a changed file is skipped)."""
    import hashlib
    import json

    from spotline.checkpointing.manifest import read_metadata, step_dir
    from spotline.wire.protocol import loss_key, loss_scale_key, lr_key, skipped_key

    cfg = _cfg()
    store = DictStore()
    metrics = RunMetrics(cfg, store, snapshot=lambda: (0, 4, {}))
    checkpoints = CheckpointCommits(cfg, store, metrics, tmp_path, interval_steps=2)
    for s, (loss, lr) in enumerate([(2.5, 0.001), (2.25, 0.002)]):
        store.set(loss_key(s), str(loss))
        store.set(lr_key(s), str(lr))
        store.set(loss_scale_key(s), "1.0")
    store.set(skipped_key(1), "1")  # fp16's overflow skipped step 1
    directory = step_dir(cfg.checkpoint_root(tmp_path), 2)
    directory.mkdir(parents=True)
    checkpoints.commit(last=2)
    assert checkpoints.committed == set() and checkpoints.latest() is None  # nothing written
    for label in ("stage-0", "stage-1"):
        data = label.encode() * 3  # what a worker's torch.save wrote, as bytes
        (directory / f"{label}.pt").write_bytes(data)
        meta = {
            "file": f"{label}.pt",
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        (directory / f"{label}.meta.json").write_text(json.dumps(meta))
    checkpoints.commit(last=2)
    assert checkpoints.committed == {2} and checkpoints.latest() == 2
    metadata = read_metadata(checkpoints.root, 2)
    # The run's record as of the commit: what a resume after a crash goes on from.
    record = metadata.pop("record")
    assert [(p["from_step"], p["reached_step"], p["how"]) for p in record["parts"]] == [
        (0, 2, "running")
    ]
    assert metadata == {
        "losses": {"0": 2.5, "1": 2.25},
        "learning_rates": {"0": 0.001, "1": 0.002},
        "loss_scales": {"0": 1.0, "1": 1.0},
        "skipped_steps": {"1": 1.0},
    }
    (directory / "stage-1.pt").write_bytes(b"stage-1" * 3 + b"!")
    assert checkpoints.latest() is None


class Waits(Loop):
    """A generation loop that counts the planner's waits for arrivals."""

    waits = 0

    def wait_for_joiners(self) -> list[str]:
        self.waits += 1
        return []


def test_too_few_survivors_for_the_memory_limit_wait_with_the_state_kept(tmp_path: Path) -> None:
    """Issue 14: four stages run by two workers, two each (each holds the other's stages as
    its replica); one lost. Two stages per worker (the default): the survivor may not run
    all four, so the coordinator publishes no layout, says so (an event, in summary.json
    too) and waits for an arrival; nothing falls back. Four per worker: it runs all four."""
    for stages_per_worker in (2, 4):
        cfg = parse_config(
            small_config(
                topology={"stages": 4, "workers": 4},
                redundancy={"stages_per_worker": stages_per_worker},
            )
        )
        planner, store, metrics = _planner(cfg, tmp_path / str(stages_per_worker))
        loop = Waits(planner.state)
        planner.loop = loop.hooks()
        layout = initial_layout(4, 1, ["w0", "w1"], elastic=True)
        assert layout is not None and layout.groups == ((0, 1), (2, 3))
        held = member_holdings(layout, 5, replicas=True)
        metrics.note_preemption()
        survivor = [WorkerReport("w0", held["w0"], layout.slot_of("w0"))]
        POLICIES["failover"].recover(planner, survivor, reached=6, ready_t=0.0)
        plan = PlanMessage.decode(store.get(plan_key(1)))
        kinds = [e.kind for e in metrics.events]
        if stages_per_worker == 2:
            assert plan.layout is None and plan.resume_step == 5 and loop.waits == 1
            assert kinds == ["waiting-for-capacity"]
            assert metrics.events[0].detail == {
                "live": 1,
                "needed": 2,
                "stages": 4,
                "stages_per_worker": 2,
            }
            assert metrics.fallbacks == 0 and planner.layout is None
        else:
            assert plan.layout is not None and loop.waits == 0
            assert plan.layout.groups == ((0, 1, 2, 3),) and plan.resume_step == 5
            assert "waiting-for-capacity" not in kinds and metrics.fallbacks == 0


def test_sharded_replicas_are_placed_so_that_no_machine_loss_loses_a_stage(tmp_path: Path) -> None:
    """Machines m0 (1 slot), m1 (3), m2 (2), 2 stages x 2 pipelines with sharded replicas; m0
    is lost. Placed by the full replicas' rule, m1 would run both owners of stage 0 and a
    shard holder of it (losing m1 would lose stage 0); the planner places for the shards."""
    cfg = parse_config(
        small_config(
            topology={"stages": 2, "workers": 4},
            redundancy={"mode": "lazy", "replica": "sharded"},
        )
    )
    planner, store, _ = _planner(cfg, tmp_path)
    assert planner.sharded
    machines = {"m0s0": "m0", **{f"m1s{k}": "m1" for k in range(3)}}
    machines |= {f"m2s{k}": "m2" for k in range(2)}
    first = initial_layout(2, 2, list(machines), elastic=True, machines=machines, sharded=True)
    assert first is not None and exposures(first, machines, sharded=True) == ()
    planner.layout = first
    held = member_holdings(first, 5, replicas=True, sharded=True)
    survivors = [
        WorkerReport(w, held.get(w, ()), first.slot_of(w) if w in held else None, m)
        for w, m in machines.items()
        if m != "m0"
    ]
    POLICIES["failover"].recover(planner, survivors, reached=6, ready_t=0.0)
    plan = PlanMessage.decode(store.get(plan_key(1)))
    assert plan.action == "train" and plan.layout is not None
    assert exposures(plan.layout, machines, sharded=True) == ()
    assert exposures(plan.layout, machines) == ()  # safe for full replicas as well


def test_a_watch_turn_is_quiet_only_while_no_key_was_added_and_a_full_one_is_recent() -> None:
    import torch.distributed as dist

    from spotline.launch.control.watch import QuietTurns

    store = dist.HashStore()  # a real c10d store: its key count is what the gate reads
    turns = QuietTurns(store, full_turn_s=0.5)
    assert not turns.quiet(now=0.0)  # the first turn is full
    assert turns.quiet(now=0.1)
    store.set("hb/w0", "1.0")  # a key added (an exit, a report, a loss...): full
    assert not turns.quiet(now=0.2) and turns.quiet(now=0.3)
    store.set("hb/w0", "2.0")  # overwritten (a heartbeat, a step's progress): still quiet
    assert turns.quiet(now=0.6)
    assert not turns.quiet(now=0.75)  # but never longer than full_turn_s after a full turn
    assert turns.quiet(now=0.85)
