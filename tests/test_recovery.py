"""Real kills of real worker processes: training continues from in-memory replicas and ends
with exactly the parameters of the undisturbed run.

Every test runs `spotline train` (coordinator + worker processes on gloo) with faults
delivered by `--inject` (the worker kills itself at the named step and phase, or the
coordinator signals several workers together), a trace, or a checkpoint-restart policy, and
compares `param_sha256` with the undisturbed run of the same config.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from components import missing
from conftest import REPO, small_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 6
# Dropout on (gpt2-tiny's default): the takeover must also reproduce the dropout masks.
CONFIG = small_config(training={"steps": STEPS}, redundancy={"mode": "lazy"})
TOPOLOGIES = {
    "1x4": ("--workers", "4", "--stages", "4"),
    "2x2": ("--workers", "4", "--stages", "2"),
}


@pytest.fixture(scope="module")
def baselines(tmp_path_factory) -> dict[str, str]:
    from conftest import read_summary, run_spotline, write_config

    root = tmp_path_factory.mktemp("baselines")
    out = {}
    for name, flags in TOPOLOGIES.items():
        cfg = write_config(root / f"{name}.json", CONFIG)
        proc = run_spotline(["train", "--config", str(cfg), "--output", str(root / name), *flags])
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = read_summary(root / name)
        assert summary["preemptions"] == 0 and summary["recoveries"] == 0
        out[name] = summary["param_sha256"]
    return out


@pytest.mark.parametrize(
    ("topology", "inject", "variant"),
    [
        # Stage 1 lost in its first forward of step 4: its holder (stage 0) applies a step's
        # replica update in the next step's last bubble, so it still waits with step 3's
        # gradients; the recovery applies them ("ready") before the takeover.
        ("1x4", "kill:4:1:forward", "lazy"),
        # Membership through an etcd the test starts on loopback instead of the TCPStore.
        ("1x4", "kill:3:1:send", "etcd"),
        ("1x4", "kill:2:0:recv", "lazy"),
        ("1x4", "kill:3:1:optimizer", "lazy"),
        # Eager redundancy (the replica's step run with the owner's): the same takeover.
        ("1x4", "kill:5:3:backward", "eager"),
        # The last stage lost just past the commit: the survivors apply the step, and its loss
        # (which DeepSpeed sends from the last stage only after the update) is already theirs.
        ("1x4", "kill:3:3:committed", "lazy"),
        ("2x2", "kill:4:3:forward", "lazy"),
        ("2x2", "kill:3:0:optimizer", "lazy"),
        ("2x2", "kill:2:2:recv", "lazy"),
    ],
)
def test_sigkill_mid_step_is_taken_over_from_memory(
    spotline_train, baselines, topology, inject, variant, tmp_path: Path
) -> None:
    # Checkpoints every 100 steps: none due in 6 but those of the exposure rule.
    flags = ("--checkpoint-interval", "100", "--inject", inject)
    config = CONFIG
    if variant == "eager":
        config = small_config(training={"steps": STEPS}, redundancy={"mode": "eager"})
    with contextlib.ExitStack() as stack:
        if variant == "etcd":
            from spotline.wire.stores import ETCD_BINARY, start_local_etcd

            if not Path(ETCD_BINARY).exists():
                missing("etcd", f"{ETCD_BINARY} is absent: apt-get install -y etcd-server")
            etcd = stack.enter_context(start_local_etcd(tmp_path / "etcd"))
            flags += ("--store", "etcd", "--etcd-endpoint", etcd.endpoint)
        summary = spotline_train(config, *TOPOLOGIES[topology], *flags)
    assert summary["param_sha256"] == baselines[topology]
    assert summary["redundancy"] == ("eager" if variant == "eager" else "lazy")
    assert summary["preemptions"] == 1
    assert summary["recoveries"] == 1
    assert summary["checkpoint_fallbacks"] == 0  # in memory, not from disk
    (event,) = summary["recovery_events"]
    assert event["recovery_s"] > 0
    assert all(loss is not None for loss in summary["losses"])
    # Every member set the recovery's generation up phase by phase, and moved state for it
    # (each receives its replica from its successor); the takeover bench splits on these.
    from spotline.launch.bench.takeover import takeover_phases

    g = event["generation"]
    setups = {
        w: {entry["generation"]: entry for entry in entries}
        for w, entries in summary["generation_setups"].items()
    }
    assert all(0 in gens for gens in setups.values())
    members = [w for w, gens in setups.items() if g in gens]
    assert 2 <= len(members) <= 3, setups
    assert all(setups[w][g]["state_bytes"] > 0 for w in members), setups
    phases = takeover_phases(summary)
    assert phases["recovery_s"] == event["recovery_s"]
    # spotline.tracking.timeline_png false (the tests' config): the rows, not the plot.
    assert (tmp_path / "run" / "timeline.csv").exists()
    assert not (tmp_path / "run" / "timeline.png").exists()
    assert phases["redo_s"] == summary["step_times_s"][event["resume_step"]]
    # Each step's end, as its last run measured it: in step order (a redone step's end is
    # its second run's), each after its own start.
    ends = summary["step_ended_at_s"]
    assert len(ends) == len(summary["step_times_s"]) and None not in ends
    assert ends == sorted(ends) and len(set(ends)) == len(ends)
    assert phases["state_s"] == max(setups[w][g]["state_s"] for w in members)
    # Exposure checkpoints (spotline.plan.exposure): 2x2 is down to one pipeline, each
    # stage on two workers, so the new generation's first committed step is checkpointed;
    # 1x4 was exposed from the start (a start is no first exposure): nothing is. One loss
    # is no burst: the interval stays at 100.
    from spotline.checkpointing.manifest import latest_complete, step_dirs

    root = tmp_path / "run" / "checkpoints"
    if topology == "2x2":
        (failover,) = [e for e in summary["events"] if e["kind"] == "plan" and "resume" in e]
        assert [step for step, _ in step_dirs(root)] == [failover["resume"] + 1]
        assert latest_complete(root) == failover["resume"] + 1
        assert summary["exposure_checkpoints"] == 1
    else:
        assert step_dirs(root) == [] and summary["exposure_checkpoints"] == 0


def _stage_numels(stages: int) -> dict[int, list[tuple[str, int]]]:
    """Logical stage -> its parameters' (name, numel), sorted by name: the names the
    pipeline's layers give (global layer index first), built as a worker builds them."""
    from spotline.models import layers as models

    hf_config = models.load_hf_config(CONFIG["spotline"]["model"]["name"])
    specs = models.build_layer_specs(hf_config, seed=CONFIG["spotline"]["training"]["seed"])
    parts = models.logical_parts(hf_config, stages)
    out: dict[int, list[tuple[str, int]]] = {}
    for stage in range(stages):
        named = [
            (f"{layer}.{name}", p.numel())
            for layer in range(parts[stage], parts[stage + 1])
            for name, p in specs[layer].build().named_parameters()
        ]
        out[stage] = sorted(named)
    models.release_weight_source(specs)
    return out


