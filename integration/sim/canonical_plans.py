"""The runtime's planner as the simulator calls it: canonical names, memoized.

:class:`CanonicalPlanner` asks :mod:`spotline.plan.layout` (the function the coordinator
calls at each generation) for a layout with workers named after their slots, so that a
sweep of thousands of runs plans each situation once; :class:`CanonicalPlan` is its answer,
and :class:`PlacedMembers` the answer placed on the real workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from spotline.plan.capacity import Capacity
from spotline.plan.grid import Layout
from spotline.plan.layout import (
    FatalLoss,
    Holding,
    WaitForCapacity,
    WorkerReport,
    initial_layout,
    member_holdings,
    plan_generation,
)

Slot = tuple[int, int]  # (physical pipeline, physical stage)


@dataclass(frozen=True)
class CanonicalPlan:
    """A planned layout with canonical names, and where each slot's worker comes from:
    ``kept`` (new slot, its slot in the last layout) and ``joined`` (new slot, index among
    the idle nodes). Idle nodes not placed stand by."""

    layout: Layout
    kept: tuple[tuple[Slot, Slot], ...]
    joined: tuple[tuple[Slot, int], ...]
    shape: Layout  # the layout with members named after their slots, no standbys
    moves_state: bool  # some member must receive a stage it does not hold

    @staticmethod
    def of(layout: Layout, held: dict[str, tuple[Holding, ...]] | None = None) -> CanonicalPlan:
        kept: list[tuple[Slot, Slot]] = []
        joined: list[tuple[Slot, int]] = []
        for p, row in enumerate(layout.slots):
            for i, name in enumerate(row):
                if name.startswith("m"):
                    old_p, old_i = name[1:].split(".")
                    kept.append(((p, i), (int(old_p), int(old_i))))
                else:
                    joined.append(((p, i), int(name[1:])))
        moves = held is not None and any(
            # A shard is not the stage: a member holding only a shard receives the rest.
            not set(layout.groups[i]) <= {h.stage for h in held.get(name, ()) if h.whole}
            for row in layout.slots
            for i, name in enumerate(row)
        )
        return CanonicalPlan(layout, tuple(kept), tuple(joined), _canonical(layout), moves)

    def place(self, last: dict[Slot, str], idle: Sequence[str]) -> dict[Slot, str]:
        """The real node on each slot, given the last layout's and the idle nodes."""
        placed = {new: last[old] for new, old in self.kept}
        placed.update((new, idle[k]) for new, k in self.joined)
        return placed


PlannerAnswer = CanonicalPlan | None | WaitForCapacity | FatalLoss
"""A replan: a plan, None (waiting for nodes), a wait for capacity, or a fatal loss."""


