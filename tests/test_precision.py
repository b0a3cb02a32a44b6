"""bf16 and fp16 mixed precision end to end: every recovery keeps the bits.

``"bf16": {"enabled": true}`` trains with fp32 master weights and fp32 optimizer state (the
state of record) and the forward and backward under bf16 autocast. Each test runs `spotline
train` (coordinator + real worker processes on gloo, dropout on) in bf16 and compares
`param_sha256` and every step's loss exactly with the undisturbed bf16 run of the same
logical topology (4 logical workers of 2 stages, lazy redundancy): a SIGKILL mid-backward
taken over from memory, a rescale of 4 -> 2 -> 4 processes, a fatal loss restored from a
checkpoint, and the four logical workers on 4, 2 and 1 processes of one stage. Elsewhere:
eager's replica forward under autocast (test_redundancy.py's replay), a Ctrl-C continued by
``--resume`` (test_resume_and_disk.py, in fp16) and the pure parts (the config's precision,
autocast in the recomputation: test_config.py, test_models.py).

fp16 (``"fp16": {"enabled": true}``: the same fp32 master, fp16 autocast, DeepSpeed's
dynamic loss scaler keys) runs the same recoveries against its own undisturbed run, whose
scale overflows at once: the skipped steps, every step's scale and rate, the hash and the
losses must all match, so the scaler's state moved with every stage (the scaler itself:
test_loss_scale.py; a holding's roll-forward of a skipped step: test_worker_parts.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import read_summary, run_spotline, small_config, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 8
BF16 = {"bf16": {"enabled": True}}
CONFIG = {**small_config(training={"steps": STEPS}, redundancy={"mode": "lazy"}), **BF16}
LOGICAL = ("--logical-workers", "4")
TWO_BY_TWO = ("--workers", "4", "--stages", "2", *LOGICAL)


def same_run(summary: dict[str, Any], baseline: dict[str, Any]) -> None:
    assert summary["param_sha256"] == baseline["param_sha256"]
    assert summary["losses"] == baseline["losses"]  # exact floats, every step


def undisturbed(tmp_path_factory: Any, name: str, config: dict[str, Any]) -> dict[str, Any]:
    """The undisturbed run of ``config``: 4 logical workers on 2 pipelines of 2 stages."""
    root = tmp_path_factory.mktemp(name)
    cfg = write_config(root / "c.json", config)
    proc = run_spotline(["train", "--config", str(cfg), "--output", str(root / "run"), *TWO_BY_TWO])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(root / "run")
    assert summary["preemptions"] == 0
    return summary


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: Any) -> dict[str, Any]:
    return undisturbed(tmp_path_factory, "bf16", CONFIG)


def test_bf16_is_in_force_and_the_exported_model_is_in_the_asked_dtype(
    spotline_train, baseline, tmp_path: Path
) -> None:
    import torch
    import transformers

    fp32_config = small_config(
        training={"steps": STEPS}, redundancy={"mode": "lazy"}, export={"dtype": "bfloat16"}
    )
    # One process running the four logical workers: the baseline's math, but for the
    # precision (test_easyscale.py shows the placement does not change the bits).
    fp32 = spotline_train(fp32_config, "--workers", "1", "--stages", "1", *LOGICAL)
    assert fp32["param_sha256"] != baseline["param_sha256"]
    assert fp32["losses"][0] != baseline["losses"][0]
    # The hash is over the fp32 master weights; the file holds spotline.export.dtype's.
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_sigkill_mid_backward_is_taken_over_from_memory(spotline_train, baseline) -> None:
    flags = ("--checkpoint-interval", "100", "--inject", "kill:3:1:backward")
    summary = spotline_train(CONFIG, *TWO_BY_TWO, *flags)
    same_run(summary, baseline)
    assert summary["preemptions"] == 1 and summary["recoveries"] == 1
    assert summary["checkpoint_fallbacks"] == 0  # in memory: no checkpoint read
    assert summary["recovery_events"][0]["in_memory"]


def test_a_rescale_of_four_two_four_processes_keeps_the_bits(spotline_train, baseline) -> None:
    summary = spotline_train(CONFIG, *TWO_BY_TWO, "--rescale", "3:2,5:4")
    same_run(summary, baseline)
    sizes = [len(p["pipelines"]) for p in summary["logical_placements"]]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
    assert summary["checkpoint_fallbacks"] == 0


def test_a_fatal_loss_restored_from_a_checkpoint_keeps_the_bits(spotline_train, baseline) -> None:
    # Redundancy off: both stage-0 workers hold stage 0's only copies; the survivors restore
    # the checkpoint of step 2 (fp32 master weights and Adam state) on one pipeline.
    flags = ("--redundancy", "off", "--checkpoint-interval", "2")
    summary = spotline_train(
        CONFIG, *TWO_BY_TWO, *flags, "--inject", "kill:3:0", "--inject", "kill:3:1"
    )
    same_run(summary, baseline)
    assert summary["checkpoint_fallbacks"] == 1


def test_four_logical_workers_on_four_two_and_one_processes_of_one_stage(
    spotline_train, baseline
) -> None:
    # One stage instead of two: the stage count does not change the bits (no clipping
    # here), so the same baseline holds while the processes go 4 -> 2 -> 1.
    summary = spotline_train(
        CONFIG, "--workers", "4", "--stages", "1", *LOGICAL, "--rescale", "3:2,5:1"
    )
    same_run(summary, baseline)
    sizes = [len(p["pipelines"]) for p in summary["logical_placements"]]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 1, sizes


# -- fp16 ---------------------------------------------------------------------------------
# A scale high enough to overflow at once and a short window, so that eight steps hold
# skipped steps (the first two: hysteresis 2), applied ones, and a growth that overflows
# again; a warm-up schedule, whose position a skipped step holds back.
FP16 = {
    "fp16": {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 2},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.002, "warmup_num_steps": 6},
    },
}
FP16_CONFIG = {**small_config(training={"steps": STEPS}, redundancy={"mode": "lazy"}), **FP16}


def warmup_lr(position: int) -> float:
    """DeepSpeed's WarmupLR at schedule position ``position`` (the oracle)."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupLR

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = WarmupLR(optimizer, **FP16["scheduler"]["params"])  # type: ignore[index]
    for _ in range(position):
        optimizer.step()
        scheduler.step()
    return float(optimizer.param_groups[0]["lr"])


