"""One rank of the exact-reduction tests (tests/test_exact.py).

Every rank builds the same six logical workers' gradients from a fixed seed. For each case
on the command line (``GROUPS``, ``GROUPS@POISON`` or either with ``#ELEMENTS``, e.g.
"0,1,2;3,4,5": rank 0 hosts 0, 1 and 2; ``@4``: logical worker 4's gradient has a NaN;
``#3000``: chunks of 3000 elements instead of spotline.exact.reduction.CHUNK; a case naming
workers 0 and 1 only sums those two) the first
``len(GROUPS)`` ranks keep the gradients it assigns them, reduce them with
spotline.exact.reduction.exact_sum over a gloo group of just those ranks, and write the result's
SHA-256 (or the error) to ``out_dir/case{i}-rank{r}.json``. One launch runs every case: a
process group per grouping instead of a set of processes per grouping.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from spotline.exact import reduction as exact
from spotline.exact.reduction import NonFiniteGradient, exact_sum

NUM_LOGICAL_WORKERS = 6


def gradients(poison: int | None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    # Magnitudes spread over six decades, and a length that is not a whole number of blocks.
    grads = [
        torch.randn(10_007, generator=generator) * 10.0 ** (worker - 3)
        for worker in range(NUM_LOGICAL_WORKERS)
    ]
    if poison is not None:
        grads[poison][17] = float("nan")
    return grads


def _not_for_a_pair(*args: object, **kwargs: object) -> None:
    raise AssertionError("two logical workers on two processes took the sharded fold")


def main() -> None:
    out_dir, cases = sys.argv[1], sys.argv[2:]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    default_chunk = exact.CHUNK
    for index, full_case in enumerate(cases):
        case, _, chunk_text = full_case.partition("#")
        exact.CHUNK = int(chunk_text) if chunk_text else default_chunk
        groups, _, poison_text = case.partition("@")
        poison = int(poison_text) if poison_text else None
        hosts = groups.split(";")
        # Every rank takes part in creating each group, members or not (new_group's rule).
        group = dist.new_group(list(range(len(hosts))))
        if rank >= len(hosts):
            continue
        mine = [int(w) for w in hosts[rank].split(",")]
        num_logical_workers = len(groups.replace(";", ",").split(","))
        # The pair's sum must take the plain all-reduce, not the general sharded fold.
        exact_sharded_sum = exact._sharded_sum
        if num_logical_workers == 2:
            exact._sharded_sum = _not_for_a_pair
        grads = gradients(poison)
        try:
            total = exact_sum(
                [(w, grads[w]) for w in mine],
                # The workers the case names: all six, or the first two ("0;1", the pair
                # that a plain all-reduce sums).
                num_logical_workers=num_logical_workers,
                group=group,
            )
            result = {"sha256": hashlib.sha256(total.numpy().tobytes()).hexdigest()}
        except NonFiniteGradient as exc:
            result = {"non_finite": list(exc.logical_workers)}
        exact._sharded_sum = exact_sharded_sum
        with open(os.path.join(out_dir, f"case{index}-rank{rank}.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
