"""The actions a pipeline schedule is made of: what runs, on which stage, for which
micro-batch (``spotline.plan.schedule`` arranges them in a grid).

An action prints as ``<stage><code><micro-batch>`` (``1F0``, ``2RF0``, ``0RT``):
:func:`parse_action` reads that form back. Pure: no torch or DeepSpeed import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class ActionKind(Enum):
    """What an action does; the value is its short code in the text form ``<stage><code><mb>``.

    ``stage`` of an action is the stage whose layers or data it concerns, which for the
    replica actions is not the stage the executing position owns: ``2RF0`` is run by the
    holder of stage 2's replica (position 1 when undisturbed).
    """

    LOAD = "L"
    """DeepSpeed ``LoadMicroBatch`` on the first and last stage."""
    FORWARD = "F"
    """DeepSpeed ``ForwardPass`` of the stage's own layers."""
    BACKWARD = "B"
    """DeepSpeed ``BackwardPass`` of the stage's own layers."""
    SEND_ACTIVATION = "SA"
    """DeepSpeed ``SendActivation``: stage s sends its output; pairs with ``(s+1)RA`` in the
    same step on the next position."""
    RECV_ACTIVATION = "RA"
    """DeepSpeed ``RecvActivation``: stage s receives its input; pairs with ``(s-1)SA``."""
    SEND_GRAD = "SG"
    """DeepSpeed ``SendGrad``: stage s sends its input gradient; pairs with ``(s-1)RG`` in the
    same step on the previous position."""
    RECV_GRAD = "RG"
    """DeepSpeed ``RecvGrad``: stage s receives its output gradient; pairs with ``(s+1)SG``."""
    REDUCE_TIED_GRADS = "RT"
    """DeepSpeed ``ReduceTiedGrads`` (before the data-parallel reduction)."""
    REDUCE_GRADS = "RD"
    """DeepSpeed ``ReduceGrads``: the data-parallel gradient reduction of the stage."""
    OPTIMIZER_STEP = "O"
    """DeepSpeed ``OptimizerStep``: steps the stage's optimizer and zeroes its gradients."""
    STASH_OUTPUT = "SO"
    """``StashOutput``: stage s keeps its forward output of micro-batch m (the input of stage
    s+1) until the step is committed, so that s can replay stage s+1 from its replica. Comes
    right after the stage's ``ForwardPass`` of m, before the ``BackwardPass`` frees the
    output; read by the ``RedundantForward`` of stage s+1 (eager) or a failover replay."""
    STASH_INPUT_GRAD = "SI"
    """``StashInputGrad``: stage s keeps the gradient of its input for micro-batch m (the
    output gradient of stage s-1) until the step is committed, needed when stage s-1 is
    replayed by s-2. Comes right after the stage's ``BackwardPass`` of m."""
    REPLICA_LOAD = "RL"
    """``ReplicaLoad`` (stage 0 only): the holder of stage 0's replica (the last position)
    keeps stage 0's inputs of micro-batch m, which DeepSpeed's last-stage load drops. Right
    after the last stage's ``LoadMicroBatch`` of m it keeps that batch's inputs; earlier
    (eager, in a bubble before that load) it fetches them by micro-batch id from the global
    sampler. Read by ``0RF`` and by a failover replay of stage 0."""
    REDUNDANT_FORWARD = "RF"
    """``RedundantForward``: the holder of stage s's replica runs stage s's forward of
    micro-batch m on the replica layers (no grad), from ``(s-1)SO`` (or ``0RL`` for stage 0),
    and keeps the output for a failover that needs stage s's backward. Must come before the
    replica is stepped."""
    REPLICA_GRAD_SEND = "SR"
    """``ReplicaGradSend``: stage s sends its reduced gradients to the holder of its replica
    (position s-1 mod S). After ``ReduceGrads``, before ``OptimizerStep`` zeroes them; pairs
    with ``sRR`` in the same step. Every position sends and receives in that step (a ring):
    the runtime must launch the pair as one batch (``batch_isend_irecv``) to avoid deadlock."""
    REPLICA_GRAD_RECV = "RR"
    """``ReplicaGradRecv``: the holder of stage s's replica receives stage s's reduced
    gradients; pairs with ``sSR`` on position s."""
    REPLICA_STEP = "RO"
    """``ReplicaStep``: the holder applies to stage s's replica the same optimizer update the
    owner applied at its last commit, from the gradients of ``sRR``, so the replica stays
    bitwise equal. Either at the end of the batch, after the commit (the update of this
    batch), or in the next batch's body, in a bubble before its exchange (the update of the
    previous batch: off the critical path; see :func:`add_redundancy`)."""


