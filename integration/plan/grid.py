"""A generation's grid: which worker runs each (physical pipeline, physical stage), and
which contiguous logical stages each physical stage runs.

The bottom of the planner: :mod:`spotline.plan.placement` (where copies live) and
:mod:`spotline.plan.layout` (how the grid is chosen, generation after generation) both read
it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def pipeline_name(pipeline: int) -> str:
    """A physical pipeline's name as ``spotline.plan.logical`` assigns logical workers to it:
    zero-padded, so that name order is index order (``p0002`` before ``p0010``)."""
    assert pipeline >= 0
    return f"p{pipeline:04d}"


@dataclass(frozen=True)
class Layout:
    """Physical stages (groups of logical stages) and the worker on each slot.

    ``num_pipelines`` counts physical pipelines (rows of ``slots``): the logical count,
    except in the planner's elastic mode."""

    num_stages: int
    num_pipelines: int
    groups: tuple[tuple[int, ...], ...]
    slots: tuple[tuple[str, ...], ...]  # [pipeline][physical stage] -> worker
    standby: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        flat = [s for g in self.groups for s in g]
        assert flat == list(range(self.num_stages)), (
            f"groups {self.groups} must cover stages in order"
        )
        assert len(self.slots) == self.num_pipelines
        assert all(len(row) == len(self.groups) for row in self.slots)
        workers = [w for row in self.slots for w in row]
        assert len(set(workers)) == len(workers), f"a worker holds two slots: {self.slots}"

    @property
    def num_physical_stages(self) -> int:
        return len(self.groups)

    @functools.cached_property
    def members(self) -> tuple[str, ...]:
        """Workers in rank order: DeepSpeed's pipe-major topology, rank = stage * P + pipeline."""
        return tuple(
            self.slots[pipeline][stage]
            for stage in range(self.num_physical_stages)
            for pipeline in range(self.num_pipelines)
        )

    def rank_of(self, worker: str) -> int:
        return self.members.index(worker)

    def slot_of(self, worker: str) -> tuple[int, int]:
        for pipeline, row in enumerate(self.slots):
            if worker in row:
                return pipeline, row.index(worker)
        raise KeyError(worker)

    def stages_of(self, worker: str) -> tuple[int, ...]:
        return self.groups[self.slot_of(worker)[1]]

    def describe(self, worker: str) -> str:
        """``"p0:s1+s2"`` for a member, ``"standby"`` otherwise (for timelines)."""
        if worker in self.standby or worker not in self.members:
            return "standby"
        pipeline, _ = self.slot_of(worker)
        return f"p{pipeline}:" + "+".join(f"s{s}" for s in self.stages_of(worker))

    def logical_placement(
        self, generation: int, assignment: Mapping[str, Sequence[int]]
    ) -> dict[str, Any]:
        """``generation``'s entry of ``summary.json``'s ``logical_placements``: each physical
        pipeline's workers (in stage order) and the logical workers ``assignment`` gives it
        (keyed by :func:`pipeline_name`). Every entry point lists its placements so."""
        return {
            "generation": generation,
            "pipelines": [
                {"workers": list(row), "logical_workers": list(assignment[pipeline_name(p)])}
                for p, row in enumerate(self.slots)
            ],
        }

    def to_json(self) -> dict[str, Any]:
        """The layout as JSON (the plans the coordinator publishes carry it)."""
        return {
            "num_stages": self.num_stages,
            "num_pipelines": self.num_pipelines,
            "groups": [list(g) for g in self.groups],
            "slots": [list(r) for r in self.slots],
            "standby": list(self.standby),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Layout:
        return cls(
            num_stages=int(raw["num_stages"]),
            num_pipelines=int(raw["num_pipelines"]),
            groups=tuple(tuple(int(s) for s in g) for g in raw["groups"]),
            slots=tuple(tuple(str(w) for w in r) for r in raw["slots"]),
            standby=tuple(str(w) for w in raw["standby"]),
        )
