"""One rank of the stock-DeepSpeed baseline that ``spotline bench foundation`` compares against.

Trains the same PipelineModule (``spotline.models.layers.build_pipeline_module``) on the same batches
(the global sampler, by step, pipeline and micro-batch) for the same steps as ``spotline
train``, but through ``deepspeed.initialize`` and DeepSpeed's own ``PipelineEngine`` and
``TrainSchedule``: no Spotline engine subclass, no per-layer reseeding, no exact tied-weight
reduction. Its steps run through the loop Spotline's entry points use
(``spotline.worker.loop.run_steps``, with only its loss and time log), so the two numbers are taken
by the same clocks; only the step function differs (DeepSpeed's ``train_batch``).

A tied model (GPT-2's LM head is its token embedding) is tied the stock way
(:func:`deepspeed_tied`): DeepSpeed's ``TiedLayerSpec`` for the embedding and the head, so
the stock engine all-reduces the tied weight's gradient between the first and last stages
in its ``ReduceTiedGrads``, as Spotline's engine does with its own tie (without it the stock
step skips that all-reduce: 60 ms a step at gpt2-big, charged to Spotline).

Started by the bench (one process per rank, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK
in the environment, as ``spotline train`` starts its workers); rank 0 prints a progress line
after each step (as a ``spotline train`` coordinator does: ``--alternate`` waits for the
first) and writes a JSON result.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

TIED_NOTE = (
    "a tied LM head is tied by DeepSpeed's TiedLayerSpec in the stock model and by Spotline's "
    "own tie in Spotline's: both all-reduce its gradient between the first and last stages"
)


TIED_KEY = "token-embedding"


def tied_head_forward(embedding: Any, hidden_states: Any) -> Any:
    """The LM head on the tied embedding module (``TiedLMHeadPipe.forward``'s op)."""
    import torch.nn.functional as F

    return F.linear(hidden_states, embedding.embedding.weight)


def deepspeed_tied(specs: list[Any]) -> list[Any]:
    """Spotline's layers with a tied head (``TiedLMHeadPipe``, its own copy of the
    embedding) tied by DeepSpeed instead: the embedding and the head as two ``TiedLayerSpec``
    of one key, the head's forward :func:`tied_head_forward`. Untied models are unchanged."""
    from deepspeed.pipe import TiedLayerSpec

    from spotline.models.layers import TiedLMHeadPipe, TokenEmbeddingPipe

    if specs[-1].typename is not TiedLMHeadPipe:
        return specs
    assert specs[0].typename is TokenEmbeddingPipe, specs[0]
    attr = ["embedding.weight"]
    first = TiedLayerSpec(
        TIED_KEY, TokenEmbeddingPipe, *specs[0].module_args, tied_weight_attr=attr
    )
    head = TiedLayerSpec(
        TIED_KEY,
        TokenEmbeddingPipe,
        *specs[-1].module_args,
        forward_fn=tied_head_forward,
        tied_weight_attr=attr,
    )
    return [first, *specs[1:-1], head]


def run(config_path: str, output: Path) -> dict[str, Any] | None:
    """Train the config's run on this rank with the stock engine; rank 0 returns the result."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from spotline.config import load_config
    from spotline.data.inputs import prepare_inputs
    from spotline.launch.bench.alternate import READY_MARK
    from spotline.models import layers as models
    from spotline.pipeline.engine import deepspeed_config_for, step_batches
    from spotline.pipeline.instruction_profile import (
        InstructionProfile,
        instrument,
        profile_dir,
        write_profile,
    )
    from spotline.runtime import (
        configure_process,
        init_distributed,
        peak_rss_mib,
        seed_everything,
    )
    from spotline.worker.engine_builder import global_sampler, quiet_libraries
    from spotline.worker.loop import StepDone, StepHooks, StepLog, run_steps

    cfg = load_config(config_path)
    sl = cfg.spotline
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    assert world_size == cfg.num_workers, (world_size, cfg.num_workers)
    quiet_libraries()
    configure_process(
        intra_op_threads=sl.determinism.intra_op_threads, deterministic=sl.determinism.enabled
    )
    seed_everything(sl.training.seed)
    # The same model config and corpus as Spotline's entry points.
    inputs = prepare_inputs(cfg)
    hf_config, corpus = inputs.hf_config, inputs.corpus
    samples_per_step = cfg.samples_per_step
    init_distributed()
    t_setup = time.perf_counter()
    module = models.build_pipeline_module(
        hf_config,
        cfg.num_stages,
        seed=sl.training.seed,
        activation_checkpoint_interval=cfg.activation_checkpoint_interval,
        layer_specs=deepspeed_tied(models.build_layer_specs(hf_config, seed=sl.training.seed)),
    )
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        # Stock DeepSpeed has no logical workers: each is a physical pipeline of its own.
        config=deepspeed_config_for(cfg.deepspeed, num_physical_pipelines=cfg.num_logical_workers),
    )
    setup_s = time.perf_counter() - t_setup
    profile = InstructionProfile() if profile_dir() else None
    if profile is not None:
        instrument(engine, profile)
    sampler = global_sampler(cfg, len(corpus))
    pipeline_id = int(engine.grid.data_parallel_id)

    def get_batch(step: int, logical_worker: int, micro_batch: int) -> Any:
        return corpus.batch(sampler.indices(step, logical_worker, micro_batch))

    def train_step(step: int) -> float:
        loss = engine.train_batch(
            data_iter=step_batches(
                get_batch,
                step=step,
                logical_worker=pipeline_id,
                num_micro_batches=cfg.num_micro_batches,
            )
        )
        return float(loss)

    class Progress(StepHooks):
        def after_step(self, done: StepDone) -> None:
            # The line a coordinator prints (tracking.Tracker): the bench's start-up mark.
            print(f"{READY_MARK.decode()}{done.step + 1}/{sl.training.steps}", flush=True)

    log = StepLog()
    hooks: list[StepHooks] = [log, Progress()] if rank == 0 else [log]
    wall_s = run_steps(train_step, start=0, stop=sl.training.steps, hooks=hooks).wall_s
    losses = list(log.losses.values())
    step_times = list(log.step_times.values())
    if profile is not None:
        write_profile(profile, f"stock-rank{rank}")

    mine = torch.tensor([peak_rss_mib()], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    result: dict[str, Any] | None = None
    if rank == 0:
        from spotline.atomic_files import write_json_atomic

        result = {
            "engine": "deepspeed.runtime.pipe.engine.PipelineEngine (deepspeed.initialize)",
            "deepspeed_version": deepspeed.__version__,
            "steps": sl.training.steps,
            "losses": losses,
            "final_loss": losses[-1],
            "samples_per_s": sl.training.steps * samples_per_step / wall_s,
            "wall_s": wall_s,
            "setup_s": setup_s,
            "step_time_s": sorted(step_times)[len(step_times) // 2],
            # Rank 0's step times and ends (Unix time), as a spotline train summary has them.
            "step_times_s": step_times,
            "step_ended_at_s": list(log.step_ends.values()),
            "workers": cfg.num_workers,
            "stages": cfg.num_stages,
            "pipelines": cfg.num_logical_workers,
            "micro_batch_size": cfg.micro_batch_size,
            "micro_batches": cfg.num_micro_batches,
            "model": sl.model.name,
            "peak_rss_mib_per_rank": [float(g[0]) for g in gathered],
            # Rank 0 holds the embedding: the tie DeepSpeed all-reduces, if the model has one.
            "tied_by_deepspeed": sorted(module.tied_comms),
            "note": TIED_NOTE,
        }
        write_json_atomic(output, result)
    dist.barrier()
    # As the data-parallel bench worker: no gloo group left to the exit's destructors.
    dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="spotline-stock-worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", required=True, help="a resolved Spotline config JSON")
    parser.add_argument("--output", required=True, help="the JSON file rank 0 writes")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run(args.config, Path(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
