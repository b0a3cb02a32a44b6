"""Model-state memory counted from the tensors: what each rank holds, by kind.

RSS says how much a process holds, not what for (the allocator's caches, the interpreter,
DeepSpeed's buffers). :func:`model_state_bytes` counts the bytes of the tensors that make up
a rank's model state: its parameters, their gradients, the optimizer's state, the replica of
its successor (parameters, received gradients, optimizer state) and what a replay keeps.
Tensors that share a storage (tied weights, views of one flat buffer) are counted once, by
storage: the figure is what the rank would free if it dropped that kind of state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from spotline.pipeline.replica import Replica, StepStash
from spotline.wire.protocol import ModelStateBytes


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped, shared counted once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                yield value


def model_state_bytes(
    module: torch.nn.Module, engine_optimizer: Any, replica: Replica | None, stash: StepStash
) -> ModelStateBytes:
    """What a rank holds now, by kind (call it where the step's state is alive): its
    ``module``'s parameters and gradients, the state of its engine's optimizer
    (``engine_optimizer``, DeepSpeed's wrapper or a torch optimizer), its ``replica`` and
    what its ``stash`` keeps for a replay."""
    params = list(module.parameters())
    # DeepSpeed wraps the torch optimizer; the state lives in the wrapped one.
    optimizer: Any = getattr(engine_optimizer, "optimizer", engine_optimizer)
    return ModelStateBytes(
        parameters=storage_bytes(params),
        gradients=storage_bytes(p.grad for p in params),
        optimizer=storage_bytes(optimizer_tensors(optimizer)),
        replica_parameters=storage_bytes(replica.params) if replica else 0,
        replica_gradients=(
            storage_bytes([replica.flat_grads, *(p.grad for p in replica.params)]) if replica else 0
        ),
        replica_optimizer=storage_bytes(optimizer_tensors(replica.optimizer)) if replica else 0,
        stash=storage_bytes(
            [
                *stash.outputs.values(),
                *stash.input_grads.values(),
                *stash.replica_inputs.values(),
            ]
        ),
        eager_graph=stash.graph_bytes,
    )
