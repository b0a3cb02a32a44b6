"""The runtime's planner, spotline.plan.layout: placement, takeover, fatal loss, arrivals.

The coordinator calls it at every generation and the simulator calls the same functions
(with canonical worker names, memoized), so these tests pin the decisions both make.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from spotline.plan.grid import Layout
from spotline.plan.layout import (
    FatalLoss,
    GenerationPlan,
    Holding,
    WorkerReport,
    initial_layout,
    member_holdings,
    plan_generation,
)


def workers(count: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


def survivors(
    layout: Layout, lost: set[str], idle: list[str], version: int = 7
) -> list[WorkerReport]:
    """The reports the coordinator gathers: members with what they hold, idle ones empty."""
    held = member_holdings(layout, version, replicas=True)
    return [
        WorkerReport(w, held[w], layout.slot_of(w)) for w in layout.members if w not in lost
    ] + [WorkerReport(w) for w in idle]


def plan(layout: Layout, lost: set[str], idle: list[str], *, elastic: bool = False):
    return plan_generation(
        1,
        layout.num_stages,
        len(layout.slots),
        survivors(layout, lost, idle),
        elastic=elastic,
    )


def test_initial_layout_fills_ranks_in_order_and_extras_stand_by() -> None:
    layout = initial_layout(4, 2, workers(9))
    assert layout is not None
    assert layout.groups == ((0,), (1,), (2,), (3,))
    assert layout.slots == (("w0", "w2", "w4", "w6"), ("w1", "w3", "w5", "w7"))
    assert layout.standby == ("w8",)
    # DeepSpeed's pipe-major ranks: rank = stage * P + pipeline, here the worker order.
    assert layout.members == tuple(workers(8))
    assert initial_layout(4, 2, workers(1)) is None  # fewer workers than pipelines: wait


def test_every_stage_holds_its_successor_and_the_last_holds_the_first() -> None:
    layout = initial_layout(4, 1, workers(4))
    assert layout is not None
    held = member_holdings(layout, 3, replicas=True)
    assert {w: [h.stage for h in hs] for w, hs in held.items()} == {
        "w0": [0, 1],
        "w1": [1, 2],
        "w2": [2, 3],
        "w3": [0, 3],
    }
    assert all(h.version == 3 and not h.ready for hs in held.values() for h in hs)
    plain = member_holdings(layout, 3, replicas=False)
    assert all(len(hs) == 1 for hs in plain.values())
    single = initial_layout(2, 1, ["a"])
    assert single is not None and single.groups == ((0, 1),)
    assert member_holdings(single, 0, replicas=True) == {
        "a": (Holding(0, 0, False), Holding(1, 0, False))
    }


def test_a_lost_stage_is_taken_over_by_its_predecessor() -> None:
    layout = initial_layout(4, 1, workers(4))
    assert layout is not None
    result = plan(layout, {"w2"}, [])
    assert isinstance(result, GenerationPlan) and result.layout is not None
    # Three workers for four stages: the predecessor runs stage 2 from its replica.
    assert result.layout.groups == ((0,), (1, 2), (3,))
    assert result.layout.slots == (("w0", "w1", "w3"),)
    assert dict(result.sources)[2] == "w1"
    assert result.resume_step == 7


def test_a_standby_fills_the_hole_from_the_replica_holder() -> None:
    layout = initial_layout(4, 1, workers(5))
    assert layout is not None and layout.standby == ("w4",)
    result = plan(layout, {"w2"}, ["w4"])
    assert isinstance(result, GenerationPlan) and result.layout is not None
    assert result.layout.groups == ((0,), (1,), (2,), (3,))
    assert result.layout.slots == (("w0", "w1", "w4", "w3"),)
    assert dict(result.sources)[2] == "w1"  # the new worker receives stage 2 from w1


def test_owner_and_replica_holder_lost_together_is_fatal() -> None:
    layout = initial_layout(4, 1, workers(4))
    assert layout is not None
    # w2 owns stage 2 and w1 holds its replica: nobody has stage 2 any more.
    result = plan(layout, {"w1", "w2"}, ["w9"])
    assert isinstance(result, FatalLoss)
    assert result.lost_stages == (2,)
    # Two non-adjacent losses are survivable.
    assert isinstance(plan(layout, {"w0", "w2"}, []), GenerationPlan)
    # The ring wraps: w3 holds stage 0's replica.
    assert plan(layout, {"w3", "w0"}, []).lost_stages == (0,)  # type: ignore[union-attr]


def test_a_data_parallel_peer_is_a_source_too() -> None:
    layout = initial_layout(2, 2, workers(4))
    assert layout is not None
    # Pipeline 0 loses both its workers; pipeline 1 holds both stages.
    result = plan(layout, {"w0", "w1"}, ["w8", "w9"])
    assert isinstance(result, GenerationPlan) and result.layout is not None
    assert result.layout.groups == ((0,), (1,))
    assert set(result.layout.members) == {"w2", "w3", "w8", "w9"}
    assert {w for _, w in result.sources} <= {"w2", "w3"}


def test_a_ready_holding_one_step_behind_rolls_forward() -> None:
    reports = [
        WorkerReport("a", (Holding(0, 5, False),)),
        WorkerReport("b", (Holding(1, 4, True),)),  # has step 5's gradients: can apply it
    ]
    result = plan_generation(1, 2, 1, reports)
    assert isinstance(result, GenerationPlan) and result.resume_step == 5
    stale = [WorkerReport("a", (Holding(0, 5, False),)), WorkerReport("b", (Holding(1, 4, False),))]
    assert plan_generation(1, 2, 1, stale).lost_stages == (1,)  # type: ignore[union-attr]


def test_the_elastic_mode_drops_pipelines_before_it_merges_stages() -> None:
    layout = initial_layout(2, 2, workers(4))
    assert layout is not None
    rigid = plan(layout, {"w3"}, [])
    elastic = plan(layout, {"w3"}, [], elastic=True)
    assert isinstance(rigid, GenerationPlan) and isinstance(elastic, GenerationPlan)
    assert rigid.layout is not None and elastic.layout is not None
    assert (len(rigid.layout.slots), rigid.layout.groups) == (2, ((0, 1),))  # both pipelines fold
    assert (len(elastic.layout.slots), elastic.layout.groups) == (1, ((0,), (1,)))  # one unfolded
    assert len(elastic.layout.standby) == 1
    # Below one pipeline's worth even the elastic mode folds stages.
    folded = initial_layout(4, 2, workers(2), elastic=True)
    assert folded is not None and len(folded.slots) == 1 and len(folded.groups) == 2


@settings(max_examples=200, deadline=None)
@given(
    num_stages=st.integers(1, 5),
    num_pipelines=st.integers(1, 3),
    extra=st.integers(0, 3),
    elastic=st.booleans(),
    picks=st.lists(st.integers(0, 30), max_size=5),
    arrivals=st.integers(0, 3),
)
def test_plans_cover_every_stage_and_do_not_depend_on_worker_names(
    num_stages: int,
    num_pipelines: int,
    extra: int,
    elastic: bool,
    picks: list[int],
    arrivals: int,
) -> None:
    """The simulator plans with canonical names and renames the result; that is sound only
    because a plan depends on the workers' order, never on their names."""
    real = initial_layout(num_stages, num_pipelines, workers(num_stages * num_pipelines + extra))
    assert real is not None
    members = list(real.members)
    lost = {members[i % len(members)] for i in picks}
    idle = list(real.standby) + workers(arrivals, "new")
    result = plan(real, lost, idle, elastic=elastic)
    renamed = {w: f"x{len(w)}{w[::-1]}" for w in [*real.members, *idle]}
    other = Layout(
        real.num_stages,
        real.num_pipelines,
        real.groups,
        tuple(tuple(renamed[w] for w in row) for row in real.slots),
        tuple(renamed[w] for w in real.standby),
    )
    twin = plan(other, {renamed[w] for w in lost}, [renamed[w] for w in idle], elastic=elastic)
    if isinstance(result, FatalLoss):
        assert isinstance(twin, FatalLoss) and twin.lost_stages == result.lost_stages
        held = member_holdings(real, 7, replicas=True)
        for stage in result.lost_stages:
            # Fatal only when every worker that held the stage is gone.
            assert all(w in lost for w in real.members if any(h.stage == stage for h in held[w]))
        return
    assert isinstance(twin, GenerationPlan)
    if result.layout is None:
        assert twin.layout is None
        return
    assert twin.layout is not None
    back = {v: k for k, v in renamed.items()}
    assert tuple(tuple(back[w] for w in row) for row in twin.layout.slots) == result.layout.slots
    assert result.layout.groups == twin.layout.groups
    # Every live worker is either placed once or stands by; nobody lost is placed.
    placed = list(result.layout.members) + list(result.layout.standby)
    alive = [w for w in real.members if w not in lost] + idle
    assert sorted(placed) == sorted(alive)
    # Every logical stage's state comes from a member that holds it.
    sources = dict(result.sources)
    assert sorted(sources) == list(range(num_stages))
    assert all(w in result.layout.members for w in sources.values())


