"""Memory capacity: how many logical stages one worker can hold, its own and its replica.

A worker (one slot: one accelerator) has room for ``C`` logical stages
(``spotline.redundancy.stages_per_worker``; default 2, Bamboo's: its own stage and one
replica). In the steady state, one stage per worker, the second place holds the replica of
the successor physical stage (:func:`spotline.plan.placement.replica_of`); a takeover runs
the lost stage from that replica in that same place (Bamboo's failover: the predecessor
runs two stages). So a worker may *run* up to ``C`` stages, and its replica counts only in
the room its own stages leave: a layout that would have some worker run more than ``C``
(the old planner folded all 8 stages of a model onto one node) is never produced. A
membership too small for that waits for workers while every stage's state survives, and
falls back to the checkpoint when some stage's state is lost. With redundancy on, ``C`` is
at least 2 (the steady state's stage and replica). The rule is the same for every
recovery policy: the checkpoint-restart baseline keeps no replica and runs up to ``C``
stages on a worker as well.

What the runtime keeps beyond that: a worker running ``C`` stages still holds its
successor's replica (the ring of replicas is uniform), in host memory with the default
``spotline.redundancy.replica_device`` ("host"); that replica is not counted.

Sharded replicas (``spotline.redundancy.replica: "sharded"``) keep ``1/D`` of the
successor's state in the steady state, but the rule counts the replica as the whole stage
all the same, on purpose: the place exists for the takeover, and a takeover runs the whole
stage there (assembled from the shards), so a worker still needs room for its stage and its
successor's. What sharding saves is steady-state memory below that room (model state
``1 + 1/D`` of off's instead of 2x), not a stage of capacity.

Which shapes fit: ``n`` physical stages cut the ``S`` logical stages into ``n`` contiguous
groups, and some grouping has every group at most ``C`` exactly when ``S <= n * C``
(:meth:`Capacity.allows`); the fewest physical stages are ``ceil(S / C)``.

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
    """Room for ``stages_per_worker`` logical stages on one worker; ``replicas``: redundancy
    is on, so the steady state's replica needs one of those places."""

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

    def keeps_replica(self, groups: Sequence[Sequence[int]], index: int) -> bool:
        """Whether a worker of physical stage ``index`` has room for its successor's replica
        beside the stages it runs (a single physical stage has no replica)."""
        successor = replica_of(index, len(groups)) if self.replicas else None
        return (
            successor is not None
            and len(groups[index]) + len(groups[successor]) <= self.stages_per_worker
        )

    def held(self, groups: Sequence[Sequence[int]], index: int) -> int:
        """Logical stages counted against a worker of physical stage ``index``: those it
        runs, and its successor's replica where they leave room for it."""
        successor = replica_of(index, len(groups))
        replica = len(groups[successor]) if successor is not None else 0
        return len(groups[index]) + (replica if self.keeps_replica(groups, index) else 0)

    def fits(self, groups: Sequence[Sequence[int]]) -> bool:
        """Whether no worker of a layout of ``groups`` runs more stages than it has room for."""
        return all(len(group) <= self.stages_per_worker for group in groups)

    def allows(self, num_stages: int, num_physical: int) -> bool:
        """Whether some grouping of ``num_stages`` logical stages into ``num_physical``
        physical stages fits (the module docstring)."""
        assert 1 <= num_physical <= num_stages
        return num_stages <= num_physical * self.stages_per_worker

    def fewest_physical_stages(self, num_stages: int) -> int:
        """The fewest physical stages a layout of ``num_stages`` within capacity needs."""
        return -(-num_stages // self.stages_per_worker)  # ceil

    def fewest_workers(self, num_stages: int, num_pipelines: int, *, elastic: bool) -> int:
        """The fewest live workers for which the planner finds a layout within capacity:
        one pipeline of the fewest physical stages in the elastic mode (it drops pipelines
        first), every one of the ``num_pipelines`` rigid ones otherwise."""
        fewest = self.fewest_physical_stages(num_stages)
        return fewest if elastic else fewest * num_pipelines

    def describe(self) -> str:
        """``"2 stage(s) per worker"``, for messages."""
        return f"{self.stages_per_worker} stage(s) per worker"
