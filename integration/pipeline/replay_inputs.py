"""What a replica holder's replay of its successor needs from other stages, gathered.

Holder ``p`` replays stage ``p+1`` (``RedundantPipelineEngine.replay_successor``). It needs
the output gradients of stage ``p+1``, which stage ``p+2`` stashed as its input gradients,
and, when the replica holds one side of a tied weight, the other side's unreduced
gradient. In a real takeover the same transfers run over the new process group; here
every stage runs them at once (a test of the takeover path), as one batch of sends and
receives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from spotline.pipeline.engine import SpotlinePipelineEngine
from spotline.pipeline.group_setup import wait_p2p
from spotline.pipeline.replica import Replica, StepStash


@dataclass(frozen=True)
class ReplayInputs:
    """A holder's replay inputs from other stages: the successor's output gradient of each
    micro-batch, and the unreduced gradient of each tied partner (by global name) of a
    parameter its replica holds."""

    output_grads: dict[int, torch.Tensor]
    partner_grads: dict[str, torch.Tensor]


def exchange_replay_inputs(
    engine: SpotlinePipelineEngine,
    stash: StepStash,
    replica: Replica | None,
    pre_tied_grads: Mapping[str, torch.Tensor],
) -> ReplayInputs:
    """Send what this stage holds of others' replay inputs (its ``stash``'s input gradients,
    its unreduced tied gradients ``pre_tied_grads``) and receive its own replica's; a
    collective over the pipeline."""
    stages = engine.num_stages
    me = engine.stage_id
    micro_batches = engine.micro_batches
    ops: list[dist.P2POp] = []

    def peer(stage: int) -> int:
        return int(engine.grid.stage_to_global(stage_id=stage % stages))

    def transfer(
        src_stage: int,
        dst_stage: int,
        make_send: Callable[[], torch.Tensor],
        recv_like: torch.Tensor | None,
    ) -> torch.Tensor | None:
        if src_stage == dst_stage == me:
            return make_send()
        if src_stage == me:
            ops.append(dist.P2POp(dist.isend, make_send(), peer(dst_stage)))
        if dst_stage == me:
            assert recv_like is not None
            buf = torch.empty_like(recv_like)
            ops.append(dist.P2POp(dist.irecv, buf, peer(src_stage)))
            return buf
        return None

    # Output gradients: stage q (q > 0) sends its input gradients to q - 2.
    grads_like = _hidden_like(stash, micro_batches)
    received = None
    for q in range(1, stages):
        holder = (q - 2) % stages
        got = transfer(
            q,
            holder,
            lambda: torch.stack([stash.input_grads[m] for m in range(micro_batches)]),
            grads_like,
        )
        if holder == me:
            received = got
    # Tied partners: the holder of each side's replica needs the other side's gradient.
    replica_params = dict(replica.named_params) if replica is not None else {}
    partner_grads: dict[str, torch.Tensor] = {}
    for pair in engine.tied_pairs:
        for mine, mine_layer, partner, partner_layer in (
            (pair.original, pair.original_layer, pair.copy, pair.copy_layer),
            (pair.copy, pair.copy_layer, pair.original, pair.original_layer),
        ):
            holder = (engine.stage_of_layer(mine_layer) - 1) % stages
            owner = engine.stage_of_layer(partner_layer)
            like = replica_params[mine] if holder == me else None
            got = transfer(owner, holder, partial(pre_tied_grads.__getitem__, partner), like)
            if holder == me:
                assert got is not None
                partner_grads[partner] = got
    if ops:
        for work in dist.batch_isend_irecv(ops):
            wait_p2p(work)
    output_grads = {} if received is None else {m: received[m] for m in range(micro_batches)}
    return ReplayInputs(output_grads, partner_grads)


def _hidden_like(stash: StepStash, micro_batches: int) -> torch.Tensor:
    """A tensor shaped like this step's stacked hidden states (micro-batches first)."""
    sample = next(iter(stash.outputs.values()), None)
    if sample is None:
        sample = next(iter(stash.input_grads.values()))
    return torch.empty((micro_batches, *sample.shape), dtype=sample.dtype)
