"""Bamboo redundancy inside DeepSpeed's engine, with real processes.

- every replica equals its owner (parameters and optimizer state) after every step;
- lazy and eager redundancy never change the math (same parameter hash as off);
- the failover replay of a stage reproduces the owner's gradients and update exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, run_ranks, small_config, write_config

from spotline.config import DEFAULT_DEEPSPEED

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


# Four stages: every replica on its successor's worker, the last one's on the first (two
# stages' replicas are checked step by step by the failover replay test below).
@pytest.mark.parametrize("stages", [4])
def test_replicas_stay_bitwise_equal_and_never_change_the_math(spotline_train, stages: int) -> None:
    steps = 10
    config = small_config(training={"steps": steps}, redundancy={"verify_replicas": True})
    flags = ("--workers", str(stages), "--stages", str(stages))
    off = spotline_train(config, *flags, "--redundancy", "off", name="off")
    lazy = spotline_train(config, *flags, "--redundancy", "lazy", name="lazy")
    eager = spotline_train(config, *flags, "--redundancy", "eager", name="eager")
    # A digest of every replica and of its owner after each step, no mismatch. Lazy's
    # replica applies a step's update in the next step's bubble: after each step it is
    # checked against its owner one step back, and once more after the run's end applied
    # the last update. Eager's is up to date after each step.
    assert lazy["replica_checks"] == steps + 1
    assert eager["replica_checks"] == steps
    for run in (lazy, eager):
        assert run["replica_mismatches"] == []
        assert run["param_sha256"] == off["param_sha256"]
        assert run["losses"] == off["losses"]
        assert all(s > 0 for s in run["replica_sync_s_per_rank"])
    assert off["replica_checks"] == 0  # off holds no replica: nothing to check
    # Stage 0 sent its untied layers' gradients from inside its last backward pass, each
    # step (StreamUntiedGrads), into the receives its holder posted; no other stage did.
    for run in (lazy, eager):
        sends = run["replica_sends_in_backward_per_rank"]
        assert sends[0] > 0 and sends[0] % steps == 0 and sends[1:] == [0] * (stages - 1)
    assert off["replica_sends_in_backward_per_rank"] == [0] * stages
    assert all(s > 0 for s in eager["redundant_compute_s_per_rank"])
    assert all(s == 0 for s in lazy["redundant_compute_s_per_rank"])
    _check_model_state(off, lazy, eager, stages)
    _check_memory_estimate(config, off, lazy, stages)


def test_fused_adamw_replicas_step_to_the_owner_s_bits(spotline_train) -> None:
    """torch's fused CPU AdamW (``"fused": true`` in the optimizer's params, which DeepSpeed's
    torch_adam path passes on): about 4x faster a step than the default kernel, with other
    bits. The replica copies the owner's optimizer options, so it steps to the owner's bits
    after every step."""
    flags = ("--workers", "2", "--stages", "2", "--redundancy", "lazy")
    config = small_config(redundancy={"verify_replicas": True})
    default = spotline_train(config, *flags, name="default")
    params = {**DEFAULT_DEEPSPEED["optimizer"]["params"], "fused": True}
    config["optimizer"] = {**DEFAULT_DEEPSPEED["optimizer"], "params": params}
    fused = spotline_train(config, *flags, name="fused")
    steps = config["spotline"]["training"]["steps"]
    for run in (default, fused):
        assert run["replica_checks"] == steps + 1 and run["replica_mismatches"] == []
    # The option took effect: the two kernels' bits differ.
    assert fused["param_sha256"] != default["param_sha256"]


def _check_model_state(off, lazy, eager, stages: int) -> None:
    """The model state counted from the tensors (spotline.pipeline.memory), by kind and rank: each
    replica is exactly its successor's state; off holds none; only eager keeps a graph."""
    own = ("parameters", "gradients", "optimizer")
    extra = ("replica_parameters", "replica_gradients", "replica_optimizer", "stash")
    for rank, counts in enumerate(off["model_state_bytes_per_rank"]):
        assert counts["parameters"] > 0 and counts["gradients"] == counts["parameters"]
        # AdamW: two moments of every parameter (and a step count per tensor).
        assert counts["optimizer"] >= 2 * counts["parameters"]
        assert all(counts[k] == 0 for k in (*extra, "eager_graph")), (rank, counts)
    for run in (lazy, eager):
        ranks = run["model_state_bytes_per_rank"]
        for rank, counts in enumerate(ranks):
            successor = ranks[(rank + 1) % stages]
            # The rank's own state is the same as without redundancy.
            assert {k: counts[k] for k in own} == {
                k: off["model_state_bytes_per_rank"][rank][k] for k in own
            }
            assert counts["replica_parameters"] == successor["parameters"]
            assert counts["replica_gradients"] == successor["gradients"]
            assert counts["replica_optimizer"] == successor["optimizer"]
            assert counts["stash"] > 0
    assert all(c["eager_graph"] == 0 for c in lazy["model_state_bytes_per_rank"])
    assert all(c["eager_graph"] > 0 for c in eager["model_state_bytes_per_rank"])


def _check_memory_estimate(config, off, lazy, stages: int) -> None:
    """The estimate made before the start (spotline.plan.memory_estimate, in summary.json)
    is within 5% of what each rank counted from its tensors, kind by kind summed, with
    redundancy off and on. One pipeline: rank r runs stage r."""
    from spotline.plan.memory_estimate import COUNTED_KINDS as counted_kinds

    for run in (off, lazy):
        estimates = run["memory_estimate_per_stage"]
        assert len(estimates) == stages
        for rank, counts in enumerate(run["model_state_bytes_per_rank"]):
            estimated = sum(estimates[rank][k] for k in counted_kinds)
            measured = sum(counts[k] for k in counted_kinds)
            assert abs(estimated - measured) <= 0.05 * measured, (rank, estimates[rank], counts)
            assert estimates[rank]["activations"] > 0


# Each mode once and each stage count once: two stages (every replica wraps to the other
# worker) lazy, four stages (a chain with one wrap) eager; the mode decides only whether the
# replica's forward ran before the loss, the stage count only where the replica lives. The
# eager one in bf16: the replica's forward must run under the owner's autocast.
@pytest.mark.parametrize(
    ("stages", "mode", "precision"), [(2, "lazy", "fp32"), (4, "eager", "bf16")]
)
def test_failover_replay_reproduces_the_owner_step(
    tmp_path: Path, stages: int, mode: str, precision: str
) -> None:
    # Dropout on: the replay must also reproduce the owner's dropout masks.
    config = small_config(training={"steps": 3}, redundancy={"mode": mode})
    config["bf16"] = {"enabled": precision == "bf16"}
    config["spotline"]["topology"] = {"stages": stages, "workers": stages}
    path = write_config(tmp_path / "c.json", config)
    codes = run_ranks(
        REPO / "tests" / "workers" / "replay_worker.py", stages, [str(path), str(tmp_path)]
    )
    assert codes == [0] * stages
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(stages)]
    assert sorted(r["replica_stage"] for r in results) == list(range(stages))
    for r in results:
        assert r["replayed_grads_equal_owner"], r
        assert r["replica_changed"], r
        assert r["mismatched_stages"] == [], r
