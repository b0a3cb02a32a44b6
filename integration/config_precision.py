"""The compute precision a config asks for, read from DeepSpeed's own keys. Pure.

"bf16" is mixed precision with fp32 master weights: the parameters
and the optimizer state (the state of record: replicas, checkpoints, param_sha256) stay
fp32 and the forward and backward run under DeepSpeed's torch_autocast in bf16, so the
gradients reach the exact reduction as fp32 sums whatever the placement. (DeepSpeed's
BF16_Optimizer instead holds bf16 parameters and keeps the fp32 master partitioned over
the physical data-parallel group, a layout that changes with every rescale.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from spotline.errors import UserError

Precision = Literal["fp32", "bf16"]


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
                '"bfloat16" (or use "bf16": {"enabled": true})'
            )
    bf16 = enabled(ds, "bf16") or enabled(ds, "bfloat16") or autocast_dtype == "bf16"
    fp16 = enabled(ds, "fp16") or autocast_dtype == "fp16"
    if bf16 and fp16:
        raise UserError(
            "config keys 'fp16' and 'bf16' are both enabled; one run trains in one precision: "
            "keep 'bf16' and remove 'fp16'"
        )
    if fp16:
        # Also the answer where the accelerator has no fp16 (DeepSpeed's CPU accelerator).
        raise UserError(
            "config key 'fp16' is enabled: fp16 needs a dynamic loss scaler, whose state "
            'Spotline does not carry across a recovery yet; use "bf16": {"enabled": true} '
            "(the same speed on GPUs that have bf16, and no loss scaling)"
        )
    return "bf16" if bf16 else "fp32"