class CanonicalPlanner:
    """The runtime's planner (:mod:`spotline.plan.layout`), called with canonical worker
    names and memoized, so that a sweep of thousands of runs plans each situation once.

    A situation is the last layout's shape (groups, physical pipelines), which of its slots
    were lost, and how many idle nodes there are. Members are named ``m{p}.{i}`` after their
    slot and idle nodes ``i{k}`` after their order: a plan depends on the workers' order,
    never on their names (tests/test_layout.py checks this), so the canonical plan holds for
    the real nodes. With machines of several slots the situation also says which workers
    share a machine, as machines numbered in order of first appearance among the workers
    (:func:`_partition`): the placement rule groups workers by machine and breaks ties by
    worker order, never by a machine's name.
    """

    # Shared by every run of a process (a sweep runs thousands): the planner is pure.
    _plans: ClassVar[dict[tuple[object, ...], PlannerAnswer]] = {}

    def __init__(
        self,
        num_stages: int,
        num_pipelines: int,
        *,
        elastic: bool,
        capacity: Capacity,
        sharded: bool = False,
    ) -> None:
        self.num_stages = num_stages
        self.num_pipelines = num_pipelines
        self.elastic = elastic
        self.capacity = capacity
        self.sharded = sharded

    def initial(
        self, num_workers: int, machines: Sequence[str] | None = None
    ) -> CanonicalPlan | None:
        """A start from nothing (first start, or the restart after a fatal loss) on
        ``num_workers`` ready workers; ``machines``: the machine of each (None: not said)."""
        partition = None if machines is None else _partition(machines)
        key: tuple[object, ...] = (
            self.num_stages,
            self.num_pipelines,
            self.elastic,
            self.capacity,
            num_workers,
        )
        if partition is not None:
            key += (partition,)
        if key not in self._plans:
            idle = [f"i{k}" for k in range(num_workers)]
            said = None if partition is None else dict(zip(idle, _named(partition), strict=True))
            layout = initial_layout(
                self.num_stages,
                self.num_pipelines,
                idle,
                elastic=self.elastic,
                machines=said,
                capacity=self.capacity,
                sharded=self.sharded,
            )
            self._plans[key] = None if layout is None else CanonicalPlan.of(layout)
        planned = self._plans[key]
        assert not isinstance(planned, (FatalLoss, WaitForCapacity))
        return planned

    def replan(
        self,
        last: Layout,
        lost: frozenset[Slot],
        num_idle: int,
        machines: tuple[Mapping[Slot, str], Sequence[str]] | None = None,
    ) -> PlannerAnswer:
        """The next generation after ``last`` (canonical), whose slots ``lost`` are gone,
        with ``num_idle`` idle nodes: a plan, None (waiting for nodes), a wait for capacity
        (the survivors hold the state, too few to hold it within capacity) or a FatalLoss.
        ``machines``: the machine of each of ``last``'s slots and of each idle node (None:
        not said)."""
        survivors = [
            (p, i)
            for i in range(last.num_physical_stages)
            for p in range(last.num_pipelines)
            if (p, i) not in lost
        ]
        partition = None
        if machines is not None:
            by_slot, idle_machines = machines
            assert len(idle_machines) == num_idle
            partition = _partition([by_slot[slot] for slot in survivors] + list(idle_machines))
        key: tuple[object, ...] = (
            self.num_stages,
            self.num_pipelines,
            self.elastic,
            self.capacity,
            last.groups,
            last.num_pipelines,
            lost,
            num_idle,
            self.sharded,
        )
        if partition is not None:
            key += (partition,)
        if key not in self._plans:
            held = member_holdings(last, 1, replicas=True, sharded=self.sharded)
            reports = [
                WorkerReport(last.slots[p][i], held[last.slots[p][i]], (p, i)) for p, i in survivors
            ] + [WorkerReport(f"i{k}") for k in range(num_idle)]
            if partition is not None:
                reports = [
                    dataclasses.replace(report, machine=machine)
                    for report, machine in zip(reports, _named(partition), strict=True)
                ]
            result = plan_generation(
                0,
                self.num_stages,
                self.num_pipelines,
                reports,
                elastic=self.elastic,
                capacity=self.capacity,
                sharded=self.sharded,
            )
            if isinstance(result, (FatalLoss, WaitForCapacity)):
                self._plans[key] = result
            else:
                self._plans[key] = (
                    None if result.layout is None else CanonicalPlan.of(result.layout, held)
                )
        return self._plans[key]


def _partition(machines: Sequence[str]) -> tuple[int, ...]:
    """Which workers share a machine, whatever the machines' names: each worker's machine
    numbered in order of first appearance (``["b", "a", "b"]`` -> ``(0, 1, 0)``)."""
    numbers: dict[str, int] = {}
    return tuple(numbers.setdefault(machine, len(numbers)) for machine in machines)


def _named(partition: Sequence[int]) -> list[str]:
    """Canonical machine names for a :func:`_partition`."""
    return [f"M{number}" for number in partition]


def _canonical(layout: Layout) -> Layout:
    """``layout`` with each member named ``m{p}.{i}`` after its slot and no standbys."""
    return Layout(
        layout.num_stages,
        layout.num_pipelines,
        layout.groups,
        tuple(tuple(f"m{p}.{i}" for i in range(len(row))) for p, row in enumerate(layout.slots)),
    )


class PlacedMembers:
    """The running (or last) layout in the simulator: its canonical shape and the node on
    each slot."""

    def __init__(self, plan: CanonicalPlan, last: dict[Slot, str], idle: Sequence[str]) -> None:
        self.layout = plan.shape
        self.by_slot = plan.place(last, idle)
        self.slot_of = {node: slot for slot, node in self.by_slot.items()}
