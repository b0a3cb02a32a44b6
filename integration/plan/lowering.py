"""Lowering: one position's row of a schedule (``spotline.plan.schedule``) as the typed
instructions (``spotline.plan.pipe_instructions``) the runtime executes, step by step.

:func:`lower` gives the schedule's own instructions (``lower(train_schedule(S, M), s)``
equals DeepSpeed's ``TrainSchedule(M, S, s)``); :func:`lower_logical_step` one optimizer
step of a pipeline that hosts several logical workers.

Pure: no torch or DeepSpeed import.
"""

from __future__ import annotations

from dataclasses import replace

from spotline.plan.actions import TAIL_KINDS, Action, ActionKind
from spotline.plan.pipe_instructions import (
    BackwardPass,
    BeginLogicalWorker,
    ForwardPass,
    GradPart,
    Instruction,
    KeepLogicalGradients,
    LoadMicroBatch,
    OnMicroBatch,
    OnPipeBuffer,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    RedundantForward,
    ReplicaGradPost,
    ReplicaGradRecv,
    ReplicaGradSend,
    ReplicaLoad,
    ReplicaStep,
    SendActivation,
    SendGrad,
    StashInputGrad,
    StashOutput,
    StreamUntiedGrads,
)
from spotline.plan.schedule import Schedule, num_pipe_buffers

Lowered = list[list[Instruction]]
"""Per step, the instructions one position executes, in order."""

# Kinds on the executing stage's DeepSpeed pipe buffers: (buffer_id).
_ON_BUFFER: dict[ActionKind, type[OnPipeBuffer]] = {
    ActionKind.LOAD: LoadMicroBatch,
    ActionKind.FORWARD: ForwardPass,
    ActionKind.BACKWARD: BackwardPass,
    ActionKind.SEND_ACTIVATION: SendActivation,
    ActionKind.RECV_ACTIVATION: RecvActivation,
    ActionKind.SEND_GRAD: SendGrad,
    ActionKind.RECV_GRAD: RecvGrad,
}
# Kinds that keep a pipe buffer's tensor by micro-batch: (buffer_id, micro_batch_id).
_STASH: dict[ActionKind, type[StashOutput | StashInputGrad]] = {
    ActionKind.STASH_OUTPUT: StashOutput,
    ActionKind.STASH_INPUT_GRAD: StashInputGrad,
}
# Kinds on a micro-batch outside the pipe buffers: (micro_batch_id).
_ON_MICRO_BATCH: dict[ActionKind, type[OnMicroBatch]] = {
    ActionKind.REPLICA_LOAD: ReplicaLoad,
    ActionKind.REDUNDANT_FORWARD: RedundantForward,
}
# Kinds on the whole step: no fields (``part`` left at ALL).
_WHOLE_STEP: dict[ActionKind, type[Instruction]] = {
    ActionKind.REDUCE_TIED_GRADS: ReduceTiedGrads,
    ActionKind.REDUCE_GRADS: ReduceGrads,
    ActionKind.OPTIMIZER_STEP: OptimizerStep,
    ActionKind.REPLICA_GRAD_SEND: ReplicaGradSend,
    ActionKind.REPLICA_GRAD_RECV: ReplicaGradRecv,
    ActionKind.REPLICA_STEP: ReplicaStep,
}
assert {*_ON_BUFFER, *_STASH, *_ON_MICRO_BATCH, *_WHOLE_STEP} == set(ActionKind)
# The instructions of the end-of-batch actions.
_TAIL_TYPES = tuple(_WHOLE_STEP[kind] for kind in TAIL_KINDS)


def _instruction(schedule: Schedule, action: Action) -> Instruction:
    """``action`` as an instruction: pipe buffer ``micro_batch % num_pipe_buffers(stage)``
    as DeepSpeed numbers them, the micro-batch id where a stash is keyed by it."""
    kind, mb = action.kind, action.micro_batch
    if kind in _WHOLE_STEP:
        return _WHOLE_STEP[kind]()
    assert mb is not None, f"{action} names no micro-batch"
    if kind in _ON_MICRO_BATCH:
        return _ON_MICRO_BATCH[kind](mb)
    buffer_id = mb % num_pipe_buffers(schedule.num_stages, schedule.num_micro_batches, action.stage)
    if kind in _STASH:
        return _STASH[kind](buffer_id, mb)
    return _ON_BUFFER[kind](buffer_id)


def lower(schedule: Schedule, position: int) -> Lowered:
    """Per step, the instructions ``position`` executes.

    DeepSpeed's instructions with ``buffer_id = micro_batch % num_pipe_buffers(stage)`` (so
    ``lower(train_schedule(S, M), s)`` equals ``TrainSchedule(M, S, s)`` by name and
    keyword arguments); ``StashOutput`` and ``StashInputGrad`` take ``buffer_id`` (the pipe
    buffer they read) and ``micro_batch_id`` (the stash key), ``ReplicaLoad`` and
    ``RedundantForward`` take ``micro_batch_id``, the replica's tail instructions nothing.
    """
    if not 0 <= position < schedule.num_positions:
        raise ValueError(f"position {position} not in 0..{schedule.num_positions - 1}")
    return [[_instruction(schedule, a) for a in step] for step in schedule.steps[position]]


