"""Data-parallel-sharded replicas, the pure parts: the shard assignment, the planner's use of
shard holdings, their wire form, the exposure they leave, the config and the schedule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spotline.config import parse_config
from spotline.errors import UserError
from spotline.plan import schedule as plan
from spotline.plan.exposure import exposed_stages
from spotline.plan.layout import (
    FatalLoss,
    GenerationPlan,
    Holding,
    Layout,
    ShardSource,
    WorkerReport,
    committed_state,
    initial_layout,
    member_holdings,
    plan_generation,
)
from spotline.plan.placement import Exposure, copies, copy_sets, exposures
from spotline.plan.shards import shard_names, shard_of
from spotline.protocol import Plan, Report

# -- the shard function ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30),
    shards=st.integers(min_value=1, max_value=8),
)
def test_shards_are_disjoint_covering_balanced_and_deterministic(
    numels: list[int], shards: int
) -> None:
    named = [(f"{i:03d}.weight", k) for i, k in enumerate(numels)]
    got = shard_names(named, shards)
    assert got == shard_names(list(named), shards)  # every rank computes the same
    assert len(got) == shards
    flat = [n for names in got for n in names]
    assert sorted(flat) == [n for n, _ in named] and len(set(flat)) == len(flat)
    assert all(list(names) == sorted(names) for names in got)
    size = dict(named)
    loads = [sum(size[n] for n in names) for names in got]
    assert max(loads) - min(loads) <= max(numels, default=0)
    assert [shard_of(named, i, shards) for i in range(shards)] == list(got)


def test_shards_go_largest_first_onto_the_lightest_ties_by_name_and_index() -> None:
    named = [("a", 5), ("b", 5), ("c", 3), ("d", 2), ("e", 10)]
    # e (10) -> 0; a (5, before b) -> 1; b -> 1 (5 < 10); c -> 0 (loads 10 and 10: the
    # lower index); d -> 1 (10 < 13).
    assert shard_names(named, 2) == (("c", "e"), ("a", "b", "d"))
    assert shard_names(named, 1) == (("a", "b", "c", "d", "e"),)
    assert shard_names([("x", 1)], 3) == (("x",), (), ())


def test_the_shard_function_refuses_what_every_rank_could_not_agree_on() -> None:
    with pytest.raises(ValueError, match="sorted"):
        shard_names([("b", 1), ("a", 1)], 2)
    with pytest.raises(ValueError, match="at least 1"):
        shard_names([("a", 1)], 0)
    with pytest.raises(ValueError, match="shard 2 of 2"):
        shard_of([("a", 1)], 2, 2)


# -- holdings and the planner ---------------------------------------------------------------


def two_by_two() -> Layout:
    layout = initial_layout(2, 2, ["w0", "w1", "w2", "w3"])
    assert layout is not None
    # Pipe-major ranks: stage 0 on w0 (pipeline 0) and w1, stage 1 on w2 and w3.
    assert layout.slots == (("w0", "w2"), ("w1", "w3"))
    return layout


def reports_without(layout: Layout, lost: set[str], idle: tuple[str, ...] = ()):
    held = member_holdings(layout, 7, replicas=True, sharded=True)
    return [
        WorkerReport(w, held[w], layout.slot_of(w)) for w in layout.members if w not in lost
    ] + [WorkerReport(w) for w in idle]


def test_a_sharded_replica_is_one_shard_per_pipeline_and_one_pipeline_is_whole() -> None:
    held = member_holdings(two_by_two(), 7, replicas=True, sharded=True)
    assert held["w0"] == (Holding(0, 7, False), Holding(1, 7, False, 0, 2))
    assert held["w1"] == (Holding(0, 7, False), Holding(1, 7, False, 1, 2))
    assert held["w3"] == (Holding(0, 7, False, 1, 2), Holding(1, 7, False))
    single = initial_layout(2, 1, ["a", "b"])
    assert single is not None
    assert member_holdings(single, 3, replicas=True, sharded=True) == member_holdings(
        single, 3, replicas=True
    )
    with pytest.raises(AssertionError):
        Holding(0, 1, False, 2, 2)


@pytest.mark.parametrize("idle", [(), ("a", "b")])
def test_both_owners_lost_the_stage_comes_from_its_shard_holders(idle: tuple[str, ...]) -> None:
    layout = two_by_two()
    result = plan_generation(
        1, 2, 2, reports_without(layout, {"w2", "w3"}, idle), elastic=True, sharded=True
    )
    assert isinstance(result, GenerationPlan) and result.layout is not None
    assert result.resume_step == 7
    assert result.sources == ((0, "w0"),)
    assert result.shard_sources == (ShardSource(1, "w0", 0, 2), ShardSource(1, "w1", 1, 2))
    assert {"w0", "w1"} <= set(result.layout.members)
    if idle:  # two pipelines again: the newcomers run stage 1, assembled from the shards
        assert result.layout.slots == (("w0", "a"), ("w1", "b"))
    else:  # one pipeline: a shard holder runs stage 1 (the other shard comes to it)
        assert result.layout.slots == (("w0", "w1"),)


def test_a_lost_shard_holder_too_is_a_fatal_loss() -> None:
    layout = two_by_two()
    for idle in ((), ("a", "b", "c")):
        result = plan_generation(
            1, 2, 2, reports_without(layout, {"w2", "w3", "w1"}, idle), elastic=True
        )
        assert isinstance(result, FatalLoss) and result.lost_stages == (1,)


def test_a_whole_holder_is_preferred_over_the_shards() -> None:
    layout = two_by_two()
    result = plan_generation(1, 2, 2, reports_without(layout, {"w2"}), elastic=True)
    assert isinstance(result, GenerationPlan) and result.layout is not None
    assert dict(result.sources) == {0: "w0", 1: "w3"}
    assert result.shard_sources == ()
    state = committed_state(reports_without(layout, {"w2"}), 2)
    assert not isinstance(state, FatalLoss) and state[1][1] == ["w3"]


def test_shard_holders_left_out_are_swapped_in_and_the_sources_follow() -> None:
    """One pipeline of two slots: x and s0 hold stage 0 whole, stage 1 survives only as
    shards on s0 and s1. The greedy pass puts x and y in; both shard holders must come in,
    and stage 0 still has a member source (s0)."""
    reports = [
        WorkerReport("x", (Holding(0, 4, False),)),
        WorkerReport("y"),
        WorkerReport("s0", (Holding(0, 4, False), Holding(1, 4, False, 0, 2))),
        WorkerReport("s1", (Holding(1, 4, False, 1, 2),)),
    ]
    result = plan_generation(1, 2, 1, reports)
    assert isinstance(result, GenerationPlan) and result.layout is not None
    assert set(result.layout.members) == {"s0", "s1"}
    assert result.sources == ((0, "s0"),)
    assert result.shard_sources == (ShardSource(1, "s0", 0, 2), ShardSource(1, "s1", 1, 2))
    # A stale or incomplete shard set is no source.
    stale = [*reports[:3], WorkerReport("s1", (Holding(1, 3, False, 1, 2),))]
    assert isinstance(plan_generation(1, 2, 1, stale), FatalLoss)


def test_the_fewest_complete_shards_are_chosen() -> None:
    reports = [
        WorkerReport("a", (Holding(0, 2, False), Holding(1, 2, False, 0, 3))),
        WorkerReport("e", (Holding(1, 2, False, 1, 3),)),
        WorkerReport("b", (Holding(1, 2, True, 0, 2),)),
        WorkerReport("c", (Holding(1, 1, True, 1, 2),)),  # ready: rolls forward
        WorkerReport("d", (Holding(1, 2, False, 2, 3),)),
    ]
    # Both counts are complete: the two shards (fewer sources) win.
    result = plan_generation(1, 2, 2, reports)
    assert isinstance(result, GenerationPlan)
    assert [(s.worker, s.shard, s.shards) for s in result.shard_sources] == [
        ("b", 0, 2),
        ("c", 1, 2),
    ]


# -- the wire form --------------------------------------------------------------------------


def test_shard_holdings_and_sources_round_trip_and_the_old_forms_read_as_whole() -> None:
    holdings = (Holding(0, 3, True), Holding(1, 3, False, 1, 2))
    report = Report(worker="w0", outcome="failed", holdings=holdings)
    assert Report.decode(report.encode()) == report
    raw = report.to_json()
    assert raw["holdings"] == [[0, 3, True], [1, 3, False, 1, 2]]
    assert Report.from_json({**raw, "holdings": [[1, 3, True]]}).holdings == (
        Holding(1, 3, True, 0, 1),
    )
    layout = Layout(2, 1, ((0,), (1,)), (("w0", "w2"),))
    sharded = Plan(
        "train",
        layout,
        {"p0000": (0, 1)},
        resume_step=7,
        holders={0: ("w0",), 1: ()},
        sources=((0, "w0"),),
        shard_sources=(ShardSource(1, "w0", 0, 2), ShardSource(1, "w2", 1, 2)),
    )
    assert Plan.decode(sharded.encode()) == sharded
    assert sharded.to_json()["shard_sources"] == [[1, "w0", 0, 2], [1, "w2", 1, 2]]
    whole = Plan("train", layout, {"p0000": (0, 1)}, sources=((0, "w0"), (1, "w2")))
    assert "shard_sources" not in whole.to_json()  # the old form, as before
    assert Plan.decode(whole.encode()) == whole
    with pytest.raises(AssertionError):
        Plan(
            "train",
            layout,
            {"p0000": (0, 1)},
            sources=((1, "w2"),),
            shard_sources=(ShardSource(1, "w0", 0, 1),),
        )


# -- exposure -------------------------------------------------------------------------------


def test_the_shard_holders_of_a_stage_are_one_copy() -> None:
    layout = two_by_two()
    assert copy_sets(layout, sharded=False) == {
        s: tuple((w,) for w in ws) for s, ws in copies(layout).items()
    }
    assert copy_sets(layout, sharded=True) == {
        0: (("w0",), ("w1",), ("w2", "w3")),
        1: (("w2",), ("w3",), ("w0", "w1")),
    }
    single = initial_layout(2, 1, ["a", "b"])
    assert single is not None
    assert copy_sets(single, sharded=True) == copy_sets(single, sharded=False)


def test_a_stage_is_exposed_with_its_owners_machine_and_any_shard_holder_s() -> None:
    layout = two_by_two()
    machines = {"w0": "M1", "w2": "M1", "w3": "M1", "w1": "M2"}
    assert exposures(layout, machines) == ()  # full replicas: w1 holds all of stage 1
    assert exposures(layout, machines, sharded=True) == (Exposure(1, "M1"),)
    domains = {"w0": "a", "w1": "c", "w2": "b", "w3": "b"}
    assert exposed_stages(layout, domains.__getitem__) == ()
    # Stage 1's owners on b, and losing a or c takes a shard: two domains lose it.
    assert exposed_stages(layout, domains.__getitem__, sharded=True) == (1,)
    assert exposed_stages(layout, str, sharded=True) == ()  # four domains: three needed
    plain = exposed_stages(layout, domains.__getitem__, replicas=False)
    assert exposed_stages(layout, domains.__getitem__, replicas=False, sharded=True) == plain


# -- config and schedule --------------------------------------------------------------------


def test_the_replica_key_is_checked_and_sharded_is_lazy_only() -> None:
    assert parse_config({}).spotline.redundancy.replica == "full"
    cfg = parse_config({"spotline": {"redundancy": {"replica": "sharded"}}})
    assert cfg.spotline.redundancy.replica == "sharded"
    with pytest.raises(UserError, match=r"'spotline\.redundancy\.replica' is \"shard\"; expected"):
        parse_config({"spotline": {"redundancy": {"replica": "shard"}}})
    with pytest.raises(UserError, match="eager") as info:
        parse_config({"spotline": {"redundancy": {"replica": "sharded", "mode": "eager"}}})
    assert "\n" not in str(info.value)


def test_a_sharded_replica_s_schedule_has_no_replay_stashes() -> None:
    base = plan.train_schedule(3, 4)
    lazy = plan.add_redundancy(base, "lazy")
    sharded = plan.add_redundancy(base, "lazy", replay=False)
    plan.validate(sharded)
    kinds = {a.kind for row in sharded.steps for step in row for a in step}
    assert not kinds & {
        plan.ActionKind.STASH_OUTPUT,
        plan.ActionKind.STASH_INPUT_GRAD,
        plan.ActionKind.REPLICA_LOAD,
    }
    # The same replica exchange and step as a full replica's.
    tail = {plan.ActionKind.REPLICA_GRAD_SEND, plan.ActionKind.REPLICA_GRAD_RECV}
    tail.add(plan.ActionKind.REPLICA_STEP)
    assert [[a for a in row[-1] if a.kind in tail] for row in sharded.steps] == [
        [a for a in row[-1] if a.kind in tail] for row in lazy.steps
    ]
    with pytest.raises(ValueError, match="eager"):
        plan.add_redundancy(base, "eager", replay=False)


# -- the simulator --------------------------------------------------------------------------


def test_the_simulator_plans_with_shard_holdings() -> None:
    """Both owners of stage 1 lost: the shards survive with the stage-0 members; one of
    those lost too: a full replica still lives, a sharded one does not."""
    from spotline.plan.capacity import Capacity
    from spotline.sim.engine import _Plan, _RuntimePlanner

    results = {}
    for sharded in (False, True):
        planner = _RuntimePlanner(
            2, 2, elastic=True, capacity=Capacity(2, replicas=True), sharded=sharded
        )
        first = planner.initial(4)
        assert first is not None
        owners = frozenset({(0, 1), (1, 1)})
        both = planner.replan(first.shape, owners, 2)
        assert isinstance(both, _Plan) and both.moves_state, sharded
        results[sharded] = planner.replan(first.shape, owners | {(1, 0)}, 2)
    assert isinstance(results[False], _Plan)
    assert isinstance(results[True], FatalLoss) and results[True].lost_stages == (1,)
