"""Machine-aware placement: no machine holds every copy of a logical stage, where possible.

A *machine* (a host) runs several workers, one per slot; a preemption takes every worker of a
machine at once. The copies of a logical stage are the members that hold its state: every
member of the physical stage that runs it (data-parallel peers hold identical state) and, with
Bamboo's replicas, every member of the physical stage before it (:func:`replica_of`: a member
holds its successor's replica, the last physical stage the first's). A stage is *exposed*
when one machine holds every copy of it: losing that machine loses the stage (a fatal loss,
a fallback to the checkpoint).

The rule: with two machines or more, the planner places no stage exposed whenever some
placement of the layout's shape (``n`` physical stages x ``P`` pipelines) allows it, and says
which stages are exposed where none does. Columns are physical stages; the copies of a stage
in physical stage ``j`` are columns ``j - 1`` and ``j`` (all of them for ``n <= 2``). So a
stage is exposed exactly when its copies' columns are all one machine ("monochrome"):

- ``n = 1``: the one column is monochrome;
- ``n = 2``: both columns monochrome in one machine (every member holds every stage);
- ``n >= 3``: two cyclically adjacent columns monochrome in the same machine.

With sharded replicas over ``P >= 2`` pipelines (:func:`copy_sets`) a stage's replica
holders are one copy between them, lost with any one of them: the stage of column ``j`` is
exposed on a machine that holds all of column ``j`` and any slot of column ``j - 1``. Such a
placement exists exactly when no machine runs more than ``n * (P - 1)`` members. Needed: a
machine M running ``c = n * (P - 1) + k`` members, ``k >= 1``, has at least ``k`` columns
all its own; each needs its predecessor column free of M (a different column for each, and
not one of them), so M runs at most ``k * P + (n - 2k) * (P - 1) = n * (P - 1) + k * (2 - P)
< c`` members: a contradiction. Enough: :func:`_deal` gives M a run of ``c <= n * (P - 1)``
positions from the first, which leaves the last row free of M, and every other machine a
run no longer than M's; a column in every row takes a run of ``(P - 1) * n + 1``, so no
column is any one machine's.

When a placement without exposure exists (:func:`max_on_one_machine`): a machine running
``c`` of the ``N = n * P`` members leaves ``N - c`` others, so at least
``k = c - n * (P - 1)`` columns are monochrome in it; they must be pairwise non-adjacent:
``k <= 0`` for ``n = 1``, ``k <= 1`` for ``n = 2``, ``k <= n // 2`` on a cycle of
``n >= 3``. That bound on the most crowded machine is also sufficient: :func:`_deal` lays the
members, grouped by machine (most crowded first), round-robin over the columns taken in the
order 0, 2, 4, ..., 1, 3, ...; only the first machine's run can fill a whole column when
``P >= 2`` (a run of ``(P - 1) * n + 1`` is more than half the members), it fills exactly
``k`` of them, and those are even columns, pairwise non-adjacent; for ``P = 1`` it is the
classic even-then-odd arrangement of a cycle.

Pure code (no torch): the layout planner (``spotline.plan.layout``) calls :func:`place`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spotline.plan.grid import Layout


def replica_of(index: int, num_physical: int) -> int | None:
    """The physical stage whose replica the members of physical stage ``index`` hold (Bamboo:
    the successor; the last physical stage holds the first's). None: a single physical stage
    has no replica."""
    assert 0 <= index < num_physical
    return (index + 1) % num_physical if num_physical > 1 else None


@dataclass(frozen=True)
class Exposure:
    """A logical stage whose every copy is on one machine (``None``: machines not said)."""

    stage: int
    machine: str | None

    def __str__(self) -> str:
        where = "one machine (machines not said)" if self.machine is None else self.machine
        return f"stage {self.stage}: every copy on {where}"


def copies(layout: Layout) -> dict[int, tuple[str, ...]]:
    """Logical stage -> the members holding its state (owners and replica holders), rank order."""
    num_physical = layout.num_physical_stages
    held: dict[int, list[str]] = {s: [] for s in range(layout.num_stages)}
    for worker in layout.members:
        _, index = layout.slot_of(worker)
        indices = [index]
        successor = replica_of(index, num_physical)
        if successor is not None:
            indices.append(successor)
        for physical in dict.fromkeys(indices):
            for stage in layout.groups[physical]:
                held[stage].append(worker)
    return {s: tuple(ws) for s, ws in held.items()}


def copy_sets(layout: Layout, *, sharded: bool) -> dict[int, tuple[tuple[str, ...], ...]]:
    """Logical stage -> its copies, each as the members that must all survive for it to
    survive: every owner alone and every replica holder alone (:func:`copies`) or, with
    ``sharded`` replicas over two or more pipelines, the replica holders of all pipelines
    together (each holds one shard, ``spotline.plan.shards``: one copy between them, lost
    with any of them)."""
    if not sharded or layout.num_pipelines == 1:
        return {s: tuple((w,) for w in ws) for s, ws in copies(layout).items()}
    num_physical = layout.num_physical_stages
    held: dict[int, list[tuple[str, ...]]] = {s: [] for s in range(layout.num_stages)}
    for index, group in enumerate(layout.groups):
        owners = [(row[index],) for row in layout.slots]
        for stage in group:
            held[stage] += owners
    for index in range(num_physical):
        successor = replica_of(index, num_physical)
        if successor is None:
            continue
        shard_holders = tuple(row[index] for row in layout.slots)
        for stage in layout.groups[successor]:
            held[stage].append(shard_holders)
    return {s: tuple(cs) for s, cs in held.items()}


def exposures(
    layout: Layout, machines: Mapping[str, str | None], *, sharded: bool = False
) -> tuple[Exposure, ...]:
    """Every exposed logical stage of ``layout`` and the machine holding all its copies: the
    check of the placement rule (empty: no single machine's loss loses a stage). With
    ``sharded`` replicas (:func:`copy_sets`) a stage is exposed on the machine that holds
    every owner and one of its shard holders."""
    found = []
    if not sharded:
        for stage, holders in copies(layout).items():
            on = {machines[w] for w in holders}
            if len(on) == 1:
                found.append(Exposure(stage, next(iter(on))))
        return tuple(found)
    for stage, sets in copy_sets(layout, sharded=True).items():
        # Candidates in order of first appearance (a machine may be None: not said).
        candidates = dict.fromkeys(machines[w] for copy in sets for w in copy)
        for machine in candidates:
            if all(any(machines[w] == machine for w in copy) for copy in sets):
                found.append(Exposure(stage, machine))
                break
    return tuple(found)


def max_on_one_machine(num_physical: int, num_pipelines: int, *, sharded: bool = False) -> int:
    """The most members one machine may run for a placement without exposure to exist, with
    full replicas or ``sharded`` ones (the module docstring proves both bounds)."""
    assert num_physical >= 1 and num_pipelines >= 1
    if sharded and num_pipelines >= 2:
        return num_physical * (num_pipelines - 1)
    non_adjacent = 0 if num_physical == 1 else 1 if num_physical == 2 else num_physical // 2
    return num_physical * (num_pipelines - 1) + non_adjacent


def can_place(
    machine_counts: Mapping[str, int],
    num_physical: int,
    num_pipelines: int,
    *,
    sharded: bool = False,
) -> bool:
    """Whether members on machines with these counts can be placed with no stage exposed."""
    assert sum(machine_counts.values()) == num_physical * num_pipelines
    most = max_on_one_machine(num_physical, num_pipelines, sharded=sharded)
    return max(machine_counts.values()) <= most


def place(
    layout: Layout,
    machines: Mapping[str, str],
    usable: Mapping[int, Sequence[str]],
    previous: Mapping[str, tuple[int, int] | None],
    workers: Sequence[str],
    shards: Mapping[int, Sequence[str]] | None = None,
    *,
    sharded: bool = False,
) -> Layout:
    """``layout`` (the planner's choice by state moved) re-placed so that no stage is exposed
    (with full replicas, or ``sharded`` ones: :func:`exposures`).

    Unchanged when it exposes nothing, or when no placement can (one machine, or too few
    machines for the shape, even with standbys swapped in): the caller reports the exposure.
    Otherwise standbys from less crowded machines replace members of the most crowded one
    until the counts allow a placement (never dropping the last member source of a stage),
    the members are dealt over the columns (:func:`_deal`), and within each machine each slot
    takes the worker that lacks the fewest of its stages, then the one that ran it before,
    then worker order; of the ``n`` rotations of the columns (all as safe) the one moving
    the least state wins. ``shards``: stages held only in shards, every holder of which
    stays a member (never swapped out)."""
    if len({machines[w] for w in workers}) < 2 or not exposures(layout, machines, sharded=sharded):
        return layout
    num_physical, num_pipelines = layout.num_physical_stages, layout.num_pipelines
    order = {w: i for i, w in enumerate(workers)}
    held = {s: set(ws) for s, ws in usable.items()}
    shards = shards or {}
    # Stages held only in shards need every shard holder: those never leave; the others
    # need one member holding them whole.
    needed = {w for ws in shards.values() for w in ws}
    whole = {s: ws for s, ws in held.items() if s not in shards}
    members = list(layout.members)
    standby = list(layout.standby)
    limit = max_on_one_machine(num_physical, num_pipelines, sharded=sharded)
    while True:
        counts = Counter(machines[w] for w in members)
        crowded, most = max(counts.items(), key=lambda mc: mc[1])
        if most <= limit:
            break
        # Only machines below the limit take a standby's place, so no swap creates a new
        # crowded machine and each removes one member too many: the loop ends.
        swap = _swap(crowded, counts, limit, members, standby, machines, whole, order, needed)
        if swap is None:
            return layout
        out, incoming = swap
        members[members.index(out)] = incoming
        standby[standby.index(incoming)] = out
    pattern = _deal(members, machines, order, num_physical, num_pipelines)

    def missing(w: str, index: int) -> int:
        return sum(1 for s in layout.groups[index] if w not in held[s]) if held else 0

    best: tuple[tuple[int, int, int], tuple[tuple[str, ...], ...]] | None = None
    for rotation in range(num_physical):
        free = dict.fromkeys(sorted(members, key=order.__getitem__))
        slots = [[""] * num_physical for _ in range(num_pipelines)]
        moved = cost = 0
        for index in range(num_physical):
            for pipeline in range(num_pipelines):
                machine = pattern[pipeline][(index - rotation) % num_physical]
                chosen = min(
                    (w for w in free if machines[w] == machine),
                    key=lambda w: (
                        missing(w, index),
                        previous.get(w) != (pipeline, index),
                        order[w],
                    ),
                )
                del free[chosen]
                slots[pipeline][index] = chosen
                cost += missing(chosen, index)
                moved += previous.get(chosen) != (pipeline, index)
        key = (cost, moved, rotation)
        if best is None or key < best[0]:
            best = (key, tuple(tuple(row) for row in slots))
    assert best is not None
    placed = dataclasses.replace(
        layout, slots=best[1], standby=tuple(sorted(standby, key=order.__getitem__))
    )
    assert not exposures(placed, machines, sharded=sharded), (placed, machines)
    return placed


def _first_worker(
    members: Sequence[str], machines: Mapping[str, str], order: Mapping[str, int]
) -> dict[str, int]:
    """Machine -> its earliest member in worker order (the tie-break between machines)."""
    first: dict[str, int] = {}
    for w in members:
        first[machines[w]] = min(first.get(machines[w], order[w]), order[w])
    return first


def _swap(
    crowded: str,
    counts: Mapping[str, int],
    limit: int,
    members: Sequence[str],
    standby: Sequence[str],
    machines: Mapping[str, str],
    held: Mapping[int, set[str]],
    order: Mapping[str, int],
    needed: set[str],
) -> tuple[str, str] | None:
    """A member of the crowded machine and a standby of another to trade places: the standby
    from the machine running the fewest members, below the limit (then worker order), the member holding the
    fewest stages (then the latest), such that every stage keeps a member source."""
    incoming = sorted(
        (w for w in standby if counts.get(machines[w], 0) < limit),
        key=lambda w: (counts.get(machines[w], 0), order[w]),
    )
    outgoing = sorted(
        (w for w in members if machines[w] == crowded and w not in needed),
        key=lambda w: (sum(w in ws for ws in held.values()), -order[w]),
    )
    for new in incoming:
        for old in outgoing:
            after = {*members, new} - {old}
            if all(ws & after for ws in held.values()):
                return old, new
    return None


def _deal(
    members: Sequence[str],
    machines: Mapping[str, str],
    order: Mapping[str, int],
    num_physical: int,
    num_pipelines: int,
) -> tuple[tuple[str, ...], ...]:
    """The machine of every slot (``[pipeline][column]``): members grouped by machine, most
    crowded first (then its earliest worker), dealt round-robin over the columns in the order
    0, 2, 4, ..., 1, 3, ... (see the module docstring for why no stage is then exposed)."""
    counts = Counter(machines[w] for w in members)
    first = _first_worker(members, machines, order)
    ranked = sorted(members, key=lambda w: (-counts[machines[w]], first[machines[w]], order[w]))
    columns = [*range(0, num_physical, 2), *range(1, num_physical, 2)]
    pattern = [[""] * num_physical for _ in range(num_pipelines)]
    for position, worker in enumerate(ranked):
        pattern[position // num_physical][columns[position % num_physical]] = machines[worker]
    return tuple(tuple(row) for row in pattern)
