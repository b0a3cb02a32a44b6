"""One rank of ``spotline bench easyscale``'s data-parallel comparison.

Trains the config's model (a plain Hugging Face causal LM, no pipeline) with one logical
worker per process, on the global sampler's batches, either through DeepSpeed's stock
``DeepSpeedEngine`` (``deepspeed.initialize``: a float all-reduce of the gradients) or through
``spotline.exact.dp_engine.ExactDataParallelEngine`` (the same engine with the exact reduction over
logical workers and the logical worker's own dropout seeds). Both loops are the same code
apart from the engine, so the ratio of their step times is the cost of determinism.

Started by the bench with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK set; rank 0
writes a JSON result (median step time, per-rank peak RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def run(mode: str, config_path: str, steps: int, output: Path) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from spotline.config import load_config
    from spotline.data.loader import load_corpus
    from spotline.exact import dp_engine
    from spotline.models import layers as models
    from spotline.pipeline.engine import deepspeed_config_for
    from spotline.plan.sampler import GlobalSampler
    from spotline.runtime import configure_process, init_distributed, peak_rss_mib
    from spotline.worker.engine_builder import quiet_libraries

    cfg = load_config(config_path)
    sl = cfg.spotline
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    quiet_libraries()
    configure_process(
        intra_op_threads=sl.determinism.intra_op_threads, deterministic=sl.determinism.enabled
    )
    hf_config = models.load_hf_config(sl.model.name, sl.model.overrides)
    corpus = load_corpus(
        sl.data.path, sl.data.tokenizer, sl.model.seq_len, min_sequences=cfg.samples_per_step
    )
    sampler = GlobalSampler(
        num_samples=len(corpus),
        num_logical_workers=world,
        micro_batch_size=cfg.micro_batch_size,
        num_micro_batches=cfg.num_micro_batches,
        seed=sl.training.seed,
    )
    init_distributed()
    model = models.reference_model(hf_config, sl.training.seed)
    ds_config = deepspeed_config_for(cfg.deepspeed, num_physical_pipelines=world)
    m = cfg.num_micro_batches

    def micro_batches(step: int) -> list[Any]:
        return [corpus.batch(sampler.indices(step, rank, mb)) for mb in range(m)]

    def loss_of(engine: Any, batch: Any) -> Any:
        input_ids, labels = batch
        return models.causal_lm_loss(engine(input_ids=input_ids).logits, labels)

    if mode == "stock":
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config)

        def train_step(step: int) -> None:
            for batch in micro_batches(step):
                engine.backward(loss_of(engine, batch))
                engine.step()

    else:
        engine = dp_engine.initialize(
            model, ds_config, num_logical_workers=world, hosted_logical_workers=[rank]
        )

        def train_step(step: int) -> None:
            engine.train_logical_step(step, sl.training.seed, {rank: micro_batches(step)}, loss_of)

    times = []
    for step in range(steps):
        dist.barrier()  # every step starts together: the step time is the slowest rank's
        t0 = time.perf_counter()
        train_step(step)
        times.append(time.perf_counter() - t0)
    peaks = torch.tensor([peak_rss_mib()], dtype=torch.float64)
    gathered = [torch.zeros_like(peaks) for _ in range(world)]
    dist.all_gather(gathered, peaks)
    if rank == 0:
        measured = sorted(times[1:] or times)  # the first step pays one-off set-up costs
        result = {
            "mode": mode,
            "step_time_s": measured[len(measured) // 2],
            "samples_per_s": cfg.micro_batch_size * m * world / measured[len(measured) // 2],
            "peak_rss_mib_per_rank": [float(g[0]) for g in gathered],
        }
        output.write_text(json.dumps(result))
    dist.barrier()
    # Torn down here, not at interpreter exit: a gloo group left to the exit's destructors
    # can abort the process ("terminate called without an active exception", SIGABRT)
    # after its result is written, which the bench then reports as a failed rank.
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(prog="spotline-dp-bench-worker")
    parser.add_argument("--mode", choices=("stock", "exact"), required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    run(args.mode, args.config, args.steps, Path(args.output))


if __name__ == "__main__":
    main()
