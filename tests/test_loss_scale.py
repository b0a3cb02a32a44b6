"""fp16's loss scaler as data (``spotline.plan.loss_scale``), and its config keys.

The state machine is checked against DeepSpeed's own ``DynamicLossScaler`` (the oracle),
driven over the same overflow sequences in a child process (its ``update_scale`` asks for
the rank to log an overflow, which needs a process group: the child makes a one-process
one, which this test process must not hold). The engine's use of it (one overflow decision
for the job, kept through every recovery) is tests/test_precision.py's fp16 runs.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import pytest

from spotline.config_precision import host_precision_refusal, loss_scaling_of
from spotline.errors import UserError
from spotline.plan.loss_scale import FLOATS, NO_SCALING, LossScaleState, LossScaling

# (initial scale power, window, hysteresis, consecutive hysteresis, min scale)
SETTINGS = [
    (16, 1000, 2, False, 1.0),
    (8, 2, 1, False, 1.0),
    (8, 3, 3, False, 1.0),
    (8, 2, 2, True, 1.0),
    (4, 1, 2, False, 4.0),  # down to the minimum, and held there
]

_ORACLE = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from torch.distributed import HashStore
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    # update_scale asks deepspeed.comm for the rank only to log an overflow; DeepSpeed's
    # own initialisation of it builds a shared-memory op on CPU (a minute): torch's
    # get_rank of a one-process group answers the same.
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    loss_scaler.dist = dist
    out = []
    for (power, window, hysteresis, consecutive, min_scale), overflows in json.load(sys.stdin):
        s = DynamicLossScaler(
            init_scale=2.0**power, scale_window=window, min_scale=min_scale,
            delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
            raise_error_at_min_scale=False,
        )
        states = []
        for overflow in overflows:
            s.update_scale(overflow)
            states.append([s.cur_scale, s.cur_iter, s.last_overflow_iter, s.cur_hysteresis])
        out.append(states)
    print(json.dumps(out))
    """
)


def test_the_dynamic_scale_follows_deepspeeds_dynamic_loss_scaler() -> None:
    rng = random.Random(3)
    cases = []
    for setting in SETTINGS:
        # Runs of overflows and of clean steps, long enough to cross several windows.
        overflows = [rng.random() < 0.3 for _ in range(60)] + [False] * 7 + [True] * 6
        cases.append((setting, overflows))
    proc = subprocess.run(
        [sys.executable, "-c", _ORACLE],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = json.loads(proc.stdout.strip().splitlines()[-1])
    for (setting, overflows), theirs in zip(cases, expected, strict=True):
        power, window, hysteresis, consecutive, min_scale = setting
        scaling = LossScaling(
            enabled=True,
            initial_scale=2.0**power,
            window=window,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive,
            min_scale=min_scale,
        )
        state = scaling.initial()
        for overflow, their in zip(overflows, theirs, strict=True):
            state = scaling.after(state, overflow)
            ours = [state.scale, state.iteration, state.last_overflow, state.hysteresis]
            assert ours == their, (setting, state.iteration)
        assert state.skipped == sum(overflows)
    # The cases reach what they are there for: growth, shrinking, the minimum.
    scales = {s[0] for states in expected for s in states}
    assert 2.0**17 in scales and 4.0 in scales


def test_a_static_scale_never_changes_and_still_skips_an_overflow() -> None:
    scaling = LossScaling(enabled=True, dynamic=False, initial_scale=128.0)
    state = scaling.after(scaling.after(scaling.initial(), True), False)
    assert (state.scale, state.iteration, state.skipped) == (128.0, 2, 1)


def test_no_scaling_is_a_fixed_point() -> None:
    state = NO_SCALING.initial()
    assert NO_SCALING.after(state, False) == state
    assert state.scale == 1.0 and state.schedule_position(9) == 9


def test_the_state_round_trips_through_float32_numbers() -> None:
    import torch

    state = LossScaleState(
        2.0**40, iteration=123_457, last_overflow=99_001, hysteresis=2, skipped=17
    )
    floats = torch.tensor(state.to_floats(), dtype=torch.float32).tolist()
    assert len(floats) == FLOATS
    assert LossScaleState.from_floats(floats) == state
    # The learning rate's position holds back the skipped steps.
    assert state.schedule_position(123_457) == 123_440


def test_fp16_keys_map_to_the_scaler_or_are_refused_in_one_line() -> None:
    base = {"fp16": {"enabled": True}}
    default = loss_scaling_of(base)
    assert default == LossScaling(
        enabled=True, initial_scale=2.0**16, window=1000, hysteresis=2, min_scale=1.0
    )
    # torch_autocast in float16 alone: the same defaults.
    autocast = {"torch_autocast": {"enabled": True, "dtype": "torch.float16"}}
    assert loss_scaling_of(autocast) == default
    assert loss_scaling_of({"bf16": {"enabled": True}}) == NO_SCALING
    custom = loss_scaling_of(
        {
            "fp16": {
                "enabled": True,
                "initial_scale_power": 12,
                "loss_scale_window": 50,
                "hysteresis": 1,
                "consecutive_hysteresis": True,
                "min_loss_scale": 0.25,
            }
        }
    )
    assert custom == LossScaling(True, True, 2.0**12, 50, 1, True, 0.25)
    static = loss_scaling_of({"fp16": {"enabled": True, "loss_scale": 256}})
    assert not static.dynamic and static.initial_scale == 256.0
    refused = {
        "loss_scale": 1000,  # not a power of two
        "initial_scale_power": 70,
        "loss_scale_window": 0,
        "hysteresis": 1.5,
        "consecutive_hysteresis": "yes",
        "min_loss_scale": 0,
        "auto_cast": True,
        "fp16_master_weights_and_grads": True,
        "scale_growth": 2,  # not a DeepSpeed fp16 key
    }
    for key, value in refused.items():
        with pytest.raises(UserError) as info:
            loss_scaling_of({"fp16": {"enabled": True, key: value}})
        line = str(info.value)
        assert "\n" not in line and f"'fp16.{key}'" in line, line


def test_a_host_without_fp16_is_told_to_use_bf16() -> None:
    line = host_precision_refusal("fp16", fp16_supported=False, bf16_supported=True)
    assert line is not None and '"bf16": {"enabled": true}' in line and "no fp16" in line
    assert host_precision_refusal("fp16", fp16_supported=True, bf16_supported=False) is None
    assert host_precision_refusal("bf16", fp16_supported=True, bf16_supported=False) is not None
    assert host_precision_refusal("fp32", fp16_supported=False, bf16_supported=False) is None
