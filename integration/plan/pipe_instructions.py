"""The instructions a lowered schedule holds: one frozen type per instruction, its fields
the keyword arguments its handler takes.

``spotline.plan.lowering`` turns a schedule's actions into these; the pipeline engine
(``spotline.pipeline.engine``) runs them, dispatching on each instruction's type (a map
from type to handler that every engine builds for itself). The types named after
DeepSpeed's own instructions (``LoadMicroBatch`` ... ``OptimizerStep``) mean exactly what
DeepSpeed's do, with the same keyword arguments; the others are Spotline's.

Pure: no torch or DeepSpeed import.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from enum import IntEnum


class GradPart(IntEnum):
    """Which of a stage's gradients an end-of-step instruction covers (its ``part``
    field): all of them, or the ``UNTIED`` ones, final before the tied reduction, and the
    ``TIED`` ones, the rest. Where a stage's tied copies come after all its other
    parameters (``send_untied_early``), those split it; on stage 0, whose tied copies come
    first (``stream_untied``), the layers after the last one holding a tied copy are the
    untied ones."""

    ALL = 0
    UNTIED = 1
    TIED = 2


@dataclass(frozen=True)
class Instruction:
    """One instruction of a lowered schedule; its concrete type says what it does."""

    @property
    def name(self) -> str:
        """The instruction's name: its type's (DeepSpeed's name for DeepSpeed's own)."""
        return type(self).__name__

    @property
    def kwargs(self) -> dict[str, int]:
        """The keyword arguments its handler is called with: every field without a
        default, and those with one where they differ from it (so ``ReduceGrads()`` passes
        none, as DeepSpeed's does, and ``ReduceGrads(GradPart.TIED)`` its part)."""
        out: dict[str, int] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.default is MISSING or value != f.default:
                out[f.name] = value
        return out


@dataclass(frozen=True)
class OnPipeBuffer(Instruction):
    """An instruction on the executing stage's DeepSpeed pipe buffer ``buffer_id``."""

    buffer_id: int


@dataclass(frozen=True)
class OnMicroBatch(Instruction):
    """An instruction on micro-batch ``micro_batch_id``, outside the pipe buffers."""

    micro_batch_id: int


# -- DeepSpeed's own instructions -----------------------------------------------------------


@dataclass(frozen=True)
class LoadMicroBatch(OnPipeBuffer):
    """DeepSpeed's: load the next micro-batch into pipe buffer ``buffer_id`` (first and
    last stage)."""


@dataclass(frozen=True)
class ForwardPass(OnPipeBuffer):
    """DeepSpeed's: the stage's forward pass of pipe buffer ``buffer_id``."""


@dataclass(frozen=True)
class BackwardPass(OnPipeBuffer):
    """DeepSpeed's: the stage's backward pass of pipe buffer ``buffer_id``."""


@dataclass(frozen=True)
class SendActivation(OnPipeBuffer):
    """DeepSpeed's: send the output in pipe buffer ``buffer_id`` to the next stage."""


@dataclass(frozen=True)
class RecvActivation(OnPipeBuffer):
    """DeepSpeed's: receive the input of pipe buffer ``buffer_id`` from the previous stage."""


@dataclass(frozen=True)
class SendGrad(OnPipeBuffer):
    """DeepSpeed's: send the input gradient of pipe buffer ``buffer_id`` to the previous
    stage."""


@dataclass(frozen=True)
class RecvGrad(OnPipeBuffer):
    """DeepSpeed's: receive the output gradient of pipe buffer ``buffer_id`` from the next
    stage."""


@dataclass(frozen=True)
class ReduceTiedGrads(Instruction):
    """DeepSpeed's: add the gradients of tied copies (before the data-parallel reduction)."""


@dataclass(frozen=True)
class ReduceGrads(Instruction):
    """DeepSpeed's data-parallel reduction (Spotline's exact one), of ``part`` of the
    stage's gradients."""

    part: GradPart = GradPart.ALL


@dataclass(frozen=True)
class OptimizerStep(Instruction):
    """DeepSpeed's: step the stage's optimizer and zero its gradients (the commit)."""


DEEPSPEED_INSTRUCTIONS: tuple[type[Instruction], ...] = (
    LoadMicroBatch,
    ForwardPass,
    BackwardPass,
    SendActivation,
    RecvActivation,
    SendGrad,
    RecvGrad,
    ReduceTiedGrads,
    ReduceGrads,
    OptimizerStep,
)
"""The types named after DeepSpeed's instructions (the engine runs DeepSpeed's handler)."""


# -- redundancy -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StashOutput(OnPipeBuffer):
    """Keep a detached copy of this stage's forward output (pipe buffer ``buffer_id``) for
    micro-batch ``micro_batch_id``: the successor's input, with which this stage can replay
    the successor (RedundantForward, or a takeover). Follows the ForwardPass of the same
    buffer, before the BackwardPass frees it."""

    micro_batch_id: int


@dataclass(frozen=True)
class StashInputGrad(OnPipeBuffer):
    """Keep a copy of the gradient of this stage's input (pipe buffer ``buffer_id``) for
    micro-batch ``micro_batch_id``: the predecessor's output gradient, which the
    predecessor's replica holder needs to replay its backward pass. Follows the
    BackwardPass."""

    micro_batch_id: int


@dataclass(frozen=True)
class ReplicaLoad(OnMicroBatch):
    """Last stage only: fetch stage 0's inputs (token ids) of ``micro_batch_id``, which its
    own LoadMicroBatch drops (it keeps the labels). Precedes the RedundantForward of stage 0
    for the same micro-batch."""


@dataclass(frozen=True)
class RedundantForward(OnMicroBatch):
    """Eager mode: run the successor's forward for ``micro_batch_id`` on the replica, from
    this stage's stashed output (stage 0's inputs on the last stage), keeping the autograd
    graph for a takeover's backward pass. In a bubble after the input exists."""


@dataclass(frozen=True)
class ReplicaGradPost(Instruction):
    """Post the receive of the successor's reduced gradients into the replica's buffer,
    once a step, as soon as the buffer is free (after the ReplicaStep that applies the
    previous update): they then arrive while this stage still computes, and
    ReplicaGradRecv only waits."""


@dataclass(frozen=True)
class ReplicaGradSend(Instruction):
    """Post the send of this stage's reduced gradients (``part`` of them) to its replica
    holder (predecessor), into the receive the holder posted. After their ReduceGrads
    (final, unclipped), before OptimizerStep zeroes them."""

    part: GradPart = GradPart.ALL


@dataclass(frozen=True)
class ReplicaGradRecv(Instruction):
    """Wait for the successor's reduced gradients (ReplicaGradPost's receive) and for this
    stage's own sends; the replica's gradients are then the received ones. Before the
    commit, which needs every holder to hold its successor's final gradients."""


@dataclass(frozen=True)
class ReplicaStep(Instruction):
    """Apply the owner's last committed update to the replica (same clip coefficient,
    learning rate, optimizer): right after the commit, or in the next step's first bubble
    (lazy), before the next ReplicaGradRecv."""


# -- logical workers --------------------------------------------------------------------------


@dataclass(frozen=True)
class BeginLogicalWorker(Instruction):
    """Start the pipeline's ``index``-th hosted logical worker: its randomness (dropout is
    seeded by its id), its micro-batches and its loss from here on. Opens each repetition
    of the schedule's body; pairs with KeepLogicalGradients of the same index."""

    index: int


@dataclass(frozen=True)
class KeepLogicalGradients(Instruction):
    """Move the ``index``-th hosted logical worker's gradients (``part`` of them) aside
    (and zero them) and record its loss. Closes its repetition of the body, after its
    ReduceTiedGrads; the step's one ReduceGrads reduces every kept logical worker exactly."""

    index: int
    part: GradPart = GradPart.ALL


@dataclass(frozen=True)
class StreamUntiedGrads(Instruction):
    """Stage 0, right before the ``index``-th hosted logical worker's last BackwardPass:
    during that pass, keep, reduce and send to the replica holder each layer's gradients
    as soon as autograd has made them final, so the sends overlap the rest of the pass
    (``lower_logical_step``'s ``stream_untied``)."""

    index: int
