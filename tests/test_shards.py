"""Data-parallel-sharded replicas, the pure parts: the shard assignment, the planner's use of
shard holdings, their wire form, the exposure they leave, the config and the schedule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spotline.config import parse_config
from spotline.errors import UserError
from spotline.plan import schedule
from spotline.plan.actions import ActionKind
from spotline.plan.exposure import exposed_stages
from spotline.plan.grid import Layout
from spotline.plan.layout import (
    FatalLoss,
    GenerationPlan,
    Holding,
    ShardSource,
    WorkerReport,
    committed_state,
    initial_layout,
    member_holdings,
    plan_generation,
)
from spotline.plan.placement import Exposure, copies, copy_sets, exposures
from spotline.plan.schedule_rules import validate
from spotline.plan.shards import Piece, shard_pieces
from spotline.wire.protocol import PlanMessage, Report

# -- the shard function ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30),
    shards=st.integers(min_value=1, max_value=8),
)
def test_shards_are_disjoint_covering_exactly_balanced_and_deterministic(
    numels: list[int], shards: int
) -> None:
    named = [(f"{i:03d}.weight", k) for i, k in enumerate(numels)]
    got = [shard_pieces(named, i, shards) for i in range(shards)]
    # Every rank computes the same.
    assert got == [shard_pieces(list(named), i, shards) for i in range(shards)]
    total = sum(numels)
    for pieces in got:
        # Exactly the floor or the ceiling of T/D elements.
        assert sum(x.numel for x in pieces) in (total // shards, -(-total // shards))
        # In name order, each piece inside its tensor, each tensor at most once.
        names = [x.name for x in pieces]
        assert names == sorted(set(names))
        assert all(0 <= x.start < x.stop <= dict(named)[x.name] for x in pieces)
    # Concatenated in shard order, the pieces are every element of every tensor, once, in
    # order: disjoint and covering.
    elements = [(x.name, e) for pieces in got for x in pieces for e in range(x.start, x.stop)]
    assert elements == [(n, e) for n, k in named for e in range(k)]


def test_a_shard_is_a_contiguous_range_of_the_stage_by_name() -> None:
    named = [("a", 5), ("b", 5), ("c", 3), ("d", 0), ("e", 10)]  # T = 23
    # [0, 11) and [11, 23): b is split at its 6th element; d (empty) gives no piece.
    assert shard_pieces(named, 0, 2) == (Piece("a", 0, 5), Piece("b", 0, 5), Piece("c", 0, 1))
    assert shard_pieces(named, 1, 2) == (Piece("c", 1, 3), Piece("e", 0, 10))
    assert shard_pieces(named, 0, 1) == (
        Piece("a", 0, 5),
        Piece("b", 0, 5),
        Piece("c", 0, 3),
        Piece("e", 0, 10),
    )
    # [0, 7), [7, 15), [15, 23): a tensor may be split in several shards.
    assert [shard_pieces([("x", 23)], i, 3) for i in range(3)] == [
        (Piece("x", 0, 7),),
        (Piece("x", 7, 15),),
        (Piece("x", 15, 23),),
    ]
    # Fewer elements than shards: some shards are empty.
    assert [shard_pieces([("x", 1)], i, 3) for i in range(3)] == [(), (), (Piece("x", 0, 1),)]
    # The key names the piece and starts with the tensor's name (and so its layer index).
    assert Piece("3.attn.c_attn.weight", 384, 768).key == "3.attn.c_attn.weight@384:768"


def test_the_shard_function_refuses_what_every_rank_could_not_agree_on() -> None:
    with pytest.raises(ValueError, match="sorted"):
        shard_pieces([("b", 1), ("a", 1)], 0, 2)
    with pytest.raises(ValueError, match="sorted"):
        shard_pieces([("a", 1), ("a", 2)], 0, 2)
    with pytest.raises(ValueError, match=">= 0"):
        shard_pieces([("a", -1)], 0, 2)
    with pytest.raises(ValueError, match="at least 1"):
        shard_pieces([("a", 1)], 0, 0)
    with pytest.raises(ValueError, match="shard 2 of 2"):
        shard_pieces([("a", 1)], 2, 2)
    with pytest.raises(ValueError, match="shard -1 of 2"):
        shard_pieces([("a", 1)], -1, 2)


def test_adamw_on_a_tensor_split_anywhere_gives_the_whole_tensors_bits() -> None:
    """Why a shard may split a tensor (``spotline.plan.shards``): AdamW steps each element
    on its own, so the pieces of a split tensor step to the whole tensor's bits, whatever
    the offsets (odd ones included)."""
    import torch

    numel = 589_831
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen) for _ in range(5)]

    def stepped(bounds: list[int]) -> list[list[torch.Tensor]]:
        """Parameters, exp_avg and exp_avg_sq after 5 steps of the pieces ``bounds`` cut."""
        params = [
            torch.nn.Parameter(start[a:b].clone()) for a, b in zip(bounds, bounds[1:], strict=False)
        ]
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        for grad in grads:
            for p, a, b in zip(params, bounds, bounds[1:], strict=False):
                p.grad = grad[a:b].clone()
            optimizer.step()
        return [
            [p.detach() for p in params],
            [optimizer.state[p]["exp_avg"] for p in params],
            [optimizer.state[p]["exp_avg_sq"] for p in params],
        ]

    whole = [torch.cat(kind) for kind in stepped([0, numel])]
    for cuts in ([1], [3], [5, 13], [64], [4096], [333_333], [numel // 2], [1, 3, 5, 13, 64]):
        split = [torch.cat(kind) for kind in stepped([0, *cuts, numel])]
        assert all(torch.equal(a, b) for a, b in zip(whole, split, strict=True)), cuts


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
    sharded = PlanMessage(
        "train",
        layout,
        {"p0000": (0, 1)},
        resume_step=7,
        holders={0: ("w0",), 1: ()},
        sources=((0, "w0"),),
        shard_sources=(ShardSource(1, "w0", 0, 2), ShardSource(1, "w2", 1, 2)),
    )
    assert PlanMessage.decode(sharded.encode()) == sharded
    assert sharded.to_json()["shard_sources"] == [[1, "w0", 0, 2], [1, "w2", 1, 2]]
    whole = PlanMessage("train", layout, {"p0000": (0, 1)}, sources=((0, "w0"), (1, "w2")))
    assert "shard_sources" not in whole.to_json()  # the old form, as before
    assert PlanMessage.decode(whole.encode()) == whole
    with pytest.raises(AssertionError):
        PlanMessage(
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
    base = schedule.train_schedule(3, 4)
    lazy = schedule.add_redundancy(base, "lazy")
    sharded = schedule.add_redundancy(base, "lazy", replay=False)
    validate(sharded)
    kinds = {a.kind for row in sharded.steps for step in row for a in step}
    assert not kinds & {
        ActionKind.STASH_OUTPUT,
        ActionKind.STASH_INPUT_GRAD,
        ActionKind.REPLICA_LOAD,
    }
    # The same replica exchange and step as a full replica's.
    tail = {ActionKind.REPLICA_GRAD_SEND, ActionKind.REPLICA_GRAD_RECV}
    tail.add(ActionKind.REPLICA_STEP)
    assert [[a for a in row[-1] if a.kind in tail] for row in sharded.steps] == [
        [a for a in row[-1] if a.kind in tail] for row in lazy.steps
    ]
    with pytest.raises(ValueError, match="eager"):
        schedule.add_redundancy(base, "eager", replay=False)


# -- the simulator --------------------------------------------------------------------------


def test_the_simulator_plans_with_shard_holdings() -> None:
    """Both owners of stage 1 lost: the shards survive with the stage-0 members; one of
    those lost too: a full replica still lives, a sharded one does not."""
    from spotline.plan.capacity import Capacity
    from spotline.sim.canonical_plans import CanonicalPlan, CanonicalPlanner

    results = {}
    for sharded in (False, True):
        planner = CanonicalPlanner(
            2, 2, elastic=True, capacity=Capacity(2, replicas=True), sharded=sharded
        )
        first = planner.initial(4)
        assert first is not None
        owners = frozenset({(0, 1), (1, 1)})
        both = planner.replan(first.shape, owners, 2)
        assert isinstance(both, CanonicalPlan) and both.moves_state, sharded
        results[sharded] = planner.replan(first.shape, owners | {(1, 0)}, 2)
    assert isinstance(results[False], CanonicalPlan)
    assert isinstance(results[True], FatalLoss) and results[True].lost_stages == (1,)
