"""One rank of ``spotline bench overlap``: can this host hide the replica exchange?

Every rank holds a stage's reduced gradient (``elements`` float32 values) and a replica of
the same size with its AdamW optimizer. It times, alternating, ``repeats`` rounds of:

- ``exchange``: lazy redundancy's ring exchange (``redundancy.ReplicaGradRecv``): send the
  gradient to the predecessor and receive the successor's, posted together and waited for;
- ``step``: the replica's AdamW step over the same number of elements;
- ``both``: the exchange posted, the step run, then the exchange waited for;
- ``beside_idle``: the same on even ranks, while odd ranks only exchange: the exchange
  beside a peer that is otherwise idle, as in a pipeline bubble (with 2 ranks, rank 0
  computes and rank 1 waits).

When ``both`` takes ``step`` alone, the exchange hid behind compute (its bytes moved by
hardware that was otherwise idle: a GPU's copy engines and network). When it takes
``exchange + step``, the transfer competes with compute for the same cores (a CPU host's
TCP copies) and only idle time could absorb it. Rank 0 writes the medians and each
round's hidden fraction ``(exchange + step - both) / exchange`` (and the same with
``beside_idle``), all timed on rank 0, an even rank, to ``--output`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


def stage_gradient(rank: int, elements: int) -> torch.Tensor:
    """Rank ``rank``'s gradient: every rank can rebuild its successor's to check delivery."""
    return torch.randn(elements, generator=torch.Generator().manual_seed(rank))


def timed_rounds(
    variants: dict[str, Callable[[], None]], repeats: int, cuda: bool
) -> dict[str, list[float]]:
    """Milliseconds of each variant, ``repeats`` rounds of all of them in turn, each started
    together on every rank (a barrier) and ended when its work is done (on a GPU too)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                # The step's kernels and the exchange's stream both finished.
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--elements", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda" if cuda else "cpu")
    gradient = stage_gradient(rank, args.elements).to(device)
    received = torch.empty_like(gradient)
    generator = torch.Generator().manual_seed(world + rank)
    replica = torch.nn.Parameter(torch.randn(args.elements, generator=generator).to(device))
    replica.grad = torch.randn(args.elements, generator=generator).to(device)
    optimizer = torch.optim.AdamW([replica], lr=1e-4)
    predecessor, successor = (rank - 1) % world, (rank + 1) % world

    def post() -> list[dist.Work]:
        return dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, gradient, predecessor),
                dist.P2POp(dist.irecv, received, successor),
            ]
        )

    def finish(works: list[dist.Work]) -> None:
        for work in works:
            work.wait()

    def exchange() -> None:
        finish(post())

    def both() -> None:
        works = post()
        optimizer.step()
        finish(works)

    variants: dict[str, Callable[[], None]] = {
        "exchange": exchange,
        "step": optimizer.step,
        "both": both,
        "beside_idle": both if rank % 2 == 0 else exchange,
    }
    for fn in variants.values():  # warm-up: connections, allocations, the optimizer state
        fn()
    # The exchange moved the successor's gradient, bit for bit.
    if not torch.equal(received.cpu(), stage_gradient(successor, args.elements)):
        raise SystemExit(f"rank {rank}: the exchange did not deliver rank {successor}'s gradient")
    ms = timed_rounds(variants, args.repeats, cuda)
    if rank == 0:

        def hidden(variant: str) -> list[float]:
            rounds = zip(ms["exchange"], ms["step"], ms[variant], strict=True)
            return [(e + s - b) / e for e, s, b in rounds]

        report = {
            "ranks": world,
            "elements": args.elements,
            "repeats": args.repeats,
            "device": args.device,
            "backend": dist.get_backend(),
            **{f"{name}_ms": statistics.median(t) for name, t in ms.items()},
            "hidden_fractions": hidden("both"),
            "hidden_fractions_beside_idle": hidden("beside_idle"),
            "rounds_ms": ms,
            # Each direction of the ring carries one stage's gradient.
            "bytes_sent_per_rank": gradient.numel() * gradient.element_size(),
        }
        with open(args.output, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
