"""The elastic worker's parts without processes: a takeover and a transfer planned by the real
planner and carried out between in-process ranks, a roll-forward, the rebalance decision, the
pack/assemble forms (sharded pieces included) and a checkpoint file's round trip. Every
comparison is bitwise (``torch.equal``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import pytest
import torch

from spotline.pipeline.lr_schedule import StepSchedule
from spotline.plan.grid import Layout, pipeline_name
from spotline.plan.layout import (
    GenerationPlan,
    ShardSource,
    WorkerReport,
    initial_layout,
    member_holdings,
    plan_generation,
)
from spotline.plan.logical import rebalanced
from spotline.plan.loss_scale import NO_SCALING, LossScaleState, LossScaling
from spotline.plan.shards import Piece, shard_pieces
from spotline.worker.holdings import (
    Holdings,
    Names,
    OptimizerRecipe,
    StageState,
    assemble,
    pack,
    packed_numel,
    piece_names,
    piece_state,
    roll_forward_holdings,
    unpack,
)
from spotline.worker.state_transfer import (
    PeerOp,
    StageExchange,
    StageTransfer,
    pack_stages,
    prepare_exchange,
    replica_payload,
    stage_transfers,
    stage_views,
)
from spotline.worker.worker_checkpoints import stage_of_payload, stage_payload

# A model of two logical stages: layers 0-1 and 2-3 (names start with the global layer index,
# as ``stage_of_name`` reads them). "3.scale" has one element: some shards of it are empty.
LOGICAL = [0, 2, 4]
SHAPES: dict[str, tuple[int, ...]] = {
    "0.wte.weight": (6, 4),
    "1.h.weight": (4, 4),
    "1.h.bias": (4,),
    "2.h.weight": (4, 4),
    "2.h.bias": (4,),
    "3.head.weight": (5, 4),
    "3.scale": (1,),
}
VERSION = 7


def stage_names(stage: int) -> Names:
    lo, hi = LOGICAL[stage], LOGICAL[stage + 1]
    return sorted((n, torch.Size(s)) for n, s in SHAPES.items() if lo <= int(n.split(".")[0]) < hi)


def numels(stage: int) -> list[tuple[str, int]]:
    return [(n, int(shape.numel())) for n, shape in stage_names(stage)]


# A loss scaler's state with no field at its default: a round trip that drops one shows.
SCALER = LossScaleState(2.0**13, iteration=VERSION, last_overflow=4, hysteresis=3, skipped=2)


def make_stage(stage: int, version: int = VERSION, seed: int = 0) -> StageState:
    """A stage's state as an engine would have it after ``version`` steps (random bits)."""
    g = torch.Generator().manual_seed(1000 * seed + stage)
    st = StageState(version, {}, {}, loss_scale=SCALER)
    for name, shape in stage_names(stage):
        st.params[name] = torch.randn(shape, generator=g)
        st.opt[name] = {
            "step": torch.tensor(float(version)),
            "exp_avg": torch.randn(shape, generator=g),
            "exp_avg_sq": torch.rand(shape, generator=g),
        }
    return st


def copy_of(st: StageState) -> StageState:
    return StageState(
        st.version,
        {n: t.clone() for n, t in st.params.items()},
        {n: {k: v.clone() for k, v in o.items()} for n, o in st.opt.items()},
        shard=st.shard,
        shards=st.shards,
        loss_scale=st.loss_scale,
    )


def assert_same(got: StageState, want: StageState) -> None:
    assert got.version == want.version
    assert got.loss_scale == want.loss_scale
    assert sorted(got.params) == sorted(want.params)
    for name in want.params:
        assert torch.equal(got.params[name], want.params[name]), name
        assert sorted(got.opt[name]) == sorted(want.opt[name]), name
        for key in want.opt[name]:
            assert torch.equal(got.opt[name][key], want.opt[name][key]), (name, key)


# -- in-process ranks -------------------------------------------------------------------------


