"""Data-parallel-sharded replicas: which whole tensors of a logical stage each shard holds.

With ``spotline.redundancy.replica: "sharded"`` and ``D`` physical pipelines, the ``D``
replica holders of a stage (the predecessor physical stage of every pipeline) each hold one
shard of it instead of the whole: pipeline ``p`` holds shard ``p``. A shard is a set of
whole parameter tensors, never part of one: AdamW stepped on a whole tensor gives the
owner's bits exactly, while a tensor split at another boundary could change where the
optimizer's vectorised and scalar loops meet, and with it the bits.

Every rank must compute the same assignment from the same input, so the function is pure
and deterministic: the stage's ``(name, numel)`` list sorted by name, and ``D``.

Pure code (no torch).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def shard_names(
    named_numels: Sequence[tuple[str, int]], shards: int
) -> tuple[tuple[str, ...], ...]:
    """``shards`` disjoint tuples of names (each sorted by name) that cover ``named_numels``,
    balanced by element count: largest tensor first (ties: name order) onto the lightest
    shard so far (ties: the lowest index). Some shards may be empty when the stage has fewer
    tensors than shards. The heaviest shard exceeds the lightest by at most the largest
    tensor (the greedy's bound: a shard receives a tensor only while it is the lightest)."""
    if shards < 1:
        raise ValueError(f"shard count {shards}: expected at least 1")
    names = [n for n, _ in named_numels]
    if names != sorted(names) or len(set(names)) != len(names):
        raise ValueError("shard_names takes distinct names sorted by name")
    if any(k < 0 for _, k in named_numels):
        raise ValueError("shard_names takes element counts >= 0")
    # (load, index): the lightest shard, and among equally light ones the lowest index.
    heap = [(0, index) for index in range(shards)]
    chosen: list[list[str]] = [[] for _ in range(shards)]
    for name, numel in sorted(named_numels, key=lambda item: (-item[1], item[0])):
        load, index = heapq.heappop(heap)
        chosen[index].append(name)
        heapq.heappush(heap, (load + numel, index))
    return tuple(tuple(sorted(names)) for names in chosen)


def shard_of(named_numels: Sequence[tuple[str, int]], shard: int, shards: int) -> tuple[str, ...]:
    """The names of shard ``shard`` of ``shards`` (:func:`shard_names`)."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards}: expected 0 <= shard < shards")
    return shard_names(named_numels, shards)[shard]
