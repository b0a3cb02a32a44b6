"""Data-parallel-sharded replicas: which elements of a logical stage each shard holds.

With ``spotline.redundancy.replica: "sharded"`` and ``D`` physical pipelines, the ``D``
replica holders of a stage (the predecessor physical stage of every pipeline) each hold one
shard of it instead of the whole: pipeline ``p`` holds shard ``p``. The stage's tensors,
sorted by name, flattened and concatenated, make ``T`` elements; shard ``k`` of ``D`` is
the element range ``[k*T//D, (k+1)*T//D)``: exactly balanced (every shard holds the floor
or the ceiling of ``T/D``), which whole tensors cannot be (their sizes are multiples of the
hidden size). A shard is a tuple of :class:`Piece` s: flat ranges of tensors.

Why a range of a tensor steps to the owner's bits: AdamW (torch's single-tensor CPU path)
is element-wise, so each element's update depends only on that element's parameter,
gradient and state, never on where the tensor is split; a check stepped AdamW on tensors
split at arbitrary offsets (odd ones included) and got the unsplit tensor's bits
(``tests/test_shards.py``).

Every rank must compute the same assignment from the same input, so the function is pure
and deterministic: the stage's ``(name, numel)`` list sorted by name, and ``D``.

Pure code (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

# What each replica holder keeps of its successor (``spotline.redundancy.replica``): all of
# it, or (with D data-parallel pipelines) one of D equal element ranges of it.
ReplicaKind = Literal["full", "sharded"]
REPLICA_KINDS: tuple[ReplicaKind, ...] = get_args(ReplicaKind)


@dataclass(frozen=True)
class Piece:
    """The flat elements ``[start, stop)`` of tensor ``name`` (``0 <= start < stop <= numel``)."""

    name: str
    start: int
    stop: int

    def __post_init__(self) -> None:
        assert 0 <= self.start < self.stop, self

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def key(self) -> str:
        """The piece's name in holdings and digests. It starts with the tensor's name, and
        so with its global layer index (what ``stage_of_name`` reads)."""
        return f"{self.name}@{self.start}:{self.stop}"


def shard_pieces(
    named_numels: Sequence[tuple[str, int]], shard: int, shards: int
) -> tuple[Piece, ...]:
    """The pieces of shard ``shard`` of ``shards``: the element range
    ``[shard*T//shards, (shard+1)*T//shards)`` of the tensors of ``named_numels`` (distinct
    names sorted by name, ``T`` elements in all) concatenated, in name order. A range may
    be empty (fewer elements than shards); an empty tensor gives no piece."""
    if shards < 1:
        raise ValueError(f"shard count {shards}: expected at least 1")
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards}: expected 0 <= shard < shards")
    names = [n for n, _ in named_numels]
    if names != sorted(names) or len(set(names)) != len(names):
        raise ValueError("shard_pieces takes distinct names sorted by name")
    if any(k < 0 for _, k in named_numels):
        raise ValueError("shard_pieces takes element counts >= 0")
    total = sum(k for _, k in named_numels)
    lo, hi = shard * total // shards, (shard + 1) * total // shards
    out: list[Piece] = []
    offset = 0  # the tensor's first element in the concatenation
    for name, numel in named_numels:
        start, stop = max(lo, offset) - offset, min(hi, offset + numel) - offset
        if start < stop:
            out.append(Piece(name, start, stop))
        offset += numel
    return tuple(out)
