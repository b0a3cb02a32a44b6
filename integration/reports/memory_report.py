"""The memory estimate of a run's starting plan (``spotline.plan.memory_estimate``) from its
config and model, computed where the inputs are checked, before any worker starts."""

from __future__ import annotations

from typing import Any

from spotline.config import RunConfig
from spotline.models.model_config import block_weights, layer_parameters, logical_parts
from spotline.plan.memory_estimate import (
    MemoryPlan,
    ModelShape,
    StageMemory,
    estimate,
)


def model_shape(cfg: RunConfig, hf_config: Any) -> ModelShape:
    """What the estimate needs of ``cfg``'s model (a transformers config) and batch."""
    layers = layer_parameters(hf_config)
    weights = block_weights(hf_config)
    parts = logical_parts(hf_config, cfg.num_stages)
    spans = [range(parts[s], parts[s + 1]) for s in range(cfg.num_stages)]
    return ModelShape(
        stage_parameters=tuple(sum(layers[i][0] for i in span) for span in spans),
        stage_tensors=tuple(sum(layers[i][1] for i in span) for span in spans),
        stage_blocks=tuple(sum(weights[i] for i in span) for span in spans),
        hidden_size=int(hf_config.hidden_size),
        num_heads=int(hf_config.num_attention_heads),
        vocab_size=int(hf_config.vocab_size),
        seq_len=cfg.spotline.model.seq_len,
        micro_batch_size=cfg.micro_batch_size,
        num_micro_batches=cfg.num_micro_batches,
    )


def memory_plan(cfg: RunConfig) -> MemoryPlan:
    """How ``cfg``'s starting plan runs, as far as memory goes."""
    redundancy = cfg.spotline.redundancy
    pipelines = cfg.num_physical_pipelines
    return MemoryPlan(
        redundancy=redundancy.on,
        replica_pieces=pipelines if redundancy.replica == "sharded" else 1,
        half_precision=cfg.precision != "fp32",
        activation_checkpoint_interval=cfg.activation_checkpoint_interval,
        hosted_logical_workers=-(-cfg.num_logical_workers // pipelines),
    )


def estimate_run(cfg: RunConfig, hf_config: Any) -> list[StageMemory]:
    """Each logical stage's worker's estimated bytes at the start of ``cfg``'s run."""
    return estimate(model_shape(cfg, hf_config), memory_plan(cfg))