def _valid_plan(result: GenerationPlan, num_stages: int, reports: list[WorkerReport]) -> None:
    """A plan places every live worker once (member or standby) and sources every logical
    stage from a member that holds it at the committed step (or one behind, ready)."""
    assert result.layout is not None
    placed = [*result.layout.members, *result.layout.standby]
    assert sorted(placed) == sorted(r.worker for r in reports)
    sources = dict(result.sources)
    assert sorted(sources) == list(range(num_stages))
    by_worker = {r.worker: r for r in reports}
    for stage, worker in sources.items():
        assert worker in result.layout.members
        assert any(
            h.stage == stage
            and (
                h.version == result.resume_step or (h.version == result.resume_step - 1 and h.ready)
            )
            for h in by_worker[worker].holdings
        )


def _valid_fatal(result: FatalLoss, num_stages: int, reports: list[WorkerReport]) -> None:
    """A fatal loss names stages that nobody holds at the committed step, or the one stage
    that a layout of this many members cannot hold (rigid pipelines, holdings spread thin)."""
    assert result.lost_stages and all(0 <= s < num_stages for s in result.lost_stages)
    if "has no source" in result.reason:
        assert len(result.lost_stages) == 1 and f"stage {result.lost_stages[0]} " in result.reason
        return
    versions = [h.version for r in reports for h in r.holdings]
    top = max(versions, default=0)
    held = {
        h.stage
        for r in reports
        for h in r.holdings
        if h.version == top or (h.version == top - 1 and h.ready)
    }
    assert not held & set(result.lost_stages), result


