"""How the runtime lays the logical topology onto live workers, generation after generation.

The logical topology (``num_stages`` logical stages x ``num_logical_workers`` pipelines) never
changes. A *generation* is one process group over the live members; its :class:`Layout`
says which contiguous logical stages each physical stage runs (``groups``; merged after a
loss, Bamboo's "predecessor takes over") and which worker runs each (pipeline, physical
stage). DeepSpeed's engine needs the same physical stages in every pipeline, so a merge
applies to all pipelines, and workers left over wait as standby.

Rules (all deterministic; pure code, no torch):

- Committed step. Every worker reports, for each logical stage whose state it holds, the
  number of optimizer steps applied to it and whether it holds that step's reduced
  gradients ("ready"). The optimizer step is a commit: it runs only after a global barrier
  that every rank passes after the gradient exchange, so if anyone applied step k, every
  rank was ready for it. The committed step ``V`` is the highest applied count; a holding
  at ``V - 1`` that is ready rolls forward; a stage with no holding at ``V`` (or at
  ``V - 1`` and ready) is lost: a fatal loss, recovered from the last checkpoint.
- Data-parallel peers hold identical stage state, so any holder is a source for any
  pipeline's copy of that stage.
- Shape. ``S' = min(num_stages, live workers // num_logical_workers)`` physical stages; with
  fewer workers than pipelines the job waits for workers. In the elastic mode (logical
  pipelines hosted by fewer physical ones, EasyScale; what the coordinator runs, and the
  simulator's ``spotline`` policy) whole pipelines go
  first: ``P' = max(1, min(num_logical_workers, live // num_stages))`` physical pipelines of
  ``S' = min(num_stages, live // P')`` physical stages.
- Grouping and assignment. Among all contiguous groupings of the logical stages into
  ``S'`` physical stages, choose the one whose greedy assignment moves the least state
  (counted in logical stages a worker must receive); ties: fewer logical stages in the
  largest group, then the lexicographically first grouping. A worker that ran the same
  slot before and holds all of its stages keeps it; the other slots are filled in
  (physical stage, pipeline) order, each with the unassigned worker that lacks the fewest
  of the slot's stages, preferring the worker that ran the same slot before, then worker
  order.
- Every logical stage's state must be held by some member (standbys are not in the
  process group); a member is swapped for a holder if needed, never the only member holding
  a stage already checked. Members too few to hold every stage (rigid pipelines, holdings
  spread thin): a fatal loss naming the stage left without a source.
- Capacity. Given a :class:`~spotline.plan.capacity.Capacity` (the runtime and the simulator
  always give one: ``spotline.redundancy.stages_per_worker``, default 2: a stage and its
  successor's replica, or two stages after a takeover), only groupings in which no worker
  runs more logical stages than that are considered. Too few workers for any such grouping
  of the shape: a :class:`WaitForCapacity` when every stage's state survives (nothing
  trains until workers arrive), a fatal loss when not. Where the planner without a
  capacity would run at most that many stages on a worker, the plan is the same.
- Machines. Where the reports say their machines (``WorkerReport.machine``) and there are
  two or more, the chosen layout is re-placed so that no machine holds every copy of a
  stage, whenever the shape allows it (``spotline.plan.placement``); the plan lists the
  stages still exposed (``GenerationPlan.exposed``). All workers on one machine: the
  layout above, unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

from spotline.plan.capacity import Capacity
from spotline.plan.grid import Layout
from spotline.plan.placement import Exposure, exposures, place, replica_of


@dataclass(frozen=True)
class Holding:
    """One logical stage's state on one worker: ``version`` steps applied; ``ready``: it also
    holds the reduced gradients of step ``version`` (so it can apply that step).

    ``shard`` of ``shards``: the part of the stage it holds (a data-parallel-sharded
    replica, ``spotline.plan.shards``: the pieces of shard ``shard``); 0 of 1: the whole
    stage. A shard is never a source of the whole stage on its own: only every shard of one
    count, together."""

    stage: int
    version: int
    ready: bool
    shard: int = 0
    shards: int = 1

    def __post_init__(self) -> None:
        assert 0 <= self.shard < self.shards, f"shard {self.shard} of {self.shards}"

    @property
    def whole(self) -> bool:
        return self.shards == 1


@dataclass(frozen=True)
class ShardSource:
    """A plan's source of shard ``shard`` of ``shards`` of logical stage ``stage``: a stage
    no member holds whole is assembled from every shard of one count, each from its own
    member (``GenerationPlan.shard_sources``)."""

    stage: int
    worker: str
    shard: int
    shards: int

    def __post_init__(self) -> None:
        assert 0 <= self.shard < self.shards, f"shard {self.shard} of {self.shards}"


@dataclass(frozen=True)
class WorkerReport:
    """What a live worker says at a generation boundary (or on joining: no holdings).

    ``machine``: the host it runs on (a preemption takes a whole machine; see
    ``spotline.plan.placement``). None: not said; the planner then assumes nothing about
    where copies live and places as if on one machine, every stage exposed. Either every
    report of a call says its machine or none does."""

    worker: str
    holdings: tuple[Holding, ...] = ()
    previous_slot: tuple[int, int] | None = None  # (pipeline, physical stage) last generation
    machine: str | None = None


@dataclass(frozen=True)
class GenerationPlan:
    """The coordinator's decision for one generation. ``layout`` None: waiting for workers.

    ``exposed``: the logical stages whose every copy is on one machine (losing it loses the
    stage), in stage order; with machines not said, every stage (on one unnamed machine)."""

    generation: int
    layout: Layout | None
    resume_step: int
    sources: tuple[tuple[int, str], ...]  # (logical stage, member that provides its state)
    reason: str
    exposed: tuple[Exposure, ...] = ()
    # The stages no member holds whole, each from every shard of one count (a stage is in
    # ``sources`` or here, never both): shard order within a stage.
    shard_sources: tuple[ShardSource, ...] = ()


@dataclass(frozen=True)
class FatalLoss:
    """Some logical stage's state survives nowhere: fall back to the last checkpoint."""

    lost_stages: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class WaitForCapacity:
    """Every logical stage's state survives (at ``resume_step``), but ``live`` workers cannot
    hold the model within ``capacity``: train nothing until ``needed`` workers are live. No
    fallback: the survivors keep the state meanwhile."""

    generation: int
    resume_step: int
    live: int
    needed: int
    capacity: Capacity
    reason: str