@pytest.fixture(scope="module")
def fp16_baseline(tmp_path_factory: Any) -> dict[str, Any]:
    return undisturbed(tmp_path_factory, "fp16", FP16_CONFIG)


def same_fp16_run(summary: dict[str, Any], baseline: dict[str, Any]) -> None:
    same_run(summary, baseline)
    assert summary["skipped_steps"] == baseline["skipped_steps"]
    assert summary["loss_scales"] == baseline["loss_scales"]
    assert summary["learning_rates"] == baseline["learning_rates"]


def test_fp16_skips_overflowed_steps_and_holds_the_schedule_back(fp16_baseline) -> None:
    skipped = fp16_baseline["skipped_steps"]
    # Both kinds of step, and a skip after applied ones (the scale grew into an overflow).
    assert skipped[:2] == [0, 1] and len(skipped) < STEPS and skipped[-1] > 2, skipped
    scales = fp16_baseline["loss_scales"]
    assert scales[0] == 2.0**18 and min(scales) < 2.0**18 < max(scales), scales
    # Each step's rate is the schedule's at the step less the steps skipped before it.
    for step, lr in enumerate(fp16_baseline["learning_rates"]):
        position = step - sum(s < step for s in skipped)
        assert lr == warmup_lr(position), (step, position)


def test_fp16_sigkill_mid_backward_and_rescale_keep_the_scaler(
    spotline_train, fp16_baseline
) -> None:
    # The kill lands after the two skips, while the lazy replica holds a skipped update.
    flags = ("--checkpoint-interval", "100", "--inject", "kill:2:1:backward")
    killed = spotline_train(FP16_CONFIG, *TWO_BY_TWO, *flags)
    same_fp16_run(killed, fp16_baseline)
    assert killed["recoveries"] == 1 and killed["checkpoint_fallbacks"] == 0
    assert killed["recovery_events"][0]["in_memory"]
    rescaled = spotline_train(FP16_CONFIG, *TWO_BY_TWO, "--rescale", "3:2,5:4", name="rescale")
    same_fp16_run(rescaled, fp16_baseline)
    sizes = [len(p["pipelines"]) for p in rescaled["logical_placements"]]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
    assert rescaled["checkpoint_fallbacks"] == 0


def test_fp16_checkpoint_restore_and_one_stage_placements_keep_the_scaler(
    spotline_train, fp16_baseline
) -> None:
    # Both stage-0 workers lost, redundancy off: the checkpoint of step 2 (the scaler after
    # the two skips, with the Adam state) is restored on one pipeline.
    flags = ("--redundancy", "off", "--checkpoint-interval", "2")
    restored = spotline_train(
        FP16_CONFIG, *TWO_BY_TWO, *flags, "--inject", "kill:3:0", "--inject", "kill:3:1"
    )
    same_fp16_run(restored, fp16_baseline)
    assert restored["checkpoint_fallbacks"] == 1
    # One stage: the overflow decision is the job's, whatever the stage count.
    one_stage = spotline_train(
        FP16_CONFIG,
        "--workers",
        "4",
        "--stages",
        "1",
        *LOGICAL,
        "--rescale",
        "3:2,5:1",
        name="one-stage",
    )
    same_fp16_run(one_stage, fp16_baseline)
