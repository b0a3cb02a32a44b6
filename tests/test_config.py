"""The config parser: strict keys and types, cross-field checks, every shipped config valid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotline.config import load_config, parse_config, with_overrides
from spotline.errors import UserError

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.json"))


def test_configs_folder_is_not_empty() -> None:
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.num_workers % cfg.num_stages == 0
    # DeepSpeed's own keys stay outside the spotline section.
    assert "spotline" not in cfg.deepspeed


def test_default_file_equals_builtin_default() -> None:
    assert load_config("configs/default.json").spotline == parse_config({}).spotline
    assert load_config(None).deepspeed == load_config("configs/default.json").deepspeed


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (
            {"spotline": {"redundancy": {"mdoe": "eager"}}},
            "'spotline.redundancy.mdoe' is unknown; expected one of: mode",
        ),
        ({"spotline": {"redundncy": {}}}, "'spotline.redundncy' is unknown"),
        (
            {"spotline": {"topology": {"stages": "two"}}},
            "'spotline.topology.stages' is \"two\"; expected an integer",
        ),
        ({"spotline": {"topology": {"stages": True}}}, "expected an integer"),
        ({"spotline": {"redundancy": {"mode": "eagre"}}}, 'expected "off" or "lazy" or "eager"'),
        (
            {"spotline": {"topology": {"workers": 3, "stages": 2}}},
            "--workers 3 is not divisible by --stages 2",
        ),
        # Both mistakes at once: "a multiple of 8 workers" alone led to the next refusal.
        (
            {"spotline": {"topology": {"workers": 4, "stages": 8}}},
            "--stages 8 is more than the model's 4 transformer blocks, and --workers 4 is not "
            "a multiple of it; use at most 4 stages and a multiple of that many workers "
            "(e.g. --stages 4 --workers 4)",
        ),
        (
            {"spotline": {"topology": {"workers": 4, "start_workers": 5}}},
            "--start-workers 5 is more than --workers 4",
        ),
        (
            {"spotline": {"topology": {"start_workers": 0}}},
            "'spotline.topology.start_workers' is 0; expected a positive integer",
        ),
        (
            {"spotline": {"training": {"steps": 0}}},
            "'spotline.training.steps' is 0; expected a positive integer",
        ),
        ({"train_batch_size": 7}, "'train_batch_size' is 7"),
        ({"elasticity": {"enabled": True}}, "spotline.elasticity"),
        ({"spotline": []}, "'spotline' is []; expected an object"),
        # State a recovery could not carry exactly is refused when the config loads.
        ({"scheduler": {"type": "StepLR", "params": {}}}, "'scheduler.type' is \"StepLR\""),
        ({"scheduler": {"type": "OneCycle", "params": 3}}, "'scheduler.params' is 3"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 4}}},
            "'scheduler.params.last_batch_iteration'",
        ),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "'optimizer.type' is \"SGD\""),
        # Precision: two at once; an autocast dtype of neither; a loss scale that would not
        # unscale exactly (the scaler's keys: test_loss_scale.py).
        ({"fp16": {"enabled": True, "loss_scale": 100}}, "'fp16.loss_scale' is 100"),
        (
            {"torch_autocast": {"enabled": True, "dtype": "float16"}, "bf16": {"enabled": True}},
            "'fp16' and 'bf16' are both enabled",
        ),
        (
            {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
            "'fp16' and 'bf16' are both enabled",
        ),
        (
            {"torch_autocast": {"enabled": True, "dtype": "int8"}},
            "'torch_autocast.dtype' is \"int8\"",
        ),
        # ZeRO-2/3: DeepSpeed's PipelineEngine's own refusal, with its reason.
        ({"zero_optimization": {"stage": 2}}, "PipelineEngine refuses ZeRO stages 2 and 3"),
        ({"zero_optimization": {"stage": 3}}, "'zero_optimization.stage' is 3"),
        ({"zero_optimization": {"stage": 1}}, "'zero_optimization.stage' is 1"),
        ({"curriculum_learning": {"enabled": True}}, "'curriculum_learning' is enabled"),
    ],
)
def test_bad_config_is_one_clear_line(raw: dict, needle: str) -> None:
    with pytest.raises(UserError) as info:
        parse_config(raw)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


def test_flags_override_the_file_through_the_same_parser() -> None:
    cfg = with_overrides(
        load_config(None),
        {"spotline.topology.workers": 8, "spotline.redundancy.mode": "lazy"},
    )
    assert cfg.num_workers == 8 and cfg.num_logical_workers == 4
    assert cfg.spotline.redundancy.mode == "lazy"
    with pytest.raises(UserError, match="'spotline.redundancy.mode' is \"sometimes\""):
        with_overrides(cfg, {"spotline.redundancy.mode": "sometimes"})


def test_bad_json_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"spotline": {')
    with pytest.raises(UserError, match="not valid JSON"):
        load_config(bad)
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "missing.json")


def test_round_trip_through_json() -> None:
    cfg = load_config("configs/gpt2-tiny-eager.json")
    again = parse_config(json.loads(json.dumps(cfg.to_json())))
    assert again.spotline == cfg.spotline and again.deepspeed == cfg.deepspeed


def test_config_module_is_pure() -> None:
    import subprocess
    import sys

    code = "import sys, spotline.config; assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_recoverable_deepspeed_keys_are_accepted() -> None:
    from spotline.config import SUPPORTED_SCHEDULERS

    for name in SUPPORTED_SCHEDULERS:
        parse_config({"scheduler": {"type": name, "params": {}}})
    parse_config({"fp16": {"enabled": False}, "zero_optimization": {"stage": 0}})
    parse_config({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}})


@pytest.mark.parametrize(
    ("keys", "precision"),
    [
        ({}, "fp32"),
        ({"bf16": {"enabled": False}}, "fp32"),
        ({"bf16": {"enabled": True}}, "bf16"),
        ({"bfloat16": {"enabled": True}}, "bf16"),
        ({"torch_autocast": {"enabled": True}}, "bf16"),  # DeepSpeed's default dtype
        ({"torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}}, "bf16"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": False}}, "bf16"),
        ({"fp16": {"enabled": True}}, "fp16"),
        ({"torch_autocast": {"enabled": True, "dtype": "torch.float16"}}, "fp16"),
    ],
)
def test_the_precision_is_read_from_deepspeeds_keys_and_autocast_for_the_engine(
    keys: dict, precision: str
) -> None:
    from spotline.pipeline.engine import deepspeed_config_for

    cfg = parse_config(keys)
    assert cfg.precision == precision
    ds = deepspeed_config_for(cfg.deepspeed, num_physical_pipelines=2)
    # DeepSpeed's bf16 and fp16 sections (BF16_Optimizer, FP16_Optimizer) never reach the
    # engine: the fp32 parameters stay the master and the compute is autocast.
    assert "bf16" not in ds and "bfloat16" not in ds and "fp16" not in ds
    autocast = ds.get("torch_autocast", {})
    assert autocast.get("enabled", False) == (precision != "fp32")
    if precision != "fp32":
        assert autocast["dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[precision]


def test_a_resume_refuses_a_change_of_precision() -> None:
    from spotline.config_resume import resume_mismatch

    fp32, bf16 = parse_config({}), parse_config({"bf16": {"enabled": True}})
    assert "bf16" in (resume_mismatch(fp32, bf16) or "")
    assert resume_mismatch(bf16, bf16) is None
    fp16 = parse_config({"fp16": {"enabled": True}})
    assert "fp16" in (
        resume_mismatch(fp16, parse_config({"fp16": {"enabled": True, "hysteresis": 1}})) or ""
    )


def test_a_run_starts_with_start_workers_and_keeps_the_logical_topology_of_workers() -> None:
    from spotline.launch.control.faults import FaultDelivery

    def initial(overrides: dict[str, object]) -> tuple[int, int]:
        cfg = with_overrides(load_config(None), overrides)
        # What it reads to count the starting workers is the config alone (no trace).
        faults = FaultDelivery(cfg, None, None, None, None)  # type: ignore[arg-type]
        return faults.initial_workers(), cfg.num_logical_workers

    assert initial({"spotline.topology.workers": 4}) == (4, 2)
    assert initial({"spotline.topology.workers": 4, "spotline.topology.start_workers": 2}) == (2, 2)
    # A replayed trace's first nodes decide instead.
    trace = {"spotline.recovery.trace": "integration/assets/traces/p3-trace.csv"}
    assert initial({**trace, "spotline.topology.start_workers": 1})[0] == 2


def test_activation_checkpointing_from_spotlines_key_or_deepspeeds() -> None:
    ours = {"spotline": {"model": {"activation_checkpoint_interval": 2}}}
    theirs = {"pipeline": {"activation_checkpoint_interval": 2}}
    assert parse_config({}).activation_checkpoint_interval == 0
    assert parse_config(ours).activation_checkpoint_interval == 2
    assert parse_config(theirs).activation_checkpoint_interval == 2
    assert parse_config({**ours, **theirs}).activation_checkpoint_interval == 2
    with pytest.raises(UserError, match="disagree; set one of them"):
        parse_config({**ours, "pipeline": {"activation_checkpoint_interval": 1}})
    with pytest.raises(UserError, match="'pipeline.activation_checkpoint_interval' is -1"):
        parse_config({"pipeline": {"activation_checkpoint_interval": -1}})


def test_the_bitwise_promise_is_on_by_default_and_its_caveat_named_when_off() -> None:
    default = parse_config({})
    assert default.spotline.determinism.enabled and default.bitwise_caveats == []
    off = parse_config({"spotline": {"determinism": {"enabled": False}}})
    (caveat,) = off.bitwise_caveats
    assert "determinism is off" in caveat and "--no-deterministic" in caveat
