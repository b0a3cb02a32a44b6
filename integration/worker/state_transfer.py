"""A generation's state load: who sends which stage, shard or replica to whom, and loading it.

When a generation starts, every member needs the logical stages the layout gives it, at the
plan's resume step, and its replica holder needs a copy of them (``spotline.pipeline.redundancy``):

1. **Own stages.** A member that holds a stage (it ran it, or held its replica: a takeover)
   keeps it. One that lacks it receives it from the member the plan names
   (``PlanMessage.sources``), or, for a stage no member holds whole, every shard of it from its
   holder (``PlanMessage.shard_sources``; assembled here). :func:`stage_transfers` lists every
   transfer of a plan, in the order every member issues them: a pure function of the plan,
   so no one has to announce anything. :func:`prepare_exchange` turns one member's part of
   that list into messages (:class:`PeerOp`) and :meth:`StageExchange.received` turns the
   messages received into holdings.
2. **Replicas**, by a ring: each physical stage sends its own state (a sharded replica's
   holder: only its shard's pieces, :func:`replica_payload`) to its predecessor and
   receives its successor's.

The messages go through a *transport*: gloo's point-to-point operations in a worker
(:func:`gloo_transport`); a test can deliver them between in-process ranks instead.
The tensor forms (pack, assemble) are ``spotline.worker.holdings``'.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spotline.pipeline.group_setup import wait_p2p
from spotline.pipeline.redundancy import RedundantPipelineEngine
from spotline.pipeline.replica import stage_of_name
from spotline.plan.grid import Layout
from spotline.plan.layout import ShardSource
from spotline.plan.shards import Piece, shard_pieces
from spotline.wire.protocol import PlanMessage
from spotline.worker.holdings import (
    Holdings,
    Names,
    PackedViews,
    StageState,
    assemble,
    engine_stages,
    names_by_stage,
    pack,
    packed_numel,
    packed_views,
    piece_names,
    piece_state,
    set_opt_state,
    unpack,
    views_state,
)


@dataclass(frozen=True)
class PeerOp:
    """One message of a transfer: ``tensor`` sent to (``send``) or received from rank ``peer``."""

    send: bool
    tensor: torch.Tensor
    peer: int


Transport = Callable[[Sequence[PeerOp]], None]
"""Carries out one rank's messages, all at once (every sender's and receiver's in the same
order between any two ranks)."""


def gloo_transport(ops: Sequence[PeerOp]) -> None:
    """The messages as one batch of the process group's point-to-point operations."""
    p2p = [dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, op.peer) for op in ops]
    for work in dist.batch_isend_irecv(p2p):
        wait_p2p(work)


# -- who sends what to whom (pure) -------------------------------------------------------


@dataclass(frozen=True)
class StageTransfer:
    """``target`` lacks logical stage ``stage``: ``source`` sends it the whole stage, or
    (``shard``: ``(shard, shards)``) the pieces of that shard, one of every shard of a stage
    no member holds whole. A source that is the target itself sends nothing (its shard is
    used as it is)."""

    stage: int
    source: str
    target: str
    shard: tuple[int, int] | None = None


def stage_transfers(
    layout: Layout,
    holders: Mapping[int, Sequence[str]],
    sources: Sequence[tuple[int, str]],
    shard_sources: Sequence[ShardSource],
) -> tuple[StageTransfer, ...]:
    """Every transfer of a plan, in the order every member issues its messages: by member
    in rank order, by stage, by shard. Empty ``holders``: a fresh start, nothing moves."""
    if not holders:
        return ()
    source = dict(sources)
    by_shard: dict[int, list[ShardSource]] = {}
    for part in shard_sources:
        by_shard.setdefault(part.stage, []).append(part)
    out: list[StageTransfer] = []
    for member in layout.members:
        for stage in layout.stages_of(member):
            if member in holders[stage]:
                continue
            if stage in by_shard:
                out.extend(
                    StageTransfer(stage, part.worker, member, (part.shard, part.shards))
                    for part in by_shard[stage]
                )
            else:
                out.append(StageTransfer(stage, source[stage], member))
    return tuple(out)


def plan_transfers(plan: PlanMessage, layout: Layout) -> tuple[StageTransfer, ...]:
    """:func:`stage_transfers` of a coordinator's plan."""
    return stage_transfers(layout, plan.holders, plan.sources, plan.shard_sources)


