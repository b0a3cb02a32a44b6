"""Memory capacity: how many logical stages one worker can hold, its own and its replicas.

A worker (one slot: one accelerator) holds the logical stages of its physical stage and, with
Bamboo's redundancy on, the replica of its successor physical stage's (the last physical
stage holds the first's; a single physical stage has no replica:
:func:`spotline.plan.placement.replica_of`). A real accelerator holds its own stage and one
replica (Bamboo), so the default capacity is 2 stages; the configuration
(``spotline.redundancy.stages_per_worker``) may allow more where memory permits.

The planner (:mod:`spotline.plan.layout`) never produces a layout in which some worker
holds more than its capacity: a membership too small to hold the model within it waits
for workers while every stage's state survives, and falls back to the checkpoint when some
stage's state is lost. With the default capacity and redundancy on, a worker never runs two
stages (two of its own and a replica would be three): too few workers for one stage each
is a wait, not a fold.

Which groupings fit: ``n`` physical stages cut the ``S`` logical stages into a cyclic
sequence of ``n`` group sizes summing to ``S`` (any composition of ``S`` into ``n`` parts is
a contiguous grouping). Without replicas each size must be at most ``C``: possible exactly
when ``S <= n * C``. With replicas, ``n <= 2`` makes every worker hold all ``S`` stages
(``S <= C``); for ``n >= 3`` each pair of cyclically adjacent sizes must sum to at most
``C``, so ``2 * S <= n * C``, and ``floor(n * C / 2)`` is reached (all ``C / 2`` for an even
``C``; for an odd ``C``, ``(C + 1) / 2`` and ``(C - 1) / 2`` alternating, with one extra
``(C - 1) / 2`` closing an odd cycle): possible exactly when ``S <= floor(n * C / 2)``
(:func:`Capacity.allows`, checked against every grouping in tests/test_capacity.py).

Pure code (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spotline.plan.placement import replica_of

DEFAULT_STAGES_PER_WORKER = 2
"""Bamboo's: a worker's own stage and its successor's replica."""


@dataclass(frozen=True)
class Capacity:
    """At most ``stages_per_worker`` logical stages on one worker, counting the replicas it
    holds when ``replicas`` (redundancy on)."""

    stages_per_worker: int = DEFAULT_STAGES_PER_WORKER
    replicas: bool = True

    def __post_init__(self) -> None:
        # bool is an int to Python; a capacity of True is a mistake, not 1.
        if type(self.stages_per_worker) is not int or self.stages_per_worker < 1:
            raise ValueError(
                f"stages per worker must be an integer >= 1, got {self.stages_per_worker!r}"
            )
        if self.replicas and self.stages_per_worker < 2:
            raise ValueError(
                f"stages per worker is {self.stages_per_worker} but with redundancy on a "
                "worker holds its own stage and a replica: use at least 2, or redundancy off"
            )

    def held(self, groups: Sequence[Sequence[int]], index: int) -> int:
        """Logical stages a worker of physical stage ``index`` holds in a layout of ``groups``."""
        successor = replica_of(index, len(groups)) if self.replicas else None
        return len(groups[index]) + (len(groups[successor]) if successor is not None else 0)

    def fits(self, groups: Sequence[Sequence[int]]) -> bool:
        """Whether every worker of a layout of ``groups`` holds at most its capacity."""
        return all(self.held(groups, i) <= self.stages_per_worker for i in range(len(groups)))

    def allows(self, num_stages: int, num_physical: int) -> bool:
        """Whether some grouping of ``num_stages`` logical stages into ``num_physical``
        physical stages fits (the module docstring proves the bound)."""
        assert 1 <= num_physical <= num_stages
        capacity = self.stages_per_worker
        if not self.replicas:
            return num_stages <= num_physical * capacity
        if num_physical <= 2:
            return num_stages <= capacity  # every worker holds every stage
        return num_stages <= num_physical * capacity // 2

    def fewest_physical_stages(self, num_stages: int) -> int:
        """The fewest physical stages a layout of ``num_stages`` within capacity needs (as
        many as stages at most: one stage per worker always fits, ``stages_per_worker >= 2``
        with replicas)."""
        return next(n for n in range(1, num_stages + 1) if self.allows(num_stages, n))

    def fewest_workers(self, num_stages: int, num_pipelines: int, *, elastic: bool) -> int:
        """The fewest live workers for which the planner finds a layout within capacity:
        one pipeline of the fewest physical stages in the elastic mode (it drops pipelines
        first), every one of the ``num_pipelines`` rigid ones otherwise."""
        fewest = self.fewest_physical_stages(num_stages)
        return fewest if elastic else fewest * num_pipelines

    def describe(self) -> str:
        """``"2 stages per worker (own + replicas)"``, for messages."""
        what = "own + replicas" if self.replicas else "own, redundancy off"
        return f"{self.stages_per_worker} stage(s) per worker ({what})"
