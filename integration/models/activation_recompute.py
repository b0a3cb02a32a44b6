"""Activation checkpointing for Spotline's PipelineModules, bitwise the first pass.

DeepSpeed's default (its reentrant ``checkpointing.checkpoint``) recomputes a range of
layers in the backward pass without the forward's autocast: under bf16 the recomputed
activations, and so every gradient, would differ from the first pass. torch's
non-reentrant checkpoint restores the autocast state (and the RNG state; the engine's
per-layer reseed hooks draw the same dropout masks anyway), so the recomputation is the
first pass, bit for bit, in fp32 and in bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint


def recomputing_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``PipelineModule(activation_checkpoint_func=...)``: run ``function(*args)`` keeping only
    its inputs; recompute it, under the same autocast and RNG state, in the backward pass."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