# Kinds whose actions name one micro-batch; the others act on the whole step.
# Kinds whose actions name one micro-batch; the others act on the whole step.
PER_MICRO_BATCH_KINDS = frozenset(
    {
        ActionKind.LOAD,
        ActionKind.FORWARD,
        ActionKind.BACKWARD,
        ActionKind.SEND_ACTIVATION,
        ActionKind.RECV_ACTIVATION,
        ActionKind.SEND_GRAD,
        ActionKind.RECV_GRAD,
        ActionKind.STASH_OUTPUT,
        ActionKind.STASH_INPUT_GRAD,
        ActionKind.REPLICA_LOAD,
        ActionKind.REDUNDANT_FORWARD,
    }
)
# The compute kinds: a position runs at most one of them per step (one slot of compute).
COMPUTE_KINDS = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.REDUNDANT_FORWARD})
# The end-of-batch actions; they sit at the end of the last step of every position.
TAIL_KINDS = frozenset(
    {
        ActionKind.REDUCE_TIED_GRADS,
        ActionKind.REDUCE_GRADS,
        ActionKind.REPLICA_GRAD_SEND,
        ActionKind.REPLICA_GRAD_RECV,
        ActionKind.OPTIMIZER_STEP,
        ActionKind.REPLICA_STEP,
    }
)
_BY_CODE = {kind.value: kind for kind in ActionKind}
_ACTION_RE = re.compile(r"(\d+)([A-Z]+)(\d*)")


@dataclass(frozen=True)
class Action:
    """One instruction of a schedule: ``kind`` on ``stage``'s layers or data.

    ``micro_batch`` is set exactly for the per-micro-batch kinds. The peer of a send or
    receive is implied by its kind (activations go to ``stage + 1``, gradients to
    ``stage - 1``, replica gradients to the replica holder ``stage - 1 mod S``). Printed as
    ``<stage><code><micro_batch>`` (``1F0``, ``2RF0``, ``0SA1``, ``0RT``); :func:`parse_action`
    inverts ``str``.
    """

    stage: int
    kind: ActionKind
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ValueError(f"action stage must be >= 0, got {self.stage}")
        if self.kind in PER_MICRO_BATCH_KINDS:
            if self.micro_batch is None or self.micro_batch < 0:
                raise ValueError(
                    f"action {self.kind.name} needs a micro-batch >= 0, got {self.micro_batch}"
                )
        elif self.micro_batch is not None:
            raise ValueError(f"action {self.kind.name} takes no micro-batch")

    def __str__(self) -> str:
        suffix = "" if self.micro_batch is None else str(self.micro_batch)
        return f"{self.stage}{self.kind.value}{suffix}"


def parse_action(text: str) -> Action:
    """The action whose ``str`` is ``text`` (``"2RF0"`` -> redundant forward, stage 2, mb 0)."""
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None or match.group(2) not in _BY_CODE:
        codes = ", ".join(sorted(_BY_CODE))
        raise ValueError(f"bad action {text!r}: expected <stage><code><micro-batch>, codes {codes}")
    micro_batch = int(match.group(3)) if match.group(3) else None
    return Action(int(match.group(1)), _BY_CODE[match.group(2)], micro_batch)