@dataclass(frozen=True)
class _Short:
    """What :func:`_choose_layout` says when no grouping of its shape fits the capacity."""

    needed: int


def contiguous_groupings(num_stages: int, num_groups: int) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Every way to cut stages 0..S-1 into ``num_groups`` contiguous non-empty groups."""
    assert 1 <= num_groups <= num_stages
    for cuts in itertools.combinations(range(1, num_stages), num_groups - 1):
        bounds = (0, *cuts, num_stages)
        yield tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(num_groups))


def initial_layout(
    num_stages: int,
    num_logical_workers: int,
    workers: Sequence[str],
    *,
    elastic: bool = False,
    machines: Mapping[str, str] | None = None,
    capacity: Capacity | None = None,
    sharded: bool = False,
) -> Layout | None:
    """Generation 0: pipeline p stage s on ``workers[p * S + s]``; extras stand by (placed
    by machine instead where that order would leave a stage's copies on one machine;
    ``sharded``: the replicas are sharded). None: too few workers (for the pipelines, or to
    hold the model within ``capacity``)."""
    reports = [WorkerReport(w, machine=machines[w] if machines else None) for w in workers]
    return choose_layout(
        num_stages,
        num_logical_workers,
        reports,
        usable={},
        elastic=elastic,
        capacity=capacity,
        sharded=sharded,
    )


def member_holdings(
    layout: Layout, version: int, *, replicas: bool, sharded: bool = False
) -> dict[str, tuple[Holding, ...]]:
    """What each member holds after ``version`` committed steps of ``layout``: its own
    logical stages and, with redundancy on, its successor physical stage's (the last
    physical stage holds the first, as in Bamboo). A single physical stage has no replica.
    ``sharded``: the replica of pipeline ``p`` of ``P`` is shard ``p`` of ``P`` of each of
    its stages (``spotline.redundancy.replica: "sharded"``; one pipeline: the whole)."""
    held: dict[str, tuple[Holding, ...]] = {}
    num_physical = layout.num_physical_stages
    shards = layout.num_pipelines if sharded else 1
    for pipeline, row in enumerate(layout.slots):
        for index, worker in enumerate(row):
            own = [Holding(stage, version, False) for stage in layout.groups[index]]
            successor = replica_of(index, num_physical) if replicas else None
            replica = []
            if successor is not None:
                replica = [
                    Holding(stage, version, False, pipeline % shards, shards)
                    for stage in layout.groups[successor]
                ]
            held[worker] = tuple(sorted(own + replica, key=lambda h: h.stage))
    return held


@dataclass(frozen=True)
class Committed:
    """:func:`committed_holders`' answer: the committed step, per logical stage the workers
    holding it whole at that step (``usable``; empty for a stage held only in shards) and,
    for each stage no worker holds whole, the workers holding shard 0, 1, ... of one shard
    count (``shards``: every one of them is needed)."""

    step: int
    usable: dict[int, list[str]]
    shards: dict[int, tuple[str, ...]]


def committed_holders(reports: Sequence[WorkerReport], num_stages: int) -> Committed | FatalLoss:
    """The committed step and where every logical stage's state is at that step: held whole
    by some worker, or else in every shard of one count (the fewest shards that are all
    held, each shard's first holder in report order). Neither: a fatal loss."""
    versions = [h.version for r in reports for h in r.holdings]
    if not versions:
        return FatalLoss(tuple(range(num_stages)), "no worker holds any state")
    committed = max(versions)
    # Holders in report order (a dict as an ordered set: a worker reports a stage once).
    holders: dict[int, dict[str, None]] = {s: {} for s in range(num_stages)}
    # stage -> shard count -> shard -> its first holder
    parts: dict[int, dict[int, dict[int, str]]] = {s: {} for s in range(num_stages)}
    for report in reports:
        for h in report.holdings:
            if h.version == committed or (h.version == committed - 1 and h.ready):
                if h.whole:
                    holders[h.stage][report.worker] = None
                else:
                    parts[h.stage].setdefault(h.shards, {}).setdefault(h.shard, report.worker)
    usable = {s: list(ws) for s, ws in holders.items()}
    shards: dict[int, tuple[str, ...]] = {}
    for stage, by_count in parts.items():
        if usable[stage]:
            continue  # a whole copy is preferred: one source, no assembly
        complete = [count for count, held in sorted(by_count.items()) if len(held) == count]
        if complete:
            count = complete[0]
            shards[stage] = tuple(by_count[count][i] for i in range(count))
    lost = tuple(s for s in range(num_stages) if not usable[s] and s not in shards)
    if lost:
        return FatalLoss(lost, f"no live worker holds stage(s) {list(lost)} at step {committed}")
    return Committed(committed, usable, shards)


def committed_state(
    reports: Sequence[WorkerReport], num_stages: int
) -> tuple[int, dict[int, list[str]]] | FatalLoss:
    """The committed step and, per logical stage, the workers holding it at that step (for
    a stage held only in shards, its shard holders: all of them are needed; see
    :func:`committed_holders`)."""
    state = committed_holders(reports, num_stages)
    if isinstance(state, FatalLoss):
        return state
    usable = {
        s: list(state.shards[s]) if s in state.shards else ws for s, ws in state.usable.items()
    }
    return state.step, usable


def choose_layout(
    num_stages: int,
    num_logical_workers: int,
    reports: Sequence[WorkerReport],
    usable: dict[int, list[str]],
    *,
    elastic: bool = False,
    capacity: Capacity | None = None,
    shards: Mapping[int, tuple[str, ...]] | None = None,
    sharded: bool = False,
) -> Layout | None:
    """Pick groups and an assignment that move the least state (see the module rules).

    ``usable`` must be coverable by the layout's members (every caller but
    :func:`plan_generation`, which reports the contrary as a :class:`FatalLoss`, passes
    nothing usable or every stage on every worker). ``shards``: stages held only in shards
    (:class:`Committed`), whose every shard holder must be a member. ``sharded``: the
    replicas are sharded (placed so that no machine holds a stage's owners and one of its
    shard holders, where possible). None: too few workers for the pipelines or, with a
    ``capacity``, to hold the model within it (``Capacity.fewest_workers``)."""
    layout = _choose_layout(
        num_stages,
        num_logical_workers,
        reports,
        usable,
        elastic=elastic,
        capacity=capacity,
        shards=shards,
        sharded=sharded,
    )
    assert not isinstance(layout, FatalLoss), layout.reason
    return None if isinstance(layout, _Short) else layout


def _choose_layout(
    num_stages: int,
    num_logical_workers: int,
    reports: Sequence[WorkerReport],
    usable: dict[int, list[str]],
    *,
    elastic: bool,
    capacity: Capacity | None = None,
    shards: Mapping[int, tuple[str, ...]] | None = None,
    sharded: bool = False,
) -> Layout | FatalLoss | _Short | None:
    shards = shards or {}
    workers = [r.worker for r in reports]
    previous = {r.worker: r.previous_slot for r in reports}
    # Rigid: one physical pipeline per logical worker. Elastic (EasyScale): fewer physical
    # pipelines host them all, whole pipelines dropped first.
    num_physical_pipelines = num_logical_workers
    if elastic and workers:
        num_physical_pipelines = max(1, min(num_logical_workers, len(workers) // num_stages))
    num_physical = min(num_stages, len(workers) // num_physical_pipelines)
    if num_physical == 0:
        return None
    if capacity is not None and not capacity.allows(num_stages, num_physical):
        # The shape is the most physical stages these workers allow (the elastic mode drops
        # pipelines first): no other shape fits where this one does not.
        return _Short(capacity.fewest_workers(num_stages, num_logical_workers, elastic=elastic))
    best: tuple[tuple[int, int, tuple[tuple[int, ...], ...]], Layout] | None = None
    failed: FatalLoss | None = None
    for groups in contiguous_groupings(num_stages, num_physical):
        if capacity is not None and not capacity.fits(groups):
            continue  # some worker would run more stages than its memory has room for
        assigned = _assign(
            num_stages, num_physical_pipelines, groups, workers, previous, usable, shards
        )
        if isinstance(assigned, FatalLoss):
            failed = failed or assigned
            continue
        layout, cost = assigned
        key = (cost, max(len(g) for g in groups), groups)
        if best is None or key < best[0]:
            best = (key, layout)
    if best is None:
        assert failed is not None
        return failed
    said = _machines(reports)
    if said is None:
        return best[1]
    return place(best[1], said, usable, previous, workers, shards, sharded=sharded)


def _machines(reports: Sequence[WorkerReport]) -> dict[str, str] | None:
    """Worker -> machine, or None where no report says its machine."""
    said = {r.worker: r.machine for r in reports if r.machine is not None}
    assert len(said) in (0, len(reports)), f"some reports lack their machine: {reports}"
    return said or None


def _assign(
    num_stages: int,
    num_physical_pipelines: int,
    groups: tuple[tuple[int, ...], ...],
    workers: list[str],
    previous: dict[str, tuple[int, int] | None],
    usable: dict[int, list[str]],
    shards: Mapping[int, tuple[str, ...]],
) -> tuple[Layout, int] | FatalLoss:
    # Indexed so that a plan for a thousand workers takes milliseconds (the simulator plans
    # clusters of that size); the choices are the module rules' exactly.
    order = {w: i for i, w in enumerate(workers)}
    free = dict.fromkeys(workers)  # insertion-ordered set: the standbys, in worker order
    held = {s: set(ws) for s, ws in usable.items()}

    def missing(w: str, group: tuple[int, ...]) -> int:
        # Generation 0 (nothing usable yet): every worker builds the initial weights itself.
        return sum(1 for s in group if w not in held[s]) if usable else 0

    by_previous = {slot: w for w, slot in previous.items() if slot is not None}
    slots: list[list[str]] = [[""] * len(groups) for _ in range(num_physical_pipelines)]
    cost = 0
    # A worker that can stay where it was, holding everything its slot needs, stays: a greedy
    # pass alone could hand its slot to another worker and move it, costing two transfers.
    for stage_idx, group in enumerate(groups):
        for pipeline in range(num_physical_pipelines):
            stayer = by_previous.get((pipeline, stage_idx))
            if stayer is not None and stayer in free and missing(stayer, group) == 0:
                del free[stayer]
                slots[pipeline][stage_idx] = stayer
    for stage_idx, group in enumerate(groups):
        # Every other slot takes the free worker that lacks the fewest of the group's stages,
        # preferring the one that ran this slot before, then worker order: the best of the
        # first free worker by (missing, order) and the slot's previous worker.
        costs = {w: (missing(w, group), order[w]) for w in free}
        ranked = sorted(costs, key=costs.__getitem__)
        cursor = 0
        for pipeline in range(num_physical_pipelines):
            if slots[pipeline][stage_idx]:
                continue
            while ranked[cursor] not in free:
                cursor += 1
            chosen = ranked[cursor]
            before = by_previous.get((pipeline, stage_idx))
            if (
                before is not None
                and before in free
                and missing(before, group) <= missing(chosen, group)
            ):
                chosen = before
            del free[chosen]
            slots[pipeline][stage_idx] = chosen
            cost += missing(chosen, group)
    # Every stage must have a source among the members (standbys are outside the group):
    # a member holding it whole or, for a stage held only in shards, every shard's holder.
    members = {w for row in slots for w in row}

    def covered(stage: int, out: str = "", incoming: str = "") -> bool:
        """Whether the members (``out`` swapped for ``incoming``) can provide ``stage``."""
        if stage in shards:
            return all((w in members and w != out) or w == incoming for w in shards[stage])
        return any((w in members and w != out) or w == incoming for w in usable[stage])

    for stage in range(num_stages):
        while usable and not covered(stage):
            needed = shards[stage] if stage in shards else usable[stage]
            holder = next(w for w in needed if w in free)
            # The swapped-out member must not be the only member source of a stage already
            # checked (the holder coming in may hold it too): the loop never looks back. Nor
            # one of this stage's shard holders already in: all of them are needed.
            keep = set(shards.get(stage, ()))
            safe = [
                (p, i)
                for p in range(num_physical_pipelines)
                for i in range(len(groups))
                if slots[p][i] not in keep
                and all(covered(s, slots[p][i], holder) for s in range(stage))
            ]
            if not safe:
                # Every member is some checked stage's only source: this many members cannot
                # hold every stage (rare: the holdings are spread thin over many workers).
                return FatalLoss(
                    (stage,),
                    f"no {len(members)}-member layout holds every stage: stage {stage} has no source",
                )
            worst = max(safe, key=lambda pi: missing(slots[pi[0]][pi[1]], groups[pi[1]]))
            free[slots[worst[0]][worst[1]]] = None
            del free[holder]
            slots[worst[0]][worst[1]] = holder
            members = {w for row in slots for w in row}
            cost += num_stages  # a forced swap is never preferred over a clean layout
    layout = Layout(
        num_stages=num_stages,
        num_pipelines=num_physical_pipelines,
        groups=groups,
        slots=tuple(tuple(row) for row in slots),
        standby=tuple(free),
    )
    return layout, cost


@overload
def plan_generation(
    generation: int,
    num_stages: int,
    num_logical_workers: int,
    reports: Sequence[WorkerReport],
    *,
    elastic: bool = False,
    capacity: None = None,
    sharded: bool = False,
) -> GenerationPlan | FatalLoss: ...


@overload
def plan_generation(
    generation: int,
    num_stages: int,
    num_logical_workers: int,
    reports: Sequence[WorkerReport],
    *,
    elastic: bool = False,
    capacity: Capacity,
    sharded: bool = False,
) -> GenerationPlan | WaitForCapacity | FatalLoss: ...


def plan_generation(
    generation: int,
    num_stages: int,
    num_logical_workers: int,
    reports: Sequence[WorkerReport],
    *,
    elastic: bool = False,
    capacity: Capacity | None = None,
    sharded: bool = False,
) -> GenerationPlan | WaitForCapacity | FatalLoss:
    """The next generation from the live workers' reports (failure, arrival or departure).

    With a ``capacity`` (the runtime's and the simulator's calls), no worker of the plan
    runs more logical stages than it has room for: when the live workers cannot, the answer is
    :class:`WaitForCapacity` if every stage's state survives, a :class:`FatalLoss` (fall back
    to the checkpoint) if not. Without one (None), layouts fold stages without limit.

    A stage no live worker holds whole but every shard of one count does (sharded replicas)
    is recovered from those shards: their holders are made members and are the stage's
    ``shard_sources``. ``sharded``: the plan's replicas are sharded (``exposed`` counts the
    shard holders of a stage as one copy)."""
    state = committed_holders(reports, num_stages)
    if isinstance(state, FatalLoss):
        return state
    committed, usable, shards = state.step, state.usable, state.shards
    layout = _choose_layout(
        num_stages,
        num_logical_workers,
        reports,
        usable,
        elastic=elastic,
        capacity=capacity,
        shards=shards,
        sharded=sharded,
    )
    if isinstance(layout, FatalLoss):
        return layout
    if isinstance(layout, _Short):
        assert capacity is not None
        return WaitForCapacity(
            generation,
            committed,
            len(reports),
            layout.needed,
            capacity,
            f"{len(reports)} live worker(s) cannot hold {num_stages} stages within "
            f"{capacity.describe()}: waiting for {layout.needed} (every stage's state survives)",
        )
    if layout is None:
        return GenerationPlan(
            generation,
            None,
            committed,
            (),
            f"{len(reports)} live worker(s), fewer than the {num_logical_workers} pipelines need: waiting",
        )
    members = layout.members
    held = {stage: set(ws) for stage, ws in usable.items()}
    sources = tuple(
        (stage, next(w for w in members if w in held[stage]))
        for stage in range(num_stages)
        if stage not in shards
    )
    shard_sources = tuple(
        ShardSource(stage, worker, index, len(holders))
        for stage, holders in sorted(shards.items())
        for index, worker in enumerate(holders)
    )
    assert all(source.worker in members for source in shard_sources), shard_sources
    said = _machines(reports)
    on = said if said is not None else dict.fromkeys(members)
    exposed = exposures(layout, on, sharded=sharded)
    return GenerationPlan(
        generation, layout, committed, sources, "recovered", exposed, shard_sources
    )