@st.composite
def random_reports(draw: st.DrawFn, num_stages: int, num_pipelines: int) -> list[WorkerReport]:
    """Live workers with arbitrary holdings (not only what a layout leaves): any stages, at
    the committed step or one behind, ready or not, any previous slot. Mostly fewer than
    three per pipeline: rigid layouts then have few members for many holdings."""
    count = draw(st.integers(1, 3 * num_pipelines - 1) | st.integers(1, 10))
    reports = []
    for index in range(count):
        # Thin holdings (a stage or two each) make the repair loop swap the most.
        stages = draw(st.sets(st.integers(0, num_stages - 1), min_size=1, max_size=2))
        holdings = tuple(
            Holding(s, draw(st.sampled_from([6, 7])), draw(st.booleans())) for s in sorted(stages)
        )
        slot = draw(st.none() | st.tuples(st.integers(0, 2), st.integers(0, num_stages - 1)))
        reports.append(WorkerReport(f"w{index}", holdings, slot))
    # Two live workers never ran the same slot: the first claim keeps it.
    seen: set[tuple[int, int]] = set()
    unique = []
    for r in reports:
        if r.previous_slot in seen:
            r = WorkerReport(r.worker, r.holdings, None)
        elif r.previous_slot is not None:
            seen.add(r.previous_slot)
        unique.append(r)
    return unique


@settings(max_examples=300, deadline=None)
@given(data=st.data(), num_stages=st.integers(1, 5), num_pipelines=st.integers(1, 3))
def test_any_holdings_give_a_valid_plan_or_a_fatal_loss_naming_the_stage(
    data: st.DataObject, num_stages: int, num_pipelines: int
) -> None:
    """Issue 14: the repair loop swapped out the only member holding a stage it had already
    checked ("generator raised StopIteration" in about 1 in 900 rigid calls)."""
    reports = data.draw(random_reports(num_stages, num_pipelines))
    for elastic in (False, True):
        result = plan_generation(1, num_stages, num_pipelines, reports, elastic=elastic)
        if isinstance(result, FatalLoss):
            _valid_fatal(result, num_stages, reports)
            continue
        if result.layout is not None:
            _valid_plan(result, num_stages, reports)


def test_rigid_layout_too_small_to_hold_every_stage_is_a_fatal_loss() -> None:
    """Five workers each holding one stage of five, two rigid pipelines: four members can
    never hold all five stages (the call used to crash with StopIteration)."""
    reports = [WorkerReport(f"w{s}", (Holding(s, 7, False),), (s % 2, s % 5)) for s in range(5)]
    result = plan_generation(1, 5, 2, reports)
    assert isinstance(result, FatalLoss) and result.lost_stages == (4,)
    assert isinstance(plan_generation(1, 5, 2, reports, elastic=True), GenerationPlan)


@settings(max_examples=300, deadline=None)
@given(
    num_stages=st.integers(3, 5),
    num_pipelines=st.integers(2, 3),
    data=st.data(),
)
def test_the_rigid_repair_never_drops_a_stage_it_already_placed(
    num_stages: int, num_pipelines: int, data: st.DataObject
) -> None:
    """Where issue 14's crash lives: rigid pipelines with fewer than three workers each, every
    worker holding one or two stages, so that most members are some stage's only source."""
    count = data.draw(st.integers(num_pipelines, 3 * num_pipelines - 1))
    reports = [
        WorkerReport(
            f"w{index}",
            tuple(
                Holding(s, 7, False)
                for s in sorted(
                    data.draw(st.sets(st.integers(0, num_stages - 1), min_size=1, max_size=2))
                )
            ),
        )
        for index in range(count)
    ]
    result = plan_generation(1, num_stages, num_pipelines, reports)
    if isinstance(result, FatalLoss):
        _valid_fatal(result, num_stages, reports)
    else:
        _valid_plan(result, num_stages, reports)
