"""What both entry points' workers build the same way: the process settings, the sampler, the
model and the engine.

``deepspeed launch/train.py`` (``spotline.worker.launched``) builds one engine for the fixed
placement (``launched.fixed_layout``); ``spotline train`` (``spotline.worker.elastic``) one per
generation for the coordinator's layout. Both through :func:`build_worker_engine`: the
layout's physical stages over the logical partition's layer boundaries, DeepSpeed's
pipe-major topology for its pipelines, and the Spotline engine with the configured
redundancy, reading each micro-batch from the global sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spotline.config import RunConfig
from spotline.data.corpus import PackedCorpus
from spotline.models import layers as models
from spotline.pipeline.engine import build_engine, deepspeed_config_for
from spotline.pipeline.instruction_profile import InstructionProfile, instrument
from spotline.pipeline.redundancy import RedundantPipelineEngine
from spotline.plan.grid import Layout
from spotline.plan.sampler import GlobalSampler
from spotline.runtime import configure_process, seed_everything


def quiet_libraries() -> None:
    """Keep the terminal for Spotline's own lines: DeepSpeed and torch chatter goes to logs."""
    import logging
    import warnings

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed's p2p/broadcast ops on tensors that require grad: harmless, once per run.
    warnings.filterwarnings("ignore", message=r"c10d::broadcast_: an autograd kernel")
    warnings.filterwarnings("ignore", message=r"Converting a tensor with requires_grad")


def prepare_process(cfg: RunConfig) -> None:
    """A worker process's settings before anything is built: quiet libraries, the
    configured threads and determinism, and the run's seed."""
    sl = cfg.spotline
    quiet_libraries()
    configure_process(
        intra_op_threads=sl.determinism.intra_op_threads, deterministic=sl.determinism.enabled
    )
    seed_everything(sl.training.seed)


def pretrained_dir_of(model_spec: str) -> str | None:
    """The directory to load weights from, if the model spec is a saved model with weights."""
    path = Path(model_spec)
    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    if path.is_dir() and any((path / w).exists() for w in weights):
        return str(path)
    return None


def global_sampler(cfg: RunConfig, num_samples: int) -> GlobalSampler:
    """The run's sampler: each micro-batch by (step, logical worker, micro-batch), so that
    what a pipeline trains on never depends on how many processes exist."""
    return GlobalSampler(
        num_samples=num_samples,
        num_logical_workers=cfg.num_logical_workers,
        micro_batch_size=cfg.micro_batch_size,
        num_micro_batches=cfg.num_micro_batches,
        seed=cfg.spotline.training.seed,
    )


def build_worker_engine(
    cfg: RunConfig,
    hf_config: Any,
    logical: Sequence[int],
    layout: Layout,
    corpus: PackedCorpus,
    sampler: GlobalSampler,
    *,
    profile: InstructionProfile | None = None,
) -> RedundantPipelineEngine:
    """The model and the Spotline engine of ``layout`` (its physical stages: groups of the
    logical stages whose layer boundaries are ``logical``), reading ``corpus`` through
    ``sampler``. Needs the process group. ``profile``: time its instructions into it."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    sl = cfg.spotline
    # DeepSpeed's own topology for these sizes (rank = stage * pipelines + pipeline).
    topology = PipeDataParallelTopology(
        num_pp=layout.num_physical_stages, num_dp=layout.num_pipelines
    )
    module = models.build_pipeline_module(
        hf_config,
        layout.num_physical_stages,
        seed=sl.training.seed,
        # A save_pretrained directory's weights are step 0's (a later generation of
        # spotline train loads its stages over them from memory, a peer or a checkpoint).
        pretrained_dir=pretrained_dir_of(sl.model.name),
        activation_checkpoint_interval=cfg.activation_checkpoint_interval,
        topology=topology,
        parts=models.physical_parts(logical, layout.groups),
    )
    ds_config = deepspeed_config_for(cfg.deepspeed, num_physical_pipelines=layout.num_pipelines)
    engine = build_engine(
        module,
        ds_config,
        RedundantPipelineEngine,
        redundancy=sl.redundancy.mode,
        replica_device=sl.redundancy.replica_device,
        replica=sl.redundancy.replica,
        logical_parts=logical,
        loss_scaling=cfg.loss_scaling,
    )
    # build_engine returns DeepSpeed's (untyped) PipelineEngine; it built the class asked.
    assert isinstance(engine, RedundantPipelineEngine)
    if profile is not None:
        instrument(engine, profile)
    engine.batch_source = lambda step, worker, mb: corpus.batch(sampler.indices(step, worker, mb))
    return engine