def test_both_owners_of_a_stage_lost_it_is_assembled_from_the_sharded_replicas(
    spotline_train, baselines
) -> None:
    """``replica: sharded``, 2 stages x 2 pipelines: stage 0 of pipeline p holds shard p of
    stage 1. Two workers arrive for step 4 (standbys), then both owners of stage 1 (w2, w3)
    die just past step 5's commit: stage 1 survives only as the two shards, rolled forward
    and assembled by the standbys that take it over; the bits are the full replicas' (the
    undisturbed 2x2 run's), and each replica holds exactly its shard's elements."""
    config = small_config(
        training={"steps": STEPS},
        redundancy={"mode": "lazy", "replica": "sharded", "verify_replicas": True},
    )
    summary = spotline_train(
        config,
        *TOPOLOGIES["2x2"],
        "--checkpoint-interval",
        "100",
        "--inject",
        "add:4",
        "--inject",
        "add:4",
        "--inject",
        "kill:5:2:committed",
        "--inject",
        "kill:5:3:committed",
    )
    assert summary["param_sha256"] == baselines["2x2"]  # sharding changes no bit
    assert summary["preemptions"] == 2 and summary["recoveries"] == 1
    assert summary["checkpoint_fallbacks"] == 0  # from the shards, in memory
    (event,) = summary["recovery_events"]
    assert event["in_memory"] and event["resume_step"] == 5  # step 5 was rolled forward
    assert summary["replica_checks"] >= 1 and summary["replica_mismatches"] == []
    # The last layout: stage 0 on w0 (pipeline 0) and w1, stage 1 on the arrivals, which
    # received it from the shards (their only generation).
    setups = summary["generation_setups"]
    assert all(len(setups[w]) == 1 and setups[w][0]["state_bytes"] > 0 for w in ("w4", "w5"))
    from spotline.plan.shards import shard_pieces

    numels = _stage_numels(2)
    ranks = summary["model_state_bytes_per_rank"]
    for rank, counts in enumerate(ranks):
        stage, pipeline = divmod(rank, 2)  # pipe-major ranks
        successor = (stage + 1) % 2
        mine = shard_pieces(numels[successor], pipeline, 2)
        theirs = shard_pieces(numels[successor], 1 - pipeline, 2)
        held, other = sum(x.numel for x in mine), sum(x.numel for x in theirs)
        full = sum(k for _, k in numels[successor])
        assert counts["parameters"] == 4 * sum(k for _, k in numels[stage])
        # float32: exactly the shard's elements, parameters and received gradients alike.
        assert counts["replica_parameters"] == counts["replica_gradients"] == 4 * held
        # Half of the full replica, exactly: the two shards differ by one element at most.
        assert held + other == full and abs(held - other) <= 1
        assert counts["stash"] == 0  # nothing to replay from
        # exp_avg and exp_avg_sq of each element, and each piece's step count (a float32
        # scalar of its own).
        assert counts["replica_optimizer"] == 8 * held + 4 * len(mine)
        # The two shards' optimizer state is the owner's, split: one more step count for
        # each tensor the split cuts in two.
        pair = ranks[stage * 2 + (1 - pipeline)]
        owner = ranks[successor * 2 + pipeline]
        cut = len(mine) + len(theirs) - sum(1 for _, k in numels[successor] if k > 0)
        assert counts["replica_optimizer"] + pair["replica_optimizer"] == owner["optimizer"] + (
            4 * cut
        )


