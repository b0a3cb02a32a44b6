"""Machine-aware placement (spotline.plan.placement): a preemption takes a whole machine, so
the planner keeps every logical stage's copies (owners and Bamboo replica holders) on two
machines or more whenever the layout's shape allows it, and names the exposed stages where not.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Iterator

from hypothesis import event, given, settings
from hypothesis import strategies as st

from spotline.plan.grid import Layout
from spotline.plan.layout import (
    Committed,
    FatalLoss,
    GenerationPlan,
    WorkerReport,
    committed_holders,
    initial_layout,
    member_holdings,
    plan_generation,
)
from spotline.plan.placement import Exposure, can_place, exposures

HOST = "host"


def cluster(*slots: int) -> dict[str, str]:
    """Worker -> machine: machine ``m<i>`` runs ``slots[i]`` workers ``m<i>s<k>``, listed
    machine by machine (the order a naive launcher would number ranks in)."""
    return {f"m{i}s{k}": f"m{i}" for i, count in enumerate(slots) for k in range(count)}


def holder_machines(layout: Layout, machines: dict[str, str]) -> dict[int, set[str]]:
    """Logical stage -> the machines holding a copy, from what the members really hold."""
    held = member_holdings(layout, 1, replicas=True)
    return {
        s: {machines[w] for w, hs in held.items() if any(h.stage == s for h in hs)}
        for s in range(layout.num_stages)
    }


def lost_with_one_machine(layout: Layout, machines: dict[str, str], *, sharded: bool) -> set[int]:
    """The logical stages some one machine's loss would lose, from what the members really
    hold (``member_holdings``): a stage survives in a member holding it whole, or in every
    shard of one count, each in a member that survives. Independent of ``exposures``."""
    held = member_holdings(layout, 1, replicas=True, sharded=sharded)
    lost = set()
    for machine in set(machines.values()):
        alive = [hs for w, hs in held.items() if machines[w] != machine]
        for s in range(layout.num_stages):
            parts = [h for hs in alive for h in hs if h.stage == s]
            if any(h.whole for h in parts):
                continue
            counts = {h.shards for h in parts}
            if not any({h.shard for h in parts if h.shards == n} == set(range(n)) for n in counts):
                lost.add(s)
    return lost


def reports_after(
    layout: Layout,
    machines: dict[str, str],
    lost_machines: set[str],
    arrivals: dict[str, str],
    *,
    sharded: bool = False,
) -> list[WorkerReport]:
    """What the coordinator gathers after whole machines are preempted: the surviving members
    with what they hold, the standbys and the arrivals empty, every one with its machine."""
    held = member_holdings(layout, 7, replicas=True, sharded=sharded)
    alive = [w for w in layout.members if machines[w] not in lost_machines]
    return (
        [WorkerReport(w, held[w], layout.slot_of(w), machines[w]) for w in alive]
        + [
            WorkerReport(w, machine=machines[w])
            for w in layout.standby
            if machines[w] not in lost_machines
        ]
        + [WorkerReport(w, machine=m) for w, m in arrivals.items()]
    )


def test_two_machines_of_two_slots_alternate_along_the_pipeline() -> None:
    machines = cluster(2, 2)
    naive = initial_layout(4, 1, list(machines))
    assert naive is not None and naive.slots == (("m0s0", "m0s1", "m1s0", "m1s1"),)
    # Rank order would put stage 1 and its replica holder (stage 0's worker) on m0.
    assert exposures(naive, machines) == (
        Exposure(1, "m0"),
        Exposure(3, "m1"),
    )
    layout = initial_layout(4, 1, list(machines), machines=machines)
    assert layout is not None
    assert layout.slots == (("m0s0", "m1s0", "m0s1", "m1s1"),)
    assert exposures(layout, machines) == ()
    assert all(len(on) == 2 for on in holder_machines(layout, machines).values())
    # Losing either machine whole is survivable: the other holds a copy of every stage.
    for lost in ("m0", "m1"):
        result = plan_generation(1, 4, 1, reports_after(layout, machines, {lost}, {}))
        assert isinstance(result, GenerationPlan) and result.layout is not None
        assert result.layout.num_physical_stages == 2 and result.resume_step == 7
        # Both survivors on one machine now: the plan forms and says so.
        assert [e.stage for e in result.exposed] == [0, 1, 2, 3]
    # With the naive order the same loss is fatal.
    assert isinstance(
        plan_generation(1, 4, 1, reports_after(naive, machines, {"m1"}, {})), FatalLoss
    )


def test_a_replanned_generation_keeps_the_rule_and_says_nothing_is_exposed() -> None:
    machines = cluster(2, 2, 1)
    layout = initial_layout(4, 1, list(machines), machines=machines)
    assert layout is not None and exposures(layout, machines) == ()
    assert layout.standby == ("m2s0",)
    # m1 is preempted; the standby and an arrival on a new machine join.
    result = plan_generation(1, 4, 1, reports_after(layout, machines, {"m1"}, {"m3s0": "m3"}))
    assert isinstance(result, GenerationPlan) and result.layout is not None
    everyone = {**machines, "m3s0": "m3"}
    assert result.exposed == () == exposures(result.layout, everyone)
    assert result.layout.num_physical_stages == 4
    assert all(len(on) >= 2 for on in holder_machines(result.layout, everyone).values())


def test_four_single_slot_machines_two_by_two_need_no_change() -> None:
    machines = cluster(1, 1, 1, 1)
    layout = initial_layout(2, 2, list(machines), machines=machines)
    assert layout == initial_layout(2, 2, list(machines))
    assert layout is not None and exposures(layout, machines) == ()
    held = reports_after(layout, machines, {"m0"}, {})
    result = plan_generation(1, 2, 2, held)
    assert isinstance(result, GenerationPlan) and result.exposed == ()


def test_one_machine_forms_the_same_plan_and_reports_every_stage_exposed() -> None:
    names = [f"w{i}" for i in range(5)]
    machines = dict.fromkeys(names, HOST)
    layout = initial_layout(4, 1, names, machines=machines)
    assert layout == initial_layout(4, 1, names)
    assert layout is not None
    assert exposures(layout, machines) == tuple(Exposure(s, HOST) for s in range(4))
    held = member_holdings(layout, 7, replicas=True)
    said = [WorkerReport(w, held[w], layout.slot_of(w), HOST) for w in layout.members[1:]]
    unsaid = [WorkerReport(w, held[w], layout.slot_of(w)) for w in layout.members[1:]]
    with_host = plan_generation(1, 4, 1, said)
    without = plan_generation(1, 4, 1, unsaid)
    assert isinstance(with_host, GenerationPlan) and isinstance(without, GenerationPlan)
    assert (with_host.layout, with_host.sources) == (without.layout, without.sources)
    assert [str(e) for e in with_host.exposed] == [
        f"stage {s}: every copy on host" for s in range(4)
    ]
    # Machines not said: the planner assumes nothing, every stage counts as exposed.
    assert [(e.stage, e.machine) for e in without.exposed] == [(s, None) for s in range(4)]


def test_uneven_machines_three_and_one() -> None:
    machines = cluster(3, 1)
    # Four stages in one pipeline: m0's three workers cannot avoid two adjacent stages.
    assert not can_place(Counter(machines.values()), 4, 1)
    layout = initial_layout(4, 1, list(machines), machines=machines)
    assert layout == initial_layout(4, 1, list(machines))
    assert layout is not None
    exposed = exposures(layout, machines)
    assert exposed and all(e.machine == "m0" for e in exposed)
    # Two pipelines of two stages: one worker on m1 is enough (every member holds every stage).
    two_by_two = initial_layout(2, 2, list(machines), machines=machines)
    assert two_by_two is not None and exposures(two_by_two, machines) == ()
    # Two stages, one pipeline: rank order takes two m0 workers; m1's standby swaps in.
    pair = initial_layout(2, 1, list(machines), machines=machines)
    assert pair is not None and exposures(pair, machines) == ()
    assert pair.slots == (("m0s0", "m1s0"),) and pair.standby == ("m0s1", "m0s2")


def test_a_single_worker_and_a_single_physical_stage_are_exposed() -> None:
    machines = cluster(1, 1)
    one = initial_layout(2, 1, ["m0s0"], machines=machines)
    assert one is not None and [e.stage for e in exposures(one, machines)] == [0, 1]
    # Two pipelines of one physical stage: the data-parallel peer on another machine is a copy.
    folded = initial_layout(2, 2, list(machines), machines=machines)
    assert folded is not None and folded.groups == ((0, 1),)
    assert exposures(folded, machines) == ()


# -- the property: the planner finds a safe placement whenever one exists ------------------


def _multiset_permutations(counts: dict[str, int]) -> Iterator[tuple[str, ...]]:
    if not any(counts.values()):
        yield ()
        return
    for machine in sorted(counts):
        if counts[machine]:
            counts[machine] -= 1
            for rest in _multiset_permutations(counts):
                yield (machine, *rest)
            counts[machine] += 1


@functools.cache
def _safe_exists(
    counts: tuple[tuple[str, int], ...], num_physical: int, pipelines: int, sharded: bool = False
) -> bool:
    """Brute force, independent of the planner's reasoning: some arrangement of machines over
    the slots leaves no stage's copies (from ``member_holdings``) on one machine (``sharded``:
    no stage lost with one machine, :func:`lost_with_one_machine`)."""
    groups = tuple((s,) for s in range(num_physical))
    for labels in _multiset_permutations(dict(counts)):
        names = [f"{m}#{i}" for i, m in enumerate(labels)]
        slots = tuple(
            tuple(names[p * num_physical + s] for s in range(num_physical))
            for p in range(pipelines)
        )
        layout = Layout(num_physical, pipelines, groups, slots)
        machines = {n: n.split("#")[0] for n in names}
        if sharded:
            if not lost_with_one_machine(layout, machines, sharded=True):
                return True
        elif all(len(on) >= 2 for on in holder_machines(layout, machines).values()):
            return True
    return False


@settings(max_examples=300, deadline=None)
@given(
    num_stages=st.integers(1, 4),
    num_pipelines=st.integers(1, 2),
    slots=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    lost=st.sets(st.integers(0, 3)),
    arrivals=st.lists(st.integers(0, 4), max_size=2),
    elastic=st.booleans(),
    sharded=st.booleans(),
)
def test_the_planner_places_safely_whenever_it_can_and_reports_exposure_otherwise(
    num_stages: int,
    num_pipelines: int,
    slots: list[int],
    lost: set[int],
    arrivals: list[int],
    elastic: bool,
    sharded: bool,
) -> None:
    machines = cluster(*slots)
    first = initial_layout(
        num_stages, num_pipelines, list(machines), machines=machines, sharded=sharded
    )
    if first is None:
        return
    event(
        f"the planner re-placed rank order: {first != initial_layout(num_stages, num_pipelines, list(machines))}"
    )
    members = first.members + first.standby
    reports = [WorkerReport(w, machine=machines[w]) for w in members]
    _check(first, machines, reports, None, sharded=sharded)
    # Whole machines preempted, arrivals (on old or new machines) join.
    new = {f"a{i}": f"m{m}" for i, m in enumerate(arrivals)}
    everyone = {**machines, **new}
    reports = reports_after(first, machines, {f"m{i}" for i in lost}, new, sharded=sharded)
    result = plan_generation(
        1, num_stages, num_pipelines, reports, elastic=elastic, sharded=sharded
    )
    if isinstance(result, FatalLoss) or result.layout is None:
        return
    assert result.exposed == exposures(result.layout, everyone, sharded=sharded)
    state = committed_holders(reports, num_stages)
    assert not isinstance(state, FatalLoss)
    _check(result.layout, everyone, reports, state, sharded=sharded)


def _check(
    layout: Layout,
    machines: dict[str, str],
    reports: list[WorkerReport],
    state: Committed | None,
    *,
    sharded: bool,
) -> None:
    """The layout is exposed only where no choice of members (each stage keeping a member
    source: one holding it whole, or every holder of its shards) and no arrangement of them
    over the layout's shape avoids it."""
    exposed = exposures(layout, machines, sharded=sharded)
    alive = [r.worker for r in reports]
    assert sorted([*layout.members, *layout.standby]) == sorted(alive)
    size = len(layout.members)
    possible = False
    for chosen in itertools.combinations(alive, size):
        if state is not None and not all(
            set(state.shards[s]) <= set(chosen) if s in state.shards else set(ws) & set(chosen)
            for s, ws in state.usable.items()
        ):
            continue
        counts = tuple(sorted(Counter(machines[w] for w in chosen).items()))
        if _safe_exists(counts, layout.num_physical_stages, layout.num_pipelines, sharded):
            possible = True
            break
    event(f"a safe placement exists: {possible}")
    assert possible == (not exposed), (layout, exposed)