def deliver(exchanges: Mapping[int, Sequence[PeerOp]]) -> None:
    """What gloo does between ranks: rank a's sends to b fill b's receives from a, in order."""
    for src, ops in exchanges.items():
        for dst in {op.peer for op in ops if op.send}:
            sends = [op.tensor for op in ops if op.send and op.peer == dst]
            recvs = [op.tensor for op in exchanges[dst] if not op.send and op.peer == src]
            assert len(sends) == len(recvs), (src, dst)
            for sent, buf in zip(sends, recvs, strict=True):
                assert sent.shape == buf.shape, (src, dst)
                buf.copy_(sent)
    for dst, ops in exchanges.items():
        for op in ops:
            if not op.send:  # every receive has its send
                assert any(o.send and o.peer == dst for o in exchanges[op.peer]), (dst, op.peer)


def held_state(truth: Mapping[int, StageState], stage: int, shard: int, shards: int) -> StageState:
    """What a worker holds of ``stage``: the whole state, or a sharded replica's pieces."""
    if shards == 1:
        return copy_of(truth[stage])
    part = copy_of(piece_state(truth[stage], shard_pieces(numels(stage), shard, shards)))
    part.shard, part.shards = shard, shards
    return part


# -- a takeover -------------------------------------------------------------------------------


def two_by_two() -> Layout:
    layout = initial_layout(2, 2, ["w0", "w1", "w2", "w3"])
    assert layout is not None
    # Pipe-major ranks: stage 0 on w0 (pipeline 0) and w1, stage 1 on w2 and w3.
    assert layout.slots == (("w0", "w2"), ("w1", "w3"))
    return layout


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("idle", [(), ("a", "b")])
def test_a_lost_stage_is_taken_over_from_the_replicas_held_bit_for_bit(
    sharded: bool, idle: tuple[str, ...]
) -> None:
    """Both owners of stage 1 (w2, w3) are lost; its copies are the replicas its predecessors
    w0 and w1 hold (whole, or one shard each). The planner's next generation, carried out
    by every member's part of the transfers between in-process ranks, gives every member of
    it each of its stages with the owners' bits: a replica holder takes over from what it
    holds, a newcomer receives the stage (or every shard of it, assembled)."""
    old = two_by_two()
    truth = {s: make_stage(s) for s in (0, 1)}
    held = member_holdings(old, VERSION, replicas=True, sharded=sharded)
    lost = {"w2", "w3"}
    holdings: dict[str, Holdings] = {w: Holdings() for w in [*old.members, *idle]}
    for w in old.members:
        for h in held[w]:
            holdings[w].stages[h.stage] = held_state(truth, h.stage, h.shard, h.shards)
    reports = [WorkerReport(w, held[w], old.slot_of(w)) for w in old.members if w not in lost]
    reports += [WorkerReport(w) for w in idle]
    plan = plan_generation(1, 2, 2, reports, elastic=True, sharded=sharded)
    assert isinstance(plan, GenerationPlan) and plan.layout is not None
    layout = plan.layout
    assert plan.resume_step == VERSION
    # The plan's holders as the coordinator writes them: the whole holdings of the step.
    holders = {
        s: tuple(r.worker for r in reports for h in r.holdings if h.stage == s and h.whole)
        for s in (0, 1)
    }

    transfers = stage_transfers(layout, holders, plan.sources, plan.shard_sources)
    # Only stage 1's owners were lost: only stage 1 moves, to members that do not hold it
    # whole, from the members that held a copy.
    assert {t.stage for t in transfers} <= {1}
    for t in transfers:
        assert t.source in ("w0", "w1") and t.target not in holders[1]
    if idle:  # the newcomers run stage 1 and receive it
        assert {t.target for t in transfers} == {"a", "b"}
    if sharded:  # no member holds stage 1 whole: every shard of it comes from its holder
        assert {t.shard for t in transfers} == {(0, 2), (1, 2)}

    def own_names(w: str) -> dict[int, Names]:
        return {s: stage_names(s) for s in layout.stages_of(w)}

    exchanges = {
        w: prepare_exchange(w, transfers, holdings[w], own_names(w), layout.rank_of)
        for w in layout.members
    }
    for w, ex in exchanges.items():
        # A holding sent to several members is packed once: one buffer a stage sent.
        sent = {id(op.tensor) for op in ex.ops if op.send}
        assert len(sent) == len({t.stage for t in transfers if t.source == w != t.target}), w
    if idle and not sharded:  # one holder of stage 1 sends it to both newcomers
        assert Counter(t.source for t in transfers) == {"w0": 2} or Counter(
            t.source for t in transfers
        ) == {"w1": 2}, transfers
    deliver({layout.rank_of(w): ex.ops for w, ex in exchanges.items()})
    for w, ex in exchanges.items():
        holdings[w].stages.update(ex.received(own_names(w), plan.resume_step))
        for stage in layout.stages_of(w):
            assert_same(holdings[w].stages[stage], truth[stage])