@pytest.mark.parametrize("topology", ["1x4", "2x2"])
def test_sigterm_leaves_cleanly_and_a_hung_worker_is_killed_and_taken_over(
    spotline_train, baselines, topology
) -> None:
    """w3 hangs mid-backward of step 3 (SIGSTOP: alive, its heartbeat thread frozen with it),
    is found by its missed heartbeat, killed, and its stage taken over from memory; w1 gets
    a preemption notice at the start of step 5 (a member or standby in the new layout, whichever it is)
    and leaves at a step boundary. A 3 s heartbeat timeout: the timeouts decide no bit of
    the result."""
    config = small_config(
        training={"steps": STEPS},
        redundancy={"mode": "lazy"},
        recovery={"heartbeat_timeout_s": 3},
    )
    flags = ("--inject", "stop:3:3:backward", "--inject", "term:5:1")
    summary = spotline_train(config, *TOPOLOGIES[topology], *flags)
    assert summary["param_sha256"] == baselines[topology]
    assert summary["preemptions"] == 1  # the notice; a hang is a loss, not a preemption
    assert summary["checkpoint_fallbacks"] == 0
    kinds = [(e["kind"], e.get("worker")) for e in summary["events"]]
    # Its notice is delivered (it leaves as a member or exits as a standby).
    assert ("preempted", "w1") in kinds
    (missed,) = [e for e in summary["events"] if e["kind"] == "heartbeat-missed"]
    assert missed["worker"] == "w3" and missed["silent_s"] >= 3
    first = summary["recovery_events"][0]
    assert first["in_memory"] and first["resume_step"] == 2  # after 2 steps: step 3 redone
    # The hang is counted as one (not a preemption), and its recovery as the others are.
    assert summary["hung_workers"] == 1
    assert summary["recoveries"] == len(summary["recovery_events"])
    assert summary["recovery_summary"]["num_recoveries"] == summary["recoveries"]


def test_kill_then_arrival_rebuilds_the_pipelines(
    spotline_train, baselines, tmp_path: Path
) -> None:
    drawn = small_config(
        training={"steps": STEPS}, redundancy={"mode": "lazy"}, tracking={"timeline_png": True}
    )
    summary = spotline_train(
        drawn, *TOPOLOGIES["2x2"], "--inject", "kill:3:1:backward", "--inject", "add:5"
    )
    assert summary["param_sha256"] == baselines["2x2"]
    kinds = [e["kind"] for e in summary["events"]]
    assert "preempted" in kinds and "arrived" in kinds
    # The newcomer got state by transfer from live workers: it is in the last layout.
    plans = [e for e in summary["events"] if e["kind"] == "plan"]
    assert plans[-1]["stages"] == "0/1"  # two physical stages again, not merged
    assert summary["checkpoint_fallbacks"] == 0
    assert (tmp_path / "run" / "timeline.csv").read_text().count("\n") > 3
    assert (tmp_path / "run" / "timeline.png").stat().st_size > 1000


def test_adjacent_workers_lost_together_fall_back_to_the_checkpoint(
    spotline_train, baselines
) -> None:
    """Stage 2's owner (w2) and its replica holder (w1) die at once: a fatal loss."""
    summary = spotline_train(
        CONFIG,
        *TOPOLOGIES["1x4"],
        "--checkpoint-interval",
        "2",
        "--inject",
        "kill:6:1",
        "--inject",
        "kill:6:2",
    )
    assert summary["param_sha256"] == baselines["1x4"]
    assert summary["preemptions"] == 2
    assert summary["checkpoint_fallbacks"] == 1
    fallback = [e for e in summary["events"] if e["kind"] == "checkpoint-fallback"]
    assert fallback and fallback[0]["step"] == 4  # after 4 steps: 5.. replayed deterministically
    assert summary["steps_redone"] >= 1
    # The coordinator committed, found and read that checkpoint without the training code:
    # its process held torch (the store's) and nothing else heavy.
    assert summary["coordinator_heavy_modules"] == ["torch"]


