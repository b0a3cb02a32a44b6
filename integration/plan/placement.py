"""The logical topology and its placement on live workers; how it changes on failure and arrival.

The logical topology (``num_pipelines`` data-parallel pipelines of ``num_stages`` stages)
never changes during a run; preemptions and arrivals only change the :class:`Placement`:
which worker (a string id, e.g. a node name) owns each (pipeline, stage), which worker holds
each stage's replica, which pipelines are dissolved and which workers wait as standby.

The runtime uses these functions for real failovers and the simulator (``spotline.sim``)
uses the very same ones, so there is one model of the decisions. Every rule is here:

Ownership
    Every stage of an *active* pipeline has exactly one owner. A worker owns stages of one
    pipeline only, at most two, and two only when they are neighbours on the ring
    (s, s+1 mod S): that is a worker that took over its successor ("doubled up").
    A *dissolved* pipeline has no owners at all; its logical data-parallel workers are run
    by the active pipelines (EasyScale-style), so training continues on fewer pipelines.
    At least one pipeline is always active.
Replicas (Bamboo's ring, one level of redundancy)
    The owner of stage s-1 mod S of the same pipeline holds the replica of stage s, if it
    owns that one stage only. A doubled-up worker holds no replica (its memory holds two
    live stages), so after a takeover of stage s by the owner of s-1, stages s and s+1 are
    unprotected until a rebalance. With one stage a pipeline has no replicas.
Failure (:func:`on_failure`)
    A stage whose owner is lost moves to its replica holder, unless the holder is lost too
    or there is no replica (owner doubled up, or the holder doubled up): then it is
    unrecoverable. Without ``elastic``, any unrecoverable stage makes the whole loss a
    :class:`FatalLoss` (fall back to the last checkpoint). With ``elastic``, a pipeline
    with an unrecoverable stage is dissolved instead (its surviving workers become standby)
    and only the loss of every active pipeline is fatal. Holes are filled from standby
    workers first (the standby receives the stage's state from the replica holder), in
    (pipeline, stage) order, taking standbys in queue order; the replica holder takes the
    stage over itself only when no standby is left.
Arrival (:func:`on_arrival`)
    New workers join the end of the standby queue. Then, in this order, while standbys
    remain: (1) every doubled-up worker, in (pipeline, stage) order, hands its later stage
    on the ring to the first standby (state by transfer from the doubled-up worker, which
    keeps its copy as the replica); (2) dissolved pipelines, lowest index first, are rebuilt
    from S standbys at a time (stage s goes to the s-th standby, its state from the owner of
    stage s in the lowest-numbered active pipeline, a data-parallel peer with identical
    state). Standbys left over stay standby.
Replica rebuilds
    After any change, a worker that is now the replica holder of a stage and neither held
    that replica nor owned that stage before must receive it from the stage's owner.

All functions are pure and deterministic: the same inputs give the same plan.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

Coordinate = tuple[int, int]
"""A logical position: (pipeline, stage)."""

MAX_STAGES_PER_WORKER = 2


@dataclass(frozen=True)
class LogicalTopology:
    """The fixed shape of the job: ``num_pipelines`` data-parallel pipelines of ``num_stages``
    pipeline stages. Pairs with :class:`Placement`, which maps it onto live workers."""

    num_stages: int
    num_pipelines: int

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_pipelines"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def num_slots(self) -> int:
        """Workers needed to run every pipeline with one stage per worker."""
        return self.num_stages * self.num_pipelines


def _index_row(
    index: dict[str, tuple[Coordinate, ...]],
    pipeline: int,
    owners: tuple[str, ...],
    num_stages: int,
    doubled: list[str],
) -> None:
    """Add one active pipeline's owners to ``index`` (worker -> stages), checking the
    ownership rules; workers found owning two stages are appended to ``doubled``."""
    if len(owners) != num_stages:
        raise ValueError(f"pipeline {pipeline} lists {len(owners)} owners for {num_stages} stages")
    for stage, worker in enumerate(owners):
        held = index.get(worker)
        if held is None:
            index[worker] = ((pipeline, stage),)
            continue
        first_pipeline, first_stage = held[0]
        if len(held) >= MAX_STAGES_PER_WORKER or first_pipeline != pipeline:
            raise ValueError(
                f"worker {worker!r} owns too many stages: {held + ((pipeline, stage),)}"
            )
        # Stages are visited in increasing order, so the only ring neighbours are
        # (s, s+1) or, across the wrap, (0, S-1).
        if stage != first_stage + 1 and not (first_stage == 0 and stage == num_stages - 1):
            raise ValueError(
                f"worker {worker!r} owns stages {first_stage} and {stage} of pipeline "
                f"{pipeline}, which are not neighbours on the ring"
            )
        index[worker] = held + ((pipeline, stage),)
        doubled.append(worker)


@dataclass(frozen=True)
class Placement:
    """Which worker owns each (pipeline, stage), which pipelines are dissolved, who waits.

    ``stage_owners[p]`` is the tuple of owners of pipeline p's stages, or ``None`` when
    pipeline p is dissolved; ``standby`` is the queue of workers that own nothing, in the
    order they will be used. Replica holders follow from the owners (module docstring).
    Construction validates every ownership rule and raises ValueError when one is broken.
    """

    topology: LogicalTopology
    stage_owners: tuple[tuple[str, ...] | None, ...]
    standby: tuple[str, ...] = ()
    # Caches of pure functions of the fields, written once at construction.
    _stages_by_worker: dict[str, tuple[Coordinate, ...]] = field(
        init=False, repr=False, compare=False, hash=False
    )
    _doubled: tuple[str, ...] = field(init=False, repr=False, compare=False, hash=False)
    _num_active: int = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if len(self.stage_owners) != self.topology.num_pipelines:
            raise ValueError(
                f"placement lists {len(self.stage_owners)} pipelines, "
                f"the topology has {self.topology.num_pipelines}"
            )
        index: dict[str, tuple[Coordinate, ...]] = {}
        doubled: list[str] = []
        for pipeline, owners in enumerate(self.stage_owners):
            if owners is not None:
                _index_row(index, pipeline, owners, self.topology.num_stages, doubled)
        self._finish(index, doubled)

    def _finish(self, index: dict[str, tuple[Coordinate, ...]], doubled: list[str]) -> None:
        num_active = sum(1 for owners in self.stage_owners if owners is not None)
        if num_active == 0:
            raise ValueError("a placement needs at least one active pipeline")
        seen_standby: set[str] = set()
        for worker in self.standby:
            if worker in index or worker in seen_standby:
                raise ValueError(f"standby worker {worker!r} also owns a stage or is listed twice")
            seen_standby.add(worker)
        doubled.sort(key=lambda worker: index[worker][0])
        object.__setattr__(self, "_stages_by_worker", index)
        object.__setattr__(self, "_doubled", tuple(doubled))
        object.__setattr__(self, "_num_active", num_active)

    def _derive(
        self, stage_owners: tuple[tuple[str, ...] | None, ...], standby: tuple[str, ...]
    ) -> Placement:
        """A placement of the same topology, validated only where its rows differ from this
        one's (the result is the same as constructing it; faster for large placements)."""
        derived = object.__new__(Placement)
        object.__setattr__(derived, "topology", self.topology)
        object.__setattr__(derived, "stage_owners", stage_owners)
        object.__setattr__(derived, "standby", standby)
        if len(stage_owners) != self.topology.num_pipelines:
            raise ValueError("a derived placement must keep the number of pipelines")
        changed = [
            pipeline
            for pipeline, owners in enumerate(stage_owners)
            if owners != self.stage_owners[pipeline]
        ]
        index = dict(self._stages_by_worker)
        for pipeline in changed:
            old = self.stage_owners[pipeline]
            if old is not None:
                for worker in old:
                    index.pop(worker, None)
        doubled = [worker for worker in self._doubled if worker in index]
        for pipeline in changed:
            owners = stage_owners[pipeline]
            if owners is not None:
                _index_row(index, pipeline, owners, self.topology.num_stages, doubled)
        derived._finish(index, doubled)
        return derived

    @cached_property
    def workers(self) -> frozenset[str]:
        """Every worker of the placement: owners and standbys."""
        return frozenset(self._stages_by_worker).union(self.standby)

    def has_worker(self, worker: str) -> bool:
        """True when ``worker`` owns a stage or waits as standby."""
        return worker in self._stages_by_worker or worker in self.standby

    @property
    def active_pipelines(self) -> tuple[int, ...]:
        """Indices of the pipelines that run, in order."""
        return tuple(p for p, owners in enumerate(self.stage_owners) if owners is not None)

    @property
    def dissolved_pipelines(self) -> tuple[int, ...]:
        """Indices of the pipelines that have no owners, in order."""
        return tuple(p for p, owners in enumerate(self.stage_owners) if owners is None)

    @property
    def num_active_pipelines(self) -> int:
        """How many pipelines run (their step time decides the job's)."""
        return self._num_active

    @property
    def num_owners(self) -> int:
        """How many workers own at least one stage."""
        return len(self._stages_by_worker)

    def owner(self, pipeline: int, stage: int) -> str:
        """The worker that owns (pipeline, stage); ValueError for a dissolved pipeline."""
        owners = self.stage_owners[pipeline]
        if owners is None:
            raise ValueError(f"pipeline {pipeline} is dissolved: its stages have no owner")
        return owners[stage]

    def stages_of(self, worker: str) -> tuple[Coordinate, ...]:
        """The (pipeline, stage)s a worker owns; empty for a standby or unknown worker."""
        return self._stages_by_worker.get(worker, ())

    def replica_holder(self, pipeline: int, stage: int) -> str | None:
        """Who holds the replica of (pipeline, stage), or None when the stage is unprotected.

        The owner of stage - 1 (mod S) holds it if that worker owns one stage only.
        """
        owners = self.stage_owners[pipeline]
        if owners is None:
            raise ValueError(f"pipeline {pipeline} is dissolved: its stages have no replica")
        predecessor = owners[(stage - 1) % self.topology.num_stages]
        if predecessor == owners[stage] or len(self._stages_by_worker[predecessor]) != 1:
            return None
        return predecessor

    def doubled_workers(self) -> tuple[str, ...]:
        """Workers that own two stages, in (pipeline, stage) order of their first stage."""
        return self._doubled

    def unprotected(self) -> tuple[Coordinate, ...]:
        """The (pipeline, stage)s of active pipelines without a replica, in order."""
        return tuple(
            (pipeline, stage)
            for pipeline in self.active_pipelines
            for stage in range(self.topology.num_stages)
            if self.replica_holder(pipeline, stage) is None
        )


