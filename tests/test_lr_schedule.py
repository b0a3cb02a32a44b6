"""Learning-rate schedules across recoveries: the rate of every step is a function of the
step, in every engine a generation builds, on the replicas, after a rescale and after a
checkpoint restore, so a disturbed run ends with the undisturbed run's parameters.

DeepSpeed's five schedulers each run with kills before warm-up has raised the rate (step 0),
during it and after it, in one disturbed run per scheduler; replicas are compared with their
owners after every step (``verify_replicas``); every step's loss and learning rate, and the
parameter hash, must equal the undisturbed run's.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import small_config

STEPS = 8
WARMUP = {"warmup_num_steps": 4, "warmup_type": "linear"}
SCHEDULERS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.004, **WARMUP},
    "WarmupDecayLR": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.004,
        "total_num_steps": STEPS,
        **WARMUP,
    },
    "WarmupCosineLR": {
        "total_num_steps": STEPS,
        "warmup_min_ratio": 0.1,
        "cos_min_ratio": 0.05,
        **WARMUP,
    },
    # Up for 3 steps, down for 3, then decaying; the momentum (Adam's beta1) cycles too.
    "OneCycle": {
        "cycle_min_lr": 0.0004,
        "cycle_max_lr": 0.004,
        "cycle_first_step_size": 3,
        "decay_lr_rate": 0.5,
        "decay_step_size": 1,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.95,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 0.0004,
        "lr_range_test_step_size": 2,
        "lr_range_test_step_rate": 1.0,
    },
}


def scheduled_config(name: str, **sections: Any) -> dict[str, Any]:
    config = small_config(
        training={"steps": STEPS},
        # stages_per_worker 4: the kill test takes three of four workers, and the last one
        # runs all four stages (the default memory limit, 2, would wait for capacity).
        redundancy={"mode": "lazy", "verify_replicas": True, "stages_per_worker": 4},
        **sections,
    )
    config["scheduler"] = {"type": name, "params": SCHEDULERS[name]}
    return config


def sequential_hyper(name: str, steps: int) -> list[dict[str, Any]]:
    """What DeepSpeed's scheduler gives an optimizer for steps 0..steps-1 of one
    uninterrupted loop: the values set before each update, stepped once after it."""
    import torch
    from deepspeed.runtime import lr_schedules

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.999))
    scheduler = getattr(lr_schedules, name)(optimizer, **SCHEDULERS[name])
    out = []
    for _ in range(steps):
        group = optimizer.param_groups[0]
        out.append({"lr": group["lr"], "betas": tuple(group["betas"])})
        scheduler.step()
    return out


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_the_rate_of_a_step_is_the_rate_of_the_uninterrupted_loop(name: str) -> None:
    import torch

    from spotline.pipeline.lr_schedule import StepSchedule

    schedule = StepSchedule(
        torch.optim.AdamW, {"lr": 1e-3, "betas": (0.9, 0.999)}, name, SCHEDULERS[name]
    )
    expected = sequential_hyper(name, 12)
    # Asked out of order, as a generation built mid-run or a roll-forward asks.
    for step in [7, 0, 11, 3, 1, 10, 2, 4, 9, 5, 8, 6]:
        got = schedule.at(step)
        assert got["lr"] == expected[step]["lr"], (step, got, expected[step])
        assert tuple(got["betas"]) == expected[step]["betas"], (step, got, expected[step])
    rates = {h["lr"] for h in expected}
    assert len(rates) > 3  # the schedule really moves the rate over these steps


TOPOLOGIES = {
    "1x4": ("--workers", "4", "--stages", "4"),
    "2x2": ("--workers", "4", "--stages", "2"),
}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """``undisturbed(scheduler, topology) -> summary``, each run once for the module."""
    from conftest import read_summary, run_spotline, write_config

    root = tmp_path_factory.mktemp("undisturbed")
    runs: dict[tuple[str, str], dict[str, Any]] = {}

    def get(name: str, topology: str) -> dict[str, Any]:
        if (name, topology) not in runs:
            cfg = write_config(root / f"{name}-{topology}.json", scheduled_config(name))
            output = root / f"{name}-{topology}"
            proc = run_spotline(
                ["train", "--config", str(cfg), "--output", str(output), *TOPOLOGIES[topology]]
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[(name, topology)] = read_summary(output)
        return runs[(name, topology)]

    return get


def same_run(run: dict[str, Any], reference: dict[str, Any]) -> None:
    assert run["learning_rates"] == reference["learning_rates"]
    assert run["losses"] == reference["losses"]
    assert run["param_sha256"] == reference["param_sha256"]


@pytest.mark.slow
@pytest.mark.timeout(900)
# Every scheduler's rate at any step is checked without processes above; the kills need
# only the two whose state is richest (a warm-up then a decay; a cycle of rate and momentum):
# each real run costs about 40 s of the suite's budget.
# OneCycle, the richest: it moves the momentum as well as the rate (every scheduler's values
# at every step, asked out of order, are checked without processes above).
@pytest.mark.parametrize("name", ["OneCycle"])
def test_kills_before_during_and_after_warmup_keep_the_schedule(
    spotline_train, undisturbed, name
) -> None:
    reference = undisturbed(name, "1x4")
    disturbed = spotline_train(
        scheduled_config(name),
        *TOPOLOGIES["1x4"],
        # Step 1: nothing committed yet; step 3: mid warm-up (mid first cycle for OneCycle);
        # step 7: after it. The last one in the optimizer phase: a roll-forward.
        "--inject",
        "kill:1:1:backward",
        "--inject",
        "kill:3:2:forward",
        "--inject",
        "kill:7:3:optimizer",
    )
    assert reference["learning_rates"] == [h["lr"] for h in sequential_hyper(name, STEPS)]
    assert disturbed["recoveries"] == 3 and disturbed["checkpoint_fallbacks"] == 0
    for run in (reference, disturbed):
        # Replicas stepped with the owner's rate and momentum for the same step.
        assert run["replica_checks"] > 0 and run["replica_mismatches"] == []
    same_run(disturbed, reference)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_checkpoint_restore_keeps_the_schedule(spotline_train, undisturbed) -> None:
    """A fatal loss (stage 2's owner and its replica holder killed together) restored from
    the checkpoint of step 4, with the rate (and OneCycle's momentum) of step 4 on. OneCycle:
    its undisturbed run is the kill test's too (every scheduler's rate at every step is
    checked without processes above)."""
    restored = spotline_train(
        scheduled_config("OneCycle"),
        *TOPOLOGIES["1x4"],
        "--checkpoint-interval",
        "2",
        "--inject",
        "kill:6:1",
        "--inject",
        "kill:6:2",
    )
    fallback = [e for e in restored["events"] if e["kind"] == "checkpoint-fallback"]
    assert restored["checkpoint_fallbacks"] == 1 and fallback[0]["step"] == 4
    same_run(restored, undisturbed("OneCycle", "1x4"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_in_place_rescales_keep_the_schedule(spotline_train, undisturbed) -> None:
    """2 stages x 2 logical pipelines on 4 -> 2 -> 4 processes (new engines, state sent)."""
    rescaled = spotline_train(
        scheduled_config("OneCycle"), *TOPOLOGIES["2x2"], "--rescale", "4:2,7:4"
    )
    assert rescaled["preemptions"] == 2 and rescaled["generations"] >= 3
    same_run(rescaled, undisturbed("OneCycle", "2x2"))
