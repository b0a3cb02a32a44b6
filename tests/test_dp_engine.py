"""spotline.exact.dp_engine: DeepSpeed's plain data-parallel engine with the exact reduction over
logical workers trains to the same bits (every step's loss, the final parameters) whatever
the number of processes the logical workers run on; the override is what reduces (a NaN
gradient is refused on every rank, naming its logical worker); and it equals a
single-process oracle without DeepSpeed bit for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
from conftest import run_ranks  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "dp_worker.py"
NUM_LOGICAL_WORKERS = 4  # dp_worker.NUM_LOGICAL_WORKERS
CLIP = 1.0  # dp_worker.CLIP

# Placements of the 4 logical workers onto processes ("0,1;2,3": rank 0 hosts 0 and 1), and
# the logical worker whose gradient the extra, poisoned step makes NaN.
PLACEMENTS = {
    "M=1": ("0,1,2,3", 2),
    "M=2": ("0,1;2,3", 2),
    "M=4": ("0;1;2;3", 2),
    "M=2 uneven, shuffled": ("3;2,0,1", 1),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each placement's ranks' results (dp_worker's rank{r}.json), one launch each."""
    results = {}
    for name, (groups, poison) in PLACEMENTS.items():
        out = tmp_path_factory.mktemp(name.replace(" ", "_").replace(",", "").replace("=", ""))
        world = len(groups.split(";"))
        args = [str(out), groups, "--poison-worker", str(poison)]
        if world == 1:
            args.append("--oracle")
        codes = run_ranks(WORKER, world, args, timeout=150)
        assert codes == [0] * world, f"{name}: exit codes {codes}"
        results[name] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return results


def _trained(result: dict[str, Any]) -> dict[str, Any]:
    keys = ("losses", "grad_norms", "sha256", "retry_loss", "sha256_after_retry", "global_samples")
    return {k: result[k] for k in keys}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_placement_trains_to_the_same_bits(runs: dict[str, list[dict[str, Any]]]) -> None:
    reference = _trained(runs["M=1"][0])
    for name, ranks in runs.items():
        for rank, result in enumerate(ranks):
            # Exact equality: floats come back from JSON exactly as written.
            assert _trained(result) == reference, f"{name} rank {rank}"
    # Dropout is on, the parameters moved, and the clipping path ran on the reduced
    # gradients (the norm before clipping was above the limit).
    assert len(set(reference["losses"])) == len(reference["losses"])
    assert reference["grad_norms"][0] > CLIP
    # DeepSpeed counts the real global batch:
    # 4 logical workers x 2 micro-batches x 2 samples per step, whatever the placement.
    assert reference["global_samples"] == 16 * len(reference["losses"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_deepspeed_accumulates_each_process_s_own_micro_batches(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    for name, (groups, _) in PLACEMENTS.items():
        for rank, result in enumerate(runs[name]):
            hosted = len(groups.split(";")[rank].split(","))
            assert result["gradient_accumulation_steps"] == 2 * hosted  # k x m
            steps = len(result["losses"])
            assert result["global_steps"] == steps + 1  # + the retried step, not the refused one


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_nan_gradient_is_refused_on_every_rank_naming_its_logical_worker(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    for name, (_, poison) in PLACEMENTS.items():
        for rank, result in enumerate(runs[name]):
            assert result["non_finite"] == [poison], f"{name} rank {rank}"
            # No optimizer step was applied for the refused step.
            assert result["sha256_after_refused_step"] == result["sha256"], f"{name} rank {rank}"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_equals_a_single_process_oracle_without_deepspeed(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    deepspeed_run = runs["M=1"][0]
    oracle = deepspeed_run["oracle"]
    assert oracle["losses"] == deepspeed_run["losses"]
    assert oracle["grad_norms"] == deepspeed_run["grad_norms"]
    assert oracle["sha256"] == deepspeed_run["sha256"]


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage"),
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage"),
        ({"zero_optimization": {"stage": 1}}, "zero_optimization.stage"),
        ({"fp16": {"enabled": True}}, "fp16.enabled"),
        ({"bf16": {"enabled": True}}, "bf16.enabled"),
        ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation"),
        ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_key(section: dict[str, Any], key: str) -> None:
    import torch

    from spotline.exact import dp_engine

    config = {"train_micro_batch_size_per_gpu": 2, **section}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        # Refused before any process group or engine is touched.
        dp_engine.initialize(
            torch.nn.Linear(2, 2), config, num_logical_workers=2, hosted_logical_workers=[0, 1]
        )


def test_the_logical_batch_is_deepspeed_s_arithmetic_over_logical_workers() -> None:
    from spotline.exact.dp_engine import logical_batch

    n = NUM_LOGICAL_WORKERS
    both = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    assert logical_batch(both, n) == (24, 2, 3)
    assert logical_batch({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2}, n) == (
        24,
        2,
        3,
    )
    assert logical_batch({"train_batch_size": 24, "gradient_accumulation_steps": 3}, n) == (
        24,
        2,
        3,
    )
    with pytest.raises(ValueError, match="train_batch_size=20"):
        logical_batch({**both, "train_batch_size": 20}, n)