@dataclass(frozen=True)
class Takeover:
    """Stage ``stage`` of ``pipeline`` moves from the lost ``from_worker`` to ``to_worker``,
    whose state comes from ``state_source`` (the replica holder). ``to_worker`` equals
    ``state_source`` when the replica holder takes the stage over itself (it then runs the
    lost backward pass from its replica); otherwise a standby receives the state."""

    pipeline: int
    stage: int
    from_worker: str
    to_worker: str
    state_source: str

    @property
    def from_standby(self) -> bool:
        """True when a standby worker fills the hole instead of the replica holder."""
        return self.to_worker != self.state_source


@dataclass(frozen=True)
class StateTransfer:
    """Copy the state of (``pipeline``, ``stage``) from ``source`` to ``destination``:
    as its new owner (``what == "stage"``) or as its replica holder (``"replica"``)."""

    pipeline: int
    stage: int
    source: str
    destination: str
    what: Literal["stage", "replica"]


@dataclass(frozen=True)
class FailoverPlan:
    """What to do after losing ``lost``: the takeovers, the pipelines dissolved (elastic
    mode only), the replicas to rebuild and the resulting placement. Produced by
    :func:`on_failure`; the runtime executes it, the simulator charges for it."""

    lost: tuple[str, ...]
    takeovers: tuple[Takeover, ...]
    dissolved_pipelines: tuple[int, ...]
    replica_builds: tuple[StateTransfer, ...]
    placement: Placement

    @property
    def owners_lost(self) -> bool:
        """True when a stage owner was lost (a standby-only loss changes nothing running)."""
        return bool(self.takeovers or self.dissolved_pipelines)