def _partitions(total: int, largest: int) -> Iterator[tuple[int, ...]]:
    if total == 0:
        yield ()
        return
    for part in range(min(total, largest), 0, -1):
        for rest in _partitions(total - part, part):
            yield (part, *rest)


def test_the_bound_on_the_most_crowded_machine_is_exact() -> None:
    """``can_place`` (the module's proof) agrees with brute force for every way to spread up
    to ten members over machines, shapes up to seven physical stages; and the planner, from
    any worker order, then places with no stage exposed."""
    for num_physical in range(1, 8):
        for pipelines in range(1, 4):
            size = num_physical * pipelines
            if size > 10:
                continue
            for part, sharded in itertools.product(_partitions(size, size), (False, True)):
                machines = cluster(*part)
                counts = Counter(machines.values())
                shape = (num_physical, pipelines, sharded)
                brute = _safe_exists(tuple(sorted(counts.items())), *shape)
                assert can_place(counts, num_physical, pipelines, sharded=sharded) == brute, (
                    shape,
                    part,
                )
                names = list(machines)
                for order in (names, names[::-1], sorted(names, key=lambda w: w[::-1])):
                    layout = initial_layout(
                        num_physical, pipelines, order, machines=machines, sharded=sharded
                    )
                    assert layout is not None
                    exposed = exposures(layout, machines, sharded=sharded)
                    assert (exposed == ()) == brute, (layout, part, sharded)
                    # The check agrees with what one machine's loss really loses.
                    lost = lost_with_one_machine(layout, machines, sharded=sharded)
                    assert {e.stage for e in exposed} == lost, (layout, part, sharded)