def test_checkpoint_restart_baseline_gives_the_same_result(spotline_train, baselines) -> None:
    summary = spotline_train(
        CONFIG,
        *TOPOLOGIES["1x4"],
        "--recovery",
        "checkpoint-restart",
        "--checkpoint-interval",
        "2",
        "--inject",
        "kill:4:2:forward",
    )
    assert summary["param_sha256"] == baselines["1x4"]
    assert summary["recovery_mode"] == "checkpoint-restart"
    assert summary["checkpoint_fallbacks"] == 1
    assert any(e["kind"] == "restart-all" for e in summary["events"])


def test_trace_replay_completes_with_the_same_hash(spotline_train, tmp_path: Path) -> None:
    trace = REPO / "integration" / "assets" / "traces" / "g4dn-trace.csv"
    config = small_config(training={"steps": 60}, redundancy={"mode": "lazy"})
    flags = ("--workers", "2", "--stages", "2")
    undisturbed = spotline_train(config, *flags, name="undisturbed")
    # On the step clock a step is 0.1 s x 300 = 30 s of trace: the g4dn trace (capped at 3
    # workers) starts with one node, adds two by step 4, removes one at steps 32, 36 and 40
    # (the last one a total loss: a checkpoint fallback) and adds three by step 44; the
    # same on any machine, however slowly it starts processes.
    replayed = spotline_train(
        config,
        *flags,
        "--max-workers",
        "3",
        "--trace",
        str(trace),
        "--time-scale",
        "300",
        "--trace-clock",
        "steps",
        "--checkpoint-interval",
        "5",
        name="replayed",
    )
    assert replayed["preemptions"] >= 3
    assert replayed["checkpoint_fallbacks"] == 1
    assert replayed["param_sha256"] == undisturbed["param_sha256"]


def test_random_preemptions_complete_with_the_same_hash(spotline_train) -> None:
    """`--preempt-rate R --seed S`: seeded random preemptions with replacements."""
    config = small_config(training={"steps": 40}, redundancy={"mode": "lazy"})
    flags = ("--workers", "2", "--stages", "2")
    undisturbed = spotline_train(config, *flags, name="undisturbed")
    disturbed = spotline_train(
        config,
        *flags,
        "--max-workers",
        "3",
        "--preempt-rate",
        "20",
        "--time-scale",
        "60",
        "--trace-clock",
        "steps",
        "--checkpoint-interval",
        "5",
        name="disturbed",
    )
    # Seed 7 on the step clock (a step is 6 s of trace): removals after 5, 12, 21 and 44
    # steps of training (redone steps count), the one at 12 taking the last worker (back to
    # the checkpoint of step 10, or to the start where it is not committed yet), and
    # replacements at 12, 19 and 29.
    assert disturbed["preemptions"] >= 3
    assert disturbed["checkpoint_fallbacks"] == 1
    assert disturbed["param_sha256"] == undisturbed["param_sha256"]
    # Every step's loss survives the workers that computed it.
    assert disturbed["losses"] == undisturbed["losses"]


def test_a_long_generation_with_a_standby_is_not_taken_for_a_hang(
    spotline_train, tmp_path: Path
) -> None:
    """A standby reports at once; only members' reports may start the hang clock. With the
    clock started by the standby, both members were killed as "unresponsive" once the
    generation outlived collective_timeout_s + 5 s (found replaying a trace at 30x)."""
    config = small_config(
        training={"steps": 300}, redundancy={"mode": "lazy"}, recovery={"collective_timeout_s": 3.0}
    )
    summary = spotline_train(config, "--workers", "2", "--stages", "2", "--inject", "add:3")
    kinds = [event["kind"] for event in summary["events"]]
    assert "unresponsive" not in kinds
    assert summary["preemptions"] == 0 and summary["checkpoint_fallbacks"] == 0
    # The standby really stood by through a generation longer than the hang limit.
    assert summary["generations"] >= 2 and kinds.count("joined") == 1
    # The timeline's throughput: a committed samples/s row about every second of training.
    rows = (tmp_path / "run" / "timeline.csv").read_text().splitlines()
    rates = [float(r.split(",")[5]) for r in rows[1:] if r.split(",")[1] == "throughput"]
    assert len(rates) >= 3 and max(rates) > 0
