"""The replica a stage holds of its successor (``spotline.pipeline.redundancy``): its layers
(or, sharded, its pieces of them) and optimizer outside the engine's module, what one step
keeps for a replay, the committed update it has yet to apply, and the digests that compare
a replica with its owner.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spotline.pipeline.engine import SpotlinePipelineEngine, replica_messages
from spotline.pipeline.lr_schedule import constructor_hyper
from spotline.pipeline.replica_transport import streams_untied
from spotline.plan.loss_scale import LossScaleState
from spotline.plan.shards import Piece, shard_pieces


def stage_of_name(name: str, logical: Sequence[int]) -> int:
    """The logical stage (layer boundaries ``logical``) of a parameter (or piece) name, which
    starts with its global layer index (``"3.attn.c_attn.weight"``)."""
    layer = int(name.split(".", 1)[0])
    for stage in range(len(logical) - 1):
        if logical[stage] <= layer < logical[stage + 1]:
            return stage
    raise AssertionError(f"{name} is in no logical stage")


def shard_pieces_of(
    named: Sequence[tuple[str, torch.Tensor]], logical: Sequence[int], shard: int, shards: int
) -> tuple[Piece, ...]:
    """The pieces of ``named`` in shard ``shard`` of ``shards``: each logical stage's (by the
    layer boundaries ``logical``) tensors sharded on their own (``spotline.plan.shards``),
    so that a shard of a logical stage means the same whatever physical stage holds it.
    Logical stage by stage, each in name order: the order the owner sends its gradients in
    and the holder keeps its pieces in."""
    by_stage: dict[int, list[tuple[str, int]]] = {}
    for name, p in named:
        by_stage.setdefault(stage_of_name(name, logical), []).append((name, p.numel()))
    return tuple(
        piece
        for stage in sorted(by_stage)
        for piece in shard_pieces(sorted(by_stage[stage]), shard, shards)
    )


def piece_of(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """``piece``'s elements of ``tensor`` (a whole tensor of ``piece.name``'s shape), a view."""
    return tensor.detach().reshape(-1)[piece.start : piece.stop]


@dataclass(frozen=True)
class PendingReplicaStep:
    """A committed update the replica has received and not yet applied: the optimizer step
    ``step`` it is, the owner's clip coefficient of that step, the loss scaler before it
    (fp16: the scale its gradients carry, the learning rate's schedule position) and whether
    the job's overflow skips it (the replica's gradients are the received ones,
    ``Replica.flat_grads``)."""

    step: int
    clip: float
    loss_scale: LossScaleState
    skip: bool


@dataclass
class StepStash:
    """What one step keeps for a possible replay; cleared at the start of every step."""

    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    replica_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    # Eager: (replica input leaf, replica output or loss) with the autograd graph kept.
    redundant: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Bytes the kept graphs' saved tensors hold (the replica's own parameters excluded):
    # counted as autograd saves them, by storage (spotline.pipeline.memory).
    graph_bytes: int = 0
    graph_storages: set[int] = field(default_factory=set)

    def count_saved(self, saved: torch.Tensor, exclude: set[int]) -> torch.Tensor:
        """A ``saved_tensors_hooks`` pack hook: count ``saved``'s storage once, keep it."""
        ptr = saved.untyped_storage().data_ptr()
        if ptr not in exclude and ptr not in self.graph_storages:
            self.graph_storages.add(ptr)
            self.graph_bytes += saved.untyped_storage().nbytes()
        return saved