def replica_payload(
    own: Mapping[int, StageState], held: Sequence[Piece] | None, logical: Sequence[int]
) -> dict[int, tuple[Names, StageState]]:
    """What a physical stage sends its predecessor, the holder of its replica: each own
    logical stage whole (``held`` None), or only the pieces ``held`` of it (a sharded
    replica: views of the stage's tensors, by piece key)."""
    if held is None:
        return {s: (st.names(), st) for s, st in own.items()}
    by_stage = {s: [x for x in held if stage_of_name(x.name, logical) == s] for s in own}
    return {s: (piece_names(by_stage[s]), piece_state(own[s], by_stage[s])) for s in by_stage}


def pack_stages(payload: Mapping[int, tuple[Names, StageState]]) -> torch.Tensor:
    """Several stages as one message, in stage order (each :func:`pack`'s form)."""
    flat = torch.empty(sum(packed_numel(names) for names, _ in payload.values()))
    offset = 0
    for s in sorted(payload):
        names, st = payload[s]
        n = packed_numel(names)
        pack(names, st, out=flat[offset : offset + n])
        offset += n
    return flat


def stage_views(names: Mapping[int, Names], flat: torch.Tensor) -> dict[int, PackedViews]:
    """The stages :func:`pack_stages` wrote into ``flat`` (``names``: each one's tensors),
    as views of it (``holdings.packed_views``)."""
    out = {}
    offset = 0
    for stage in sorted(names):
        n = packed_numel(names[stage])
        out[stage] = packed_views(names[stage], flat[offset : offset + n])
        offset += n
    assert offset == flat.numel()
    return out


# -- one member's part of the stage transfers ---------------------------------------------

# Where a shard of a stage being assembled comes from: its pieces and the buffer they are
# received into, or the holding that is that shard (this member's own).
_Shard = tuple[tuple[Piece, ...], torch.Tensor | StageState]


