"""One rank of ``spotline bench reduce``: the exact reduction against a plain float one.

Each rank hosts ``logical_workers / ranks`` logical workers with a gradient of
``elements`` float32 values each, and times, alternating, ``repeats`` rounds of
(a) the usual data-parallel reduction: sum the local workers' gradients in float, then a
gloo all_reduce SUM of float32; (b) :func:`spotline.exact.reduction.exact_sum`. Rank 0 writes the
medians and the payload sizes to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from spotline.exact.reduction import bytes_sent_per_process, exact_sum, ring_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--elements", type=int, required=True)
    parser.add_argument("--logical-workers", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = args.logical_workers // world
    generator = torch.Generator().manual_seed(rank)
    local = [
        (rank * per_rank + k, torch.randn(args.elements, generator=generator))
        for k in range(per_rank)
    ]

    def plain() -> None:
        total = local[0][1].clone()
        for _, g in local[1:]:
            total += g
        dist.all_reduce(total)

    # As training reduces (spotline.exact.reduction.LogicalGradients): into a buffer kept across steps.
    out = torch.empty(args.elements, dtype=torch.float32)

    def exact() -> None:
        exact_sum(local, num_logical_workers=args.logical_workers, out=out)

    times: dict[str, list[float]] = {"plain": [], "exact": []}
    for _ in range(2):  # warm-up: connections, allocations
        plain()
        exact()
    for _ in range(args.repeats):
        for name, fn in (("plain", plain), ("exact", exact)):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        report = {
            "ranks": world,
            "logical_workers": args.logical_workers,
            "elements": args.elements,
            "repeats": args.repeats,
            "plain_ms": statistics.median(times["plain"]) * 1e3,
            "exact_ms": statistics.median(times["exact"]) * 1e3,
            # Each repeat ran both back to back: its exact / float pair.
            "time_ratios": [e / p for e, p in zip(times["exact"], times["plain"], strict=True)],
            # What each rank sends: a ring all-reduce sends 2 (M - 1) / M of its payload; the
            # exact sum's MAX carries an int32 per logical worker (which process hosts it).
            "plain_bytes": ring_bytes(4 * args.elements, world),
            "exact_bytes": bytes_sent_per_process(args.elements, [per_rank] * world)
            + ring_bytes(4 * args.logical_workers, world),
        }
        with open(args.out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