def lower_logical_step(
    schedule: Schedule,
    position: int,
    num_hosted: int,
    *,
    send_untied_early: bool = False,
    stream_untied: bool = False,
) -> Lowered:
    """One optimizer step of a pipeline that hosts ``num_hosted`` logical workers (EasyScale).

    The pipeline runs its logical workers one after another: for the ``i``-th hosted one,
    ``BeginLogicalWorker(index=i)`` (its randomness and data from here on), the schedule's
    body (every step up to the end-of-batch actions, as :func:`lower` gives it), then
    ``ReduceTiedGrads`` (the tied copies of this logical worker's own gradients) and
    ``KeepLogicalGradients(index=i)`` (its gradients are moved aside and zeroed, so the next
    logical worker's never add into them). The step ends with the schedule's other
    end-of-batch actions once: ``ReduceGrads`` (the exact reduction over every logical
    worker of the job), the replica's exchange and the optimizer steps. A ``ReplicaStep`` in
    the body (the previous step's update, in a bubble) runs in the first copy only.

    A schedule with a replica exchange also gets ``ReplicaGradPost`` once, in the first
    copy: the receive of the successor's gradients, posted as soon as the replica's buffer
    is free (right after the ``ReplicaStep`` in the body, else at the step's start), so they
    arrive whenever the successor sends them and ``ReplicaGradRecv`` only waits.

    ``send_untied_early`` (a position whose tied copies are its last parameters): the last
    logical worker keeps, reduces and sends its other gradients (``part`` UNTIED) before its
    ``ReduceTiedGrads``, which waits for the tied partner's backward passes, and the tied
    ones (``part`` TIED) after it. A no-op without a replica exchange.

    ``stream_untied`` (stage 0, whose tied copies come before its other parameters): its
    last backward pass is the step's last computation, and its untied gradients become
    final layer by layer during it, last layer first. ``StreamUntiedGrads(index=i)`` right
    before the last logical worker's last ``BackwardPass`` has that pass keep, reduce and
    send each layer's gradients as soon as they are final (``part`` UNTIED, one message a
    layer), so the sends overlap the rest of the pass; the tied ones (``part`` TIED) follow
    its ``ReduceTiedGrads`` as with ``send_untied_early``. A no-op without a replica
    exchange.

    With one hosted logical worker this is :func:`lower` plus the bookkeeping instructions.
    Pure: the runtime executes the list in order, step after step.
    """
    if num_hosted < 1:
        raise ValueError(f"a pipeline must host at least one logical worker, got {num_hosted}")
    if send_untied_early and stream_untied:
        raise ValueError("a stage's tied copies are either its last or its first parameters")
    *head, last = lower(schedule, position)
    split = len(last)
    while split > 0 and isinstance(last[split - 1], _TAIL_TYPES):
        split -= 1
    body = [*head, last[:split]]
    tail = last[split:]
    assert tail and isinstance(tail[0], ReduceTiedGrads), f"unexpected end of batch {tail}"
    exchanges = any(isinstance(x, ReplicaGradRecv) for x in tail)
    untied, tied = GradPart.UNTIED, GradPart.TIED
    out: Lowered = []
    for index in range(num_hosted):
        # A ReplicaStep in the body applies the previous optimizer step's update: once, in
        # the first hosted logical worker's bubble.
        steps = [[x for x in step if index == 0 or not isinstance(x, ReplicaStep)] for step in body]
        steps[0].insert(0, BeginLogicalWorker(index))
        if index == 0 and exchanges:
            _insert_post(steps)
        early = send_untied_early and exchanges and index == num_hosted - 1
        streamed = stream_untied and exchanges and index == num_hosted - 1
        if streamed:
            _insert_before_last_backward(steps, StreamUntiedGrads(index))
            steps[-1] += [ReduceTiedGrads(), KeepLogicalGradients(index, tied)]
        elif early:
            steps[-1] += [
                KeepLogicalGradients(index, untied),
                ReduceGrads(untied),
                ReplicaGradSend(untied),
                ReduceTiedGrads(),
                KeepLogicalGradients(index, tied),
            ]
        else:
            steps[-1] += [ReduceTiedGrads(), KeepLogicalGradients(index)]
        out += steps
    rest = tail[1:]
    if (send_untied_early or stream_untied) and exchanges:
        rest = [
            replace(x, part=tied) if isinstance(x, ReduceGrads | ReplicaGradSend) else x
            for x in rest
        ]
    out[-1] += rest
    return out


def _insert_before_last_backward(steps: Lowered, instruction: Instruction) -> None:
    """Put ``instruction`` right before the last ``BackwardPass`` of ``steps``."""
    for step in reversed(steps):
        for order in range(len(step) - 1, -1, -1):
            if isinstance(step[order], BackwardPass):
                step.insert(order, instruction)
                return
    raise AssertionError("a training step without a backward pass")


def _insert_post(steps: Lowered) -> None:
    """Put ``ReplicaGradPost`` right after the body's ``ReplicaStep``, else first after
    ``BeginLogicalWorker``: the receive needs the replica's buffer, which the gradients of
    the update still to apply use until that step drops them."""
    for step in steps:
        for order, instruction in enumerate(step):
            if isinstance(instruction, ReplicaStep):
                step.insert(order + 1, ReplicaGradPost())
                return
    steps[0].insert(1, ReplicaGradPost())