@dataclass(frozen=True)
class FatalLoss:
    """The loss of ``lost`` cannot be survived in memory: ``unrecoverable`` lists the
    (pipeline, stage)s whose owner and replica holder are both gone (or that had no
    replica). The job falls back to its last checkpoint."""

    lost: tuple[str, ...]
    unrecoverable: tuple[Coordinate, ...]


@dataclass(frozen=True)
class ArrivalPlan:
    """The placement after new workers arrive (or after a rebalance with the standbys
    already waiting), and the state transfers it needs. Produced by :func:`on_arrival`."""

    placement: Placement
    transfers: tuple[StateTransfer, ...]

    @property
    def changed(self) -> bool:
        """True when some running stage moved (a pipeline must re-form)."""
        return bool(self.transfers)


def initial_placement(topology: LogicalTopology, workers: Sequence[str]) -> Placement:
    """Place a job on ``workers``: pipelines are filled in order (worker p*S + s owns stage s
    of pipeline p), as many whole pipelines as the workers allow; pipelines that do not fit
    are dissolved and the remaining workers wait as standby in the given order.

    Fewer workers than stages is a ValueError ("waiting for workers": not even one pipeline
    can run); duplicate worker ids are a ValueError.
    """
    if len(set(workers)) != len(workers):
        raise ValueError("worker ids must be unique")
    num_stages = topology.num_stages
    if len(workers) < num_stages:
        raise ValueError(
            f"waiting for workers: one pipeline needs {num_stages} workers, "
            f"{len(workers)} available"
        )
    num_active = min(topology.num_pipelines, len(workers) // num_stages)
    stage_owners: list[tuple[str, ...] | None] = [
        tuple(workers[p * num_stages : (p + 1) * num_stages]) for p in range(num_active)
    ]
    stage_owners.extend(None for _ in range(topology.num_pipelines - num_active))
    # Valid by construction (unique workers, one stage each), so the index is built
    # directly instead of re-checking every rule; _finish still checks the standbys.
    placement = object.__new__(Placement)
    object.__setattr__(placement, "topology", topology)
    object.__setattr__(placement, "stage_owners", tuple(stage_owners))
    object.__setattr__(placement, "standby", tuple(workers[num_active * num_stages :]))
    index: dict[str, tuple[Coordinate, ...]] = {
        worker: ((index // num_stages, index % num_stages),)
        for index, worker in enumerate(workers[: num_active * num_stages])
    }
    placement._finish(index, [])
    return placement


def _replica_builds(before: Placement, after: Placement) -> tuple[StateTransfer, ...]:
    """Replicas ``after`` needs that no worker already has (module docstring rule).

    Replica holders depend only on their own pipeline's owners, so pipelines whose owners
    did not change need nothing.
    """
    builds: list[StateTransfer] = []
    for pipeline, owners in enumerate(after.stage_owners):
        previous = before.stage_owners[pipeline]
        if owners is None or owners == previous:
            continue
        # replica_holder() inlined (a hot path of the simulator): owners[stage - 1] is the
        # ring predecessor, index -1 wrapping to the last stage.
        after_stages = after._stages_by_worker
        before_stages = before._stages_by_worker
        for stage, owner in enumerate(owners):
            holder = owners[stage - 1]
            if holder == owner or len(after_stages[holder]) != 1:
                continue  # unprotected
            if previous is not None:
                if previous[stage] == holder:
                    continue  # it owned the stage, so it has the state
                before_holder = previous[stage - 1]
                if (
                    before_holder == holder
                    and before_holder != previous[stage]
                    and len(before_stages[before_holder]) == 1
                ):
                    continue  # it already held this replica
            builds.append(StateTransfer(pipeline, stage, owner, holder, "replica"))
    return tuple(builds)


def on_failure(
    placement: Placement, lost: Collection[str], *, elastic: bool = False
) -> FailoverPlan | FatalLoss:
    """Plan the recovery from losing the workers ``lost`` at once (rules in the module
    docstring). Workers in ``lost`` that the placement does not know are ignored, so a
    caller may pass every preempted node. ``elastic`` allows dissolving a pipeline whose
    stage is unrecoverable while other pipelines keep training.
    """
    lost_set = frozenset(worker for worker in lost if placement.has_worker(worker))
    lost_sorted = tuple(sorted(lost_set))
    lost_coordinates = sorted(
        coordinate for worker in lost_set for coordinate in placement.stages_of(worker)
    )
    holes: list[tuple[int, int, str, str]] = []
    unrecoverable: list[Coordinate] = []
    for pipeline, stage in lost_coordinates:
        holder = placement.replica_holder(pipeline, stage)
        if holder is None or holder in lost_set:
            unrecoverable.append((pipeline, stage))
        else:
            holes.append((pipeline, stage, placement.owner(pipeline, stage), holder))
    broken = sorted({pipeline for pipeline, _ in unrecoverable})
    if unrecoverable and (not elastic or len(broken) == placement.num_active_pipelines):
        return FatalLoss(lost_sorted, tuple(unrecoverable))

    new_owners: list[tuple[str, ...] | None] = list(placement.stage_owners)
    standby = [worker for worker in placement.standby if worker not in lost_set]
    for pipeline in broken:
        owners = placement.stage_owners[pipeline]
        assert owners is not None
        # The survivors of a dissolved pipeline join the standby queue, in stage order.
        for worker in dict.fromkeys(owners):
            if worker not in lost_set:
                standby.append(worker)
        new_owners[pipeline] = None
    takeovers: list[Takeover] = []
    for pipeline, stage, worker, holder in holes:
        row = new_owners[pipeline]
        if row is None:
            continue  # dissolved above
        new_owner = standby.pop(0) if standby else holder
        new_owners[pipeline] = row[:stage] + (new_owner,) + row[stage + 1 :]
        takeovers.append(Takeover(pipeline, stage, worker, new_owner, holder))
    after = placement._derive(tuple(new_owners), tuple(standby))
    assert not any(after.has_worker(worker) for worker in lost_set), "a lost worker is placed"
    return FailoverPlan(
        lost_sorted, tuple(takeovers), tuple(broken), _replica_builds(placement, after), after
    )


def _later_stage(placement: Placement, worker: str) -> Coordinate:
    """The ring-later of a doubled-up worker's two stages: the one whose predecessor it also
    owns (with two stages per pipeline both qualify; the higher stage is taken)."""
    (pipeline, first), (_, second) = placement.stages_of(worker)
    num_stages = placement.topology.num_stages
    if (first + 1) % num_stages == second and (second + 1) % num_stages != first:
        return (pipeline, second)
    if (second + 1) % num_stages == first and (first + 1) % num_stages != second:
        return (pipeline, first)
    return (pipeline, max(first, second))


def on_arrival(placement: Placement, new_workers: Sequence[str]) -> ArrivalPlan:
    """Add ``new_workers`` and rebalance (rules in the module docstring): standbys first
    relieve doubled-up workers, then rebuild dissolved pipelines S at a time; the rest wait.
    ``on_arrival(placement, ())`` rebalances with the standbys already waiting. A new worker
    that the placement already has, or listed twice, is a ValueError.
    """
    if len(set(new_workers)) != len(new_workers) or any(
        placement.has_worker(worker) for worker in new_workers
    ):
        raise ValueError("arriving workers must be new and unique")
    standby = list(placement.standby) + list(new_workers)
    num_stages = placement.topology.num_stages
    if not standby or (
        not placement.doubled_workers()
        and (
            len(standby) < num_stages
            or placement.num_active_pipelines == len(placement.stage_owners)
        )
    ):
        # Nothing to relieve or rebuild: the newcomers only join the standby queue.
        if not new_workers:
            return ArrivalPlan(placement, ())
        return ArrivalPlan(placement._derive(placement.stage_owners, tuple(standby)), ())
    new_owners: list[tuple[str, ...] | None] = list(placement.stage_owners)
    transfers: list[StateTransfer] = []
    for worker in placement.doubled_workers():
        if not standby:
            break
        pipeline, stage = _later_stage(placement, worker)
        newcomer = standby.pop(0)
        row = new_owners[pipeline]
        assert row is not None
        new_owners[pipeline] = row[:stage] + (newcomer,) + row[stage + 1 :]
        transfers.append(StateTransfer(pipeline, stage, worker, newcomer, "stage"))
    active = placement.active_pipelines
    for pipeline in placement.dissolved_pipelines:
        if len(standby) < num_stages:
            break
        peer = active[0]  # a data-parallel peer holds identical stage state
        rebuilt = tuple(standby[:num_stages])
        del standby[:num_stages]
        new_owners[pipeline] = rebuilt
        transfers.extend(
            StateTransfer(pipeline, stage, placement.owner(peer, stage), worker, "stage")
            for stage, worker in enumerate(rebuilt)
        )
    after = placement._derive(tuple(new_owners), tuple(standby))
    if transfers:
        transfers.extend(_replica_builds(placement, after))
    return ArrivalPlan(after, tuple(transfers))


def rebalance(placement: Placement) -> ArrivalPlan:
    """Use the standbys already waiting as :func:`on_arrival` would use newcomers."""
    return on_arrival(placement, ())


def is_degraded(placement: Placement) -> bool:
    """True when some worker runs two stages (its pipeline, and so the synchronous step, is
    slower). Dissolved pipelines do not count: they reduce the number of pipelines instead."""
    return bool(placement._doubled)