class Replica:
    """The successor stage's layers and optimizer, held by this stage (not a torch Module).

    Parameters are named by global layer index, like the owner's PipelineModule, so owner
    and replica can be compared and their state moved by name.
    """

    def __init__(
        self,
        engine: SpotlinePipelineEngine,
        stage: int,
        device: torch.device,
        *,
        shard: int = 0,
        shards: int = 1,
        logical: Sequence[int] | None = None,
    ) -> None:
        """``shard`` of ``shards`` (``shards`` > 1: a sharded replica): keep only that
        shard's tensors of each logical stage (layer boundaries ``logical``)."""
        module = engine.module
        self.stage = stage
        self.shard, self.shards = shard, shards
        self.start, self.stop = module.parts[stage], module.parts[stage + 1]
        layers = torch.nn.ModuleDict()
        self.forward_funcs: list[Callable[[torch.Tensor], torch.Tensor]] = []
        for layer_idx in range(self.start, self.stop):
            layer = module._layer_specs[layer_idx].build().to(device)
            layers[str(layer_idx)] = layer
            layer.register_forward_pre_hook(engine._make_reseed_hook(layer_idx))
        named: list[tuple[str, torch.Tensor]] = list(layers.named_parameters())
        self.layers: torch.nn.ModuleDict | None = layers
        if shards > 1:
            assert logical is not None
            whole = dict(named)
            # Each piece its own 1-D tensor named by its key (a clone, not a view: a view
            # would keep the whole tensor's storage alive); the layers are freed here. In the
            # pieces' order, as the owner sends its gradients.
            named = [
                (x.key, torch.nn.Parameter(piece_of(whole[x.name], x).clone()))
                for x in shard_pieces_of(named, logical, shard, shards)
            ]
            del whole
            self.layers = None
        del layers
        self.named_params = named
        self.params = [p for _, p in self.named_params]
        numel = sum(p.numel() for p in self.params)
        # The owner's messages, in its send order (its ``_message_spans``); a sharded
        # replica's pieces come in one.
        self.message_spans = (
            [(0, numel)]
            if shards > 1
            else replica_messages(
                [(n, p.numel()) for n, p in named],
                engine.tied_names,
                streamed=streams_untied(
                    stage,
                    engine.num_stages,
                    engine.grid.get_data_parallel_world_size(),
                    sharded=False,
                ),
            )
        )
        opt = engine.optimizer
        # The owner's optimizer class and hyper-parameters.
        self.optimizer = type(opt)(self.params, **constructor_hyper(opt))
        self.is_last = stage == engine.num_stages - 1
        self.loss_fn = module.loss_fn
        self.flat_grads: torch.Tensor | None = None

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A sharded replica has no layers: the schedule never replays it (no stashes).
        assert self.layers is not None, "a sharded replica cannot run its stage"
        for layer_idx in range(self.start, self.stop):
            x = self.layers[str(layer_idx)](x)
        return x

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def set_grads_from_flat(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            # A view, not a copy: the received buffer is not written again before zero_grad
            # drops these views after the replica's step.
            p.grad = flat[offset : offset + n].view_as(p)
            offset += n
        assert offset == flat.numel()


def state_digest(
    named_params: Sequence[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer
) -> str:
    """SHA-256 over parameters and their optimizer state, by name (the exactness check)."""
    return _digest([(name, p, optimizer.state.get(p, {})) for name, p in named_params])


def pieces_digest(
    named_params: Sequence[tuple[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    pieces: Sequence[Piece],
) -> str:
    """:func:`state_digest` of ``pieces`` of whole tensors ``named_params``, each named by its
    key: what a sharded replica holding those pieces digests to when it is exact."""
    params = dict(named_params)
    entries = []
    for x in pieces:
        p = params[x.name]
        state = optimizer.state.get(p, {})
        # The state shaped like the parameter (exp_avg, exp_avg_sq) is sliced as it is;
        # the rest (the step count) is the piece's too.
        sliced = {
            k: piece_of(v, x) if torch.is_tensor(v) and v.shape == p.shape else v
            for k, v in state.items()
        }
        entries.append((x.key, piece_of(p, x), sliced))
    return _digest(entries)


def _digest(entries: Sequence[tuple[str, torch.Tensor, Mapping[str, Any]]]) -> str:
    h = hashlib.sha256()
    for name, p, state in sorted(entries, key=lambda item: item[0]):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
        for key, value in sorted(state.items()):
            h.update(key.encode())
            t = value if torch.is_tensor(value) else torch.tensor(value)
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