def test_the_transfer_list_is_the_same_on_every_member_and_names_each_source() -> None:
    """The decision alone, on a plan written by hand: members in rank order, stages in order;
    a holder is sent nothing; a stage held only in shards comes shard by shard."""
    layout = Layout(2, 1, ((0,), (1,)), (("x", "y"),))
    # Every member holds its own stages: nothing moves.
    assert stage_transfers(layout, {0: ("x",), 1: ("y", "x")}, [(0, "x"), (1, "y")], []) == ()
    got = stage_transfers(layout, {0: ("z",), 1: ("x",)}, [(0, "z"), (1, "x")], [])
    assert got == (StageTransfer(0, "z", "x"), StageTransfer(1, "x", "y"))
    shards = [ShardSource(1, "y", 0, 2), ShardSource(1, "z", 1, 2)]
    got = stage_transfers(layout, {0: ("x",), 1: ()}, [(0, "x")], shards)
    assert got == (StageTransfer(1, "y", "y", (0, 2)), StageTransfer(1, "z", "y", (1, 2)))
    # A fresh start (no holders): nothing moves.
    assert stage_transfers(layout, {}, [], []) == ()


# -- a roll-forward ---------------------------------------------------------------------------


def schedule() -> StepSchedule:
    # A warm-up: each step's rate differs, so applying step k with step k+-1's rate shows.
    return StepSchedule(
        torch.optim.AdamW,
        {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
        "WarmupLR",
        {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10},
    )


def test_a_replica_a_step_behind_is_rolled_forward_to_the_resume_step() -> None:
    """A holding at step v with the final gradients of step v (and their clip coefficient)
    is, after the roll-forward to v + 1, what an optimizer that ran every step has; a holding
    too old to roll forward is dropped, one at the resume step kept."""
    sched = schedule()
    recipe = OptimizerRecipe(torch.optim.AdamW, dict(sched.defaults), sched, NO_SCALING)
    g = torch.Generator().manual_seed(5)
    names = [n for n, _ in stage_names(1)]
    params = [torch.nn.Parameter(torch.randn(SHAPES[n], generator=g)) for n in names]
    reference = torch.optim.AdamW(params, **recipe.hyper)
    grads = [[torch.randn(SHAPES[n], generator=g) for n in names] for _ in range(4)]
    clip = 0.37
    snapshot: StageState | None = None
    for step in range(4):
        if step == 3:  # the replica's holding: 3 steps applied, step 3's final gradients
            snapshot = StageState(
                3,
                {n: p.detach().clone() for n, p in zip(names, params, strict=True)},
                {
                    n: {k: v.clone() for k, v in reference.state[p].items()}
                    for n, p in zip(names, params, strict=True)
                },
                {n: grad.clone() for n, grad in zip(names, grads[step], strict=True)},
                clip,
                loss_scale=NO_SCALING.initial(),
            )
        sched.apply(reference.param_groups, step)
        for p, grad in zip(params, grads[step], strict=True):
            p.grad = grad.clone()
            if step == 3:
                p.grad.mul_(clip)
        reference.step()
    assert snapshot is not None
    holdings = Holdings({1: snapshot, 0: make_stage(0, version=2), 2: make_stage(0, version=4)})
    holdings.stages[2].grads = {}  # at the resume step with gradients: kept, gradients dropped

    roll_forward_holdings(holdings, 4, recipe)

    assert sorted(holdings.stages) == [1, 2]  # stage 0, two steps behind, is stale
    rolled = holdings.stages[1]
    assert rolled.version == 4 and rolled.grads is None and holdings.stages[2].grads is None
    for n, p in zip(names, params, strict=True):
        assert torch.equal(rolled.params[n], p.detach()), n
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(rolled.opt[n][key], reference.state[p][key]), (n, key)


# -- the rebalance decision -------------------------------------------------------------------

EIGHT = {pipeline_name(0): (0, 1, 2, 3), pipeline_name(1): (4, 5, 6, 7)}


def test_a_slow_rank_moves_logical_workers_off_its_pipeline() -> None:
    # Two stages, two pipelines: ranks are pipe-major (rank = stage * 2 + pipeline). Rank 1
    # (stage 0 of pipeline 1) takes three times as long: pipeline 1 is a third as fast.
    moved = rebalanced(EIGHT, [1.0, 3.0, 1.0, 1.0], 2)
    # 6 and 2 logical workers; pipeline 1 keeps its lowest two and frees the rest.
    assert moved == {pipeline_name(0): (0, 1, 2, 3, 6, 7), pipeline_name(1): (4, 5)}
    # Rank 2 is pipeline 0's (stage 1): now pipeline 0 is the slow one.
    assert rebalanced(EIGHT, [1.0, 1.0, 3.0, 1.0], 2) == {
        pipeline_name(0): (0, 1),
        pipeline_name(1): (2, 3, 4, 5, 6, 7),
    }


def test_nothing_moves_without_a_gain_worth_it_or_a_measurement() -> None:
    assert rebalanced(EIGHT, [1.0, 1.0, 1.0, 1.0], 2) is None  # equal speeds
    assert rebalanced(EIGHT, [1.0, 1.05, 1.0, 1.0], 2) is None  # the same counts
    # 5 and 3 logical workers would predict a step 4% shorter: within the noise margin.
    assert rebalanced(EIGHT, [1.0, 1.3, 1.0, 1.0], 2) is None
    assert rebalanced(EIGHT, [1.0, 1.3, 1.0, 1.0], 2, min_gain=0.0) is not None
    # A pipeline is as fast as its slowest rank: rank 3 measured, rank 1's 0 changes nothing.
    assert rebalanced(EIGHT, [1.0, 0.0, 1.0, 1.0], 2) is None
    assert rebalanced(EIGHT, [0.0, 1.0, 0.0, 3.0], 2) is None  # pipeline 0 not measured
    one = {pipeline_name(0): tuple(range(8))}
    assert rebalanced(one, [1.0, 5.0], 1) is None  # one pipeline: nowhere to move to


# -- the forms a stage travels in -------------------------------------------------------------


def test_pack_and_unpack_give_back_every_bit_in_tensors_of_its_own() -> None:
    st = make_stage(0)
    flat = pack(stage_names(0), st)
    assert flat.numel() == packed_numel(stage_names(0))
    got = unpack(stage_names(0), flat, VERSION)
    assert_same(got, st)
    flat.zero_()  # the holding owns its tensors: the buffer may be reused
    assert_same(got, st)


@pytest.mark.parametrize("skip", [False, True])
def test_an_fp16_holding_rolls_forward_with_its_owners_scale_or_skips(skip: bool) -> None:
    """fp16: a replica's held gradients still carry the step's loss scale; the roll-forward
    unscales them (the owner's multiplication by 1/scale), clips, steps with the rate at the
    schedule's position (skipped steps held back), or, where the job's overflow skipped the
    step, leaves parameters and optimizer state alone; the scaler advances either way."""
    sched = schedule()
    scaling = LossScaling(enabled=True, initial_scale=2.0**10, hysteresis=1, window=4)
    recipe = OptimizerRecipe(torch.optim.AdamW, dict(sched.defaults), sched, scaling)
    g = torch.Generator().manual_seed(9)
    names = [n for n, _ in stage_names(1)]
    params = [torch.nn.Parameter(torch.randn(SHAPES[n], generator=g)) for n in names]
    reference = torch.optim.AdamW(params, **recipe.hyper)
    for p in params:  # one earlier step, so that the state is not the zeros of a fresh one
        p.grad = torch.randn(p.shape, generator=g)
    sched.apply(reference.param_groups, 0)
    reference.step()
    # Before step 5 of the run, two of whose steps were skipped: schedule position 3.
    before = LossScaleState(2.0**10, iteration=5, last_overflow=2, hysteresis=1, skipped=2)
    unscaled = [torch.randn(SHAPES[n], generator=g) for n in names]
    scaled = [u * before.scale for u in unscaled]  # exact: a power of two
    clip = 0.5
    holding = StageState(
        5,
        {n: p.detach().clone() for n, p in zip(names, params, strict=True)},
        {
            n: {k: v.clone() for k, v in reference.state[p].items()}
            for n, p in zip(names, params, strict=True)
        },
        {n: grad.clone() for n, grad in zip(names, scaled, strict=True)},
        clip,
        loss_scale=before,
        grads_scale=before.scale,
        skip=skip,
    )
    if not skip:
        sched.apply(reference.param_groups, 3)
        for p, grad in zip(params, scaled, strict=True):
            p.grad = grad.clone().mul_(1.0 / before.scale).mul_(clip)
        reference.step()

    roll_forward_holdings(Holdings({1: holding}), 6, recipe)

    rolled = holding
    assert rolled.version == 6 and rolled.grads is None
    for n, p in zip(names, params, strict=True):
        assert torch.equal(rolled.params[n], p.detach()), n
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(rolled.opt[n][key], reference.state[p][key]), (n, key)
    # Written out (DeepSpeed's rule): an overflow halves the scale (hysteresis 1) and counts a
    # skip; a clean step 2 steps after the overflow at a window of 4 keeps it.
    if skip:
        assert rolled.loss_scale == LossScaleState(2.0**9, 6, 5, 1, 3)
    else:
        assert rolled.loss_scale == LossScaleState(2.0**10, 6, 2, 1, 2)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_a_sharded_replica_ring_and_assembly_give_back_the_whole_stage(shards: int) -> None:
    """Each shard's holder receives the owner's pieces in one message of several stages
    (``replica_payload`` / ``pack_stages`` / ``stage_views``, as ``load_replica`` does); every
    shard's holding together assembles into the owner's stages, bit for bit."""
    own = {s: make_stage(s) for s in (0, 1)}
    per_stage: dict[int, list[tuple[tuple[Piece, ...], StageState]]] = {0: [], 1: []}
    for shard in range(shards):
        held = [x for s in (0, 1) for x in shard_pieces(numels(s), shard, shards)]
        payload = replica_payload(own, held if shards > 1 else None, LOGICAL)
        flat = pack_stages(payload)
        names = {s: names for s, (names, _) in payload.items()}
        received = stage_views(names, flat.clone())  # the wire: a buffer of its own
        for s in (0, 1):
            pieces = shard_pieces(numels(s), shard, shards)
            params, opt, scaler = received[s]
            got = StageState(VERSION, params, opt, loss_scale=scaler)
            if shards == 1:
                assert_same(got, own[s])
                continue
            assert names[s] == piece_names(pieces)
            per_stage[s].append((pieces, got))
    if shards == 1:
        return
    for s in (0, 1):
        assert_same(assemble(stage_names(s), per_stage[s], VERSION), own[s])


def test_a_stage_is_assembled_from_a_received_shard_and_its_own() -> None:
    """A member holding shard 0 of a stage receives shard 1 (``prepare_exchange``/
    ``received``): its holding and the buffer assemble into the whole stage."""
    whole = make_stage(1)
    mine = held_state({1: whole}, 1, 0, 2)
    theirs = held_state({1: whole}, 1, 1, 2)
    transfers = [StageTransfer(1, "me", "me", (0, 2)), StageTransfer(1, "peer", "me", (1, 2))]
    ranks = {"me": 0, "peer": 1}
    names = {1: stage_names(1)}
    ex_me = prepare_exchange("me", transfers, Holdings({1: mine}), names, ranks.__getitem__)
    ex_peer = prepare_exchange("peer", transfers, Holdings({1: theirs}), {}, ranks.__getitem__)
    assert [op.send for op in ex_me.ops] == [False] and [op.send for op in ex_peer.ops] == [True]
    deliver({0: ex_me.ops, 1: ex_peer.ops})
    assert_same(ex_me.received(names, VERSION)[1], whole)
    assert StageExchange().received({}, VERSION) == {}


def test_a_checkpoint_file_gives_back_its_stage_and_refuses_another_jobs() -> None:
    st = make_stage(1)
    payload = stage_payload(st, logical_workers=4, seed=3)
    assert_same(stage_of_payload("stage-1", 7, payload, logical_workers=4, seed=3), st)
    with pytest.raises(RuntimeError, match="another job's"):
        stage_of_payload("stage-1", 7, payload, logical_workers=4, seed=4)
