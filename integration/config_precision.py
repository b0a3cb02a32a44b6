"""The compute precision a config asks for, read from DeepSpeed's own keys. Pure.

"bf16" and "fp16" are mixed precision with fp32 master weights: the parameters
and the optimizer state (the state of record: replicas, checkpoints, param_sha256) stay
fp32 and the forward and backward run under DeepSpeed's torch_autocast in bf16 or fp16, so
the gradients reach the exact reduction as fp32 sums whatever the placement. (DeepSpeed's
BF16_Optimizer and FP16_Optimizer instead hold half-precision parameters and keep the fp32
master partitioned over the physical data-parallel group, a layout that changes with every
rescale.) fp16 also scales the loss (:func:`loss_scaling_of`: DeepSpeed's ``fp16`` keys,
``spotline.plan.loss_scale``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Literal

from spotline.errors import UserError
from spotline.plan.loss_scale import NO_SCALING, LossScaling

Precision = Literal["fp32", "bf16", "fp16"]


def enabled(ds: Mapping[str, Any], key: str) -> bool:
    """Whether DeepSpeed config section ``key`` (``{"enabled": ...}``) is on."""
    section = ds.get(key)
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


# torch_autocast's "dtype" spellings DeepSpeed reads, by the precision they mean.
_AUTOCAST_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16"}


def precision_of(ds: Mapping[str, Any]) -> Precision:
    """The compute precision a DeepSpeed config asks for (see :data:`Precision`), or a
    UserError naming the key where it asks for one Spotline does not train in."""
    autocast = ds.get("torch_autocast")
    autocast_dtype = None
    if enabled(ds, "torch_autocast"):
        assert isinstance(autocast, Mapping)
        raw = autocast.get("dtype", "bfloat16")
        autocast_dtype = _AUTOCAST_DTYPES.get(str(raw).removeprefix("torch."))
        if autocast_dtype is None:
            raise UserError(
                f"config key 'torch_autocast.dtype' is {json.dumps(raw)}; expected "
                '"bfloat16" or "float16" (or use "bf16": {"enabled": true})'
            )
    bf16 = enabled(ds, "bf16") or enabled(ds, "bfloat16") or autocast_dtype == "bf16"
    fp16 = enabled(ds, "fp16") or autocast_dtype == "fp16"
    if bf16 and fp16:
        raise UserError(
            "config keys 'fp16' and 'bf16' are both enabled; one run trains in one precision: "
            "keep 'bf16' and remove 'fp16'"
        )
    if fp16:
        return "fp16"
    return "bf16" if bf16 else "fp32"


# DeepSpeed's fp16 keys that set the loss scaler, with its defaults.
_SCALER_DEFAULTS: dict[str, Any] = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}
# DeepSpeed's fp16 keys that would change more than the scaler, refused when set: each with
# why and what to do instead.
_FP16_REFUSED = {
    "auto_cast": "Spotline casts through torch autocast already: remove it",
    "fp16_master_weights_and_grads": (
        "Spotline keeps the master weights and gradients in fp32 (the state a recovery "
        "moves and param_sha256 covers): remove it"
    ),
}


def _number(key: str, value: Any, *, integer: bool, minimum: float) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or value < minimum:
        kind = "an integer" if integer else "a number"
        raise UserError(
            f"config key 'fp16.{key}' is {json.dumps(value)}; expected {kind} >= {minimum:g}"
        )
    return float(value)


def loss_scaling_of(ds: Mapping[str, Any]) -> LossScaling:
    """The loss scaler a DeepSpeed config asks for: DeepSpeed's ``fp16`` section's keys (or
    their defaults: ``torch_autocast`` in float16 without an ``fp16`` section), or no
    scaling where the precision is not fp16. Assumes :func:`precision_of` accepted ``ds``."""
    if precision_of(ds) != "fp16":
        return NO_SCALING
    raw = ds.get("fp16")
    section: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    for key, why in _FP16_REFUSED.items():
        if section.get(key):
            raise UserError(f"config key 'fp16.{key}' is set: {why}")
    known = {"enabled", *_SCALER_DEFAULTS, *_FP16_REFUSED}
    unknown = sorted(set(section) - known)
    if unknown:
        raise UserError(
            f"config key 'fp16.{unknown[0]}' is not a loss-scaler key Spotline knows; "
            f"expected one of {', '.join(sorted(known))}"
        )
    got = {**_SCALER_DEFAULTS, **{k: v for k, v in section.items() if k in _SCALER_DEFAULTS}}
    static = _number("loss_scale", got["loss_scale"], integer=False, minimum=0)
    if static > 0 and not math.log2(static).is_integer():
        raise UserError(
            f"config key 'fp16.loss_scale' is {json.dumps(got['loss_scale'])}; expected 0 "
            "(a dynamic scale) or a power of two (which unscales gradients exactly), e.g. 128"
        )
    power = _number("initial_scale_power", got["initial_scale_power"], integer=True, minimum=0)
    if power > 64:
        raise UserError(
            f"config key 'fp16.initial_scale_power' is {got['initial_scale_power']}; "
            "expected at most 64 (the scale is 2 to that power)"
        )
    if not isinstance(got["consecutive_hysteresis"], bool):
        raise UserError(
            "config key 'fp16.consecutive_hysteresis' is "
            f"{json.dumps(got['consecutive_hysteresis'])}; expected true or false"
        )
    min_scale = _number("min_loss_scale", got["min_loss_scale"], integer=False, minimum=0)
    if min_scale <= 0:
        raise UserError("config key 'fp16.min_loss_scale' is 0; expected a number > 0")
    return LossScaling(
        enabled=True,
        dynamic=static == 0,
        initial_scale=static if static > 0 else 2.0**power,
        window=int(_number("loss_scale_window", got["loss_scale_window"], integer=True, minimum=1)),
        hysteresis=int(_number("hysteresis", got["hysteresis"], integer=True, minimum=1)),
        consecutive_hysteresis=got["consecutive_hysteresis"],
        min_scale=min_scale,
    )


def host_precision_refusal(
    precision: Precision, *, fp16_supported: bool, bf16_supported: bool
) -> str | None:
    """The one line refusing ``precision`` on an accelerator without it (None: supported)."""
    if precision == "fp16" and not fp16_supported:
        return (
            "config key 'fp16' is enabled but this machine's accelerator has no fp16; "
            'use "bf16": {"enabled": true} instead'
            + ("" if bf16_supported else " on a machine that has it")
        )
    if precision == "bf16" and not bf16_supported:
        return (
            "config key 'bf16' is enabled but this machine's accelerator has no bf16; "
            "remove it to train in fp32, or run on a machine that has bf16"
        )
    return None