@dataclass
class StageExchange:
    """One member's messages of the stage transfers, and what it receives into."""

    ops: list[PeerOp] = field(default_factory=list)
    whole: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    shards: dict[int, list[_Shard]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(op.tensor.nbytes for op in self.ops)

    def received(self, own_names: Mapping[int, Names], version: int) -> dict[int, StageState]:
        """The stages received (once every message is delivered), at step ``version``: each
        its own copy, a sharded one assembled from its shards."""
        out = {stage: unpack(own_names[stage], buf, version) for stage, buf in self.whole}
        for stage, parts in self.shards.items():
            shards: list[tuple[tuple[Piece, ...], StageState]] = []
            for pieces, got in parts:
                if isinstance(got, torch.Tensor):
                    # Views of the buffer: assembling copies each tensor once.
                    got = views_state(packed_views(piece_names(pieces), got), version)
                shards.append((pieces, got))
            out[stage] = assemble(own_names[stage], shards, version)
        return out


def prepare_exchange(
    me: str,
    transfers: Sequence[StageTransfer],
    holdings: Holdings,
    own_names: Mapping[int, Names],
    rank_of: Callable[[str], int],
) -> StageExchange:
    """Member ``me``'s messages of ``transfers``: what it sends from its holdings, and a
    buffer for each stage or shard it receives (``own_names``: its stages' tensors, as its
    engine has them; a member knows each shard's pieces from them, ``shard_pieces``)."""
    ex = StageExchange()
    # A holding sent to several members is packed once (gloo sends read the one buffer): a
    # packed copy is the holding's size again (at GPT-2 small size about 1 GB a stage).
    packed: dict[int, torch.Tensor] = {}

    def packed_holding(stage: int) -> torch.Tensor:
        if stage not in packed:
            st = holdings.stages[stage]
            packed[stage] = pack(st.names(), st)
        return packed[stage]

    for t in transfers:
        if t.shard is None:
            if t.source == me:
                ex.ops.append(PeerOp(True, packed_holding(t.stage), rank_of(t.target)))
            if t.target == me:
                buf = torch.empty(packed_numel(own_names[t.stage]))
                ex.ops.append(PeerOp(False, buf, rank_of(t.source)))
                ex.whole.append((t.stage, buf))
            continue
        if t.source == me and t.target != me:
            st = holdings.stages[t.stage]
            assert (st.shard, st.shards) == t.shard, (t, st.shard, st.shards)
            if st.names():  # a stage with fewer elements than shards leaves some empty
                ex.ops.append(PeerOp(True, packed_holding(t.stage), rank_of(t.target)))
        if t.target == me:
            numels = sorted((n, int(shape.numel())) for n, shape in own_names[t.stage])
            pieces = shard_pieces(numels, *t.shard)
            if t.source == me:
                ex.shards.setdefault(t.stage, []).append((pieces, holdings.stages[t.stage]))
            elif pieces:
                buf = torch.empty(packed_numel(piece_names(pieces)))
                ex.ops.append(PeerOp(False, buf, rank_of(t.source)))
                ex.shards.setdefault(t.stage, []).append((pieces, buf))
    return ex


# -- into the engine ----------------------------------------------------------------------


def load_generation_state(
    engine: RedundantPipelineEngine,
    plan: PlanMessage,
    layout: Layout,
    me: str,
    holdings: Holdings,
    logical: Sequence[int],
    transport: Transport = gloo_transport,
) -> int:
    """Load a new generation's engine: own stages from ``holdings`` (after receiving what
    this member lacks, and sending what it is the source of), the committed step, then the
    replicas by a ring transfer. Returns the bytes sent and received. Collective."""
    nbytes = 0
    # Generation 0 (no holders): everyone starts from the initial weights.
    if plan.holders:
        own_names = names_by_stage(engine.module.named_parameters(), logical)
        ex = prepare_exchange(me, plan_transfers(plan, layout), holdings, own_names, layout.rank_of)
        if ex.ops:
            nbytes += ex.nbytes
            transport(ex.ops)
        holdings.stages.update(ex.received(own_names, plan.resume_step))
        load_own_stages(engine, holdings, own_names)
    resume = plan.resume_step
    engine.applied_steps = resume
    engine.global_steps = resume
    # DeepSpeed's scheduler object starts at zero in every new engine: move it to the
    # committed step's position (the rate each update uses comes from engine.step_schedule
    # anyway).
    position = engine.loss_scaler.state.schedule_position(resume)
    engine.step_schedule.position(engine.lr_scheduler, position)
    if engine.replica is not None:
        nbytes += load_replica(engine, logical, resume, transport)
    return nbytes


def load_own_stages(
    engine: RedundantPipelineEngine, holdings: Holdings, own_names: Mapping[int, Names]
) -> None:
    """Copy the held own stages' parameters into the engine and hand it their optimizer
    state. Handed, not copied: a holding's tensors belong to no live engine (taken
    from the dropped one, received or read from a checkpoint) and the holdings are
    dropped once the state is loaded; a generation that fails before its first step
    leaves them unchanged."""
    params = dict(engine.module.named_parameters())
    # Every holding of the committed step has the same scaler (one decision for the job).
    scales = {holdings.stages[stage].loss_scale for stage in own_names}
    assert len(scales) == 1, scales
    engine.loss_scaler.state = scales.pop()
    for stage, names in own_names.items():
        st = holdings.stages[stage]
        for name, _ in names:
            with torch.no_grad():
                params[name].copy_(st.params[name])
            set_opt_state(engine.optimizer, params[name], dict(st.opt[name]))


def load_replica(
    engine: RedundantPipelineEngine, logical: Sequence[int], resume: int, transport: Transport
) -> int:
    """Replicas: each physical stage sends its whole state (a sharded replica's holder: its
    shard's pieces) to its predecessor. Returns the bytes sent and received."""
    replica = engine.replica
    assert replica is not None
    # Packed at once: one copy.
    own = engine_stages(engine, logical, clone=False)
    flat_out = pack_stages(replica_payload(own, engine.held_by_predecessor, logical))
    rep_names = names_by_stage(replica.named_params, logical)
    flat_in = torch.empty(sum(packed_numel(names) for names in rep_names.values()))
    pred = engine._peer(engine.stage_id - 1)
    succ = engine._peer(engine.stage_id + 1)
    transport([PeerOp(True, flat_out, pred), PeerOp(False, flat_in, succ)])
    rparams = dict(replica.named_params)
    for stage, (got_params, got_opt, got_scale) in stage_views(rep_names, flat_in).items():
        assert got_scale == engine.loss_scaler.state, (stage, got_scale)
        # Copied straight out of the received buffer (once, into tensors of their own).
        for name, _ in rep_names[stage]:
            with torch.no_grad():
                rparams[name].copy_(got_params[name])
            set_opt_state(
                replica.optimizer, rparams[name], {k: v.clone() for k, v in got_opt[name].items()}
            )
    engine.replica_applied_steps = resume
    return flat_out.nbytes + flat_in.nbytes
