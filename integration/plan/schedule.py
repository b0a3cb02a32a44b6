"""Pipeline schedules as data: DeepSpeed's 1F1B train schedule and Bamboo-style redundancy.

A schedule is a grid ``steps[position][step] -> tuple[Action, ...]``: the pipeline position
(a rank within one pipeline) that executes the actions, and the lock-step step in which it
executes them. In the undisturbed placement position ``p`` owns stage ``p`` and holds the
replica of its successor stage ``(p + 1) % S`` (the last stage holds stage 0's, as Bamboo
does).

- :func:`train_schedule` models DeepSpeed's ``TrainSchedule`` (synchronous 1F1B, ``2*(M+S-1)``
  steps, the same instructions in the same order per step) with micro-batch ids.
- :func:`add_redundancy` derives the ``lazy`` and ``eager`` schedules from it: stashes that
  let a replica holder replay a lost stage, the replica's gradient exchange and optimizer
  step, and (``eager``) one redundant forward per (stage, micro-batch) placed in the bubbles.
- :func:`validate`, :func:`format_grid`, :func:`hidden_fraction`, :func:`num_extra_steps`
  inspect a schedule; :func:`lower` turns one position's row into the instruction names and
  keyword arguments the runtime executes (DeepSpeed's names for its own instructions).

Pure code: no torch or DeepSpeed import, so it is testable in milliseconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import Enum, IntEnum
from typing import Literal

RedundancyMode = Literal["off", "lazy", "eager"]
REDUNDANCY_MODES: tuple[RedundancyMode, ...] = ("off", "lazy", "eager")


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
_PER_MICRO_BATCH = frozenset(
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
_COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.REDUNDANT_FORWARD})
# The end-of-batch actions; they sit at the end of the last step of every position.
_TAIL = frozenset(
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
        if self.kind in _PER_MICRO_BATCH:
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


Grid = tuple[tuple[tuple[Action, ...], ...], ...]


@dataclass(frozen=True)
class Schedule:
    """A whole batch: ``steps[position][step]`` is what that position runs in that step.

    Every position has the same number of steps (idle ones are empty), so a step is a
    barrier-safe lock-step across the pipeline, as in DeepSpeed's schedules.
    """

    num_stages: int
    num_micro_batches: int
    mode: RedundancyMode
    steps: Grid

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.num_micro_batches < 1:
            raise ValueError(
                f"a schedule needs >= 1 stage and micro-batch, got {self.num_stages} stages "
                f"and {self.num_micro_batches} micro-batches"
            )
        if self.mode not in REDUNDANCY_MODES:
            raise ValueError(
                f"unknown redundancy mode {self.mode!r}; use one of {REDUNDANCY_MODES}"
            )
        if len(self.steps) != self.num_stages:
            raise ValueError(f"{len(self.steps)} positions for {self.num_stages} stages")
        if len({len(row) for row in self.steps}) != 1:
            raise ValueError("every position must have the same number of steps")

    @property
    def num_positions(self) -> int:
        return len(self.steps)

    @property
    def num_steps(self) -> int:
        return len(self.steps[0])


class ScheduleError(ValueError):
    """A schedule breaks ``rule``; the message shows the grid with the failing cell marked."""

    def __init__(
        self, rule: str, detail: str, schedule: Schedule, mark: tuple[int, int] | None
    ) -> None:
        where = "" if mark is None else f" at rank {mark[0]} step {mark[1]}"
        grid = format_grid(schedule, mark, show_all=True)
        super().__init__(f"schedule rule '{rule}' broken{where}: {detail}\n{grid}")
        self.rule = rule
        self.mark = mark


def num_pipe_buffers(num_stages: int, num_micro_batches: int, stage: int) -> int:
    """DeepSpeed's ``TrainSchedule.num_pipe_buffers`` for ``stage``: its in-flight forwards."""
    return max(2, min(num_stages - stage, num_micro_batches))


def _base_length(num_stages: int, num_micro_batches: int) -> int:
    return 2 * (num_micro_batches + num_stages - 1)


def _slot(num_stages: int, stage: int, step: int) -> tuple[ActionKind, int]:
    """The compute slot of ``stage`` at ``step`` and its micro-batch (maybe out of range).

    In the synchronous 1F1B the forward of micro-batch m runs at step ``2m + stage`` and its
    backward at ``2m + 2S - 1 - stage``: the two alternate, forward when step and stage
    have the same parity.
    """
    if (step - stage) % 2 == 0:
        return ActionKind.FORWARD, (step - stage) // 2
    return ActionKind.BACKWARD, (step - 2 * num_stages + 1 + stage) // 2


def train_schedule(num_stages: int, num_micro_batches: int) -> Schedule:
    """A model of DeepSpeed's ``TrainSchedule(num_micro_batches, num_stages, stage)``.

    Same steps, same instructions in the same order per step (``lower`` of this equals
    DeepSpeed's instructions exactly), with micro-batch ids instead of buffer ids.
    """
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(
            f"need >= 1 stage and micro-batch, got {num_stages} stages and "
            f"{num_micro_batches} micro-batches"
        )
    last = num_stages - 1
    num_steps = _base_length(num_stages, num_micro_batches)
    rows = []
    for stage in range(num_stages):
        row = []
        for step in range(num_steps):
            kind, micro_batch = _slot(num_stages, stage, step)
            # The previous step is the other kind of slot: what a forward step sends back is
            # the gradient of the previous backward, what a backward step sends on is the
            # output of the previous forward (DeepSpeed's prev_micro_batch_id).
            _, prev = _slot(num_stages, stage, step - 1)
            current_ok = 0 <= micro_batch < num_micro_batches
            prev_ok = 0 <= prev < num_micro_batches
            actions: list[Action] = []
            if kind is ActionKind.FORWARD:
                if prev_ok and stage > 0:
                    actions.append(Action(stage, ActionKind.SEND_GRAD, prev))
                if current_ok and stage > 0:
                    actions.append(Action(stage, ActionKind.RECV_ACTIVATION, micro_batch))
            else:
                if current_ok and stage < last:
                    actions.append(Action(stage, ActionKind.RECV_GRAD, micro_batch))
                if prev_ok and stage < last:
                    actions.append(Action(stage, ActionKind.SEND_ACTIVATION, prev))
            if kind is ActionKind.FORWARD and current_ok and stage in (0, last):
                actions.append(Action(stage, ActionKind.LOAD, micro_batch))
            if current_ok:
                actions.append(Action(stage, kind, micro_batch))
            if step == num_steps - 1:
                actions += [
                    Action(stage, ActionKind.REDUCE_TIED_GRADS),
                    Action(stage, ActionKind.REDUCE_GRADS),
                    Action(stage, ActionKind.OPTIMIZER_STEP),
                ]
            row.append(tuple(actions))
        rows.append(tuple(row))
    return Schedule(num_stages, num_micro_batches, "off", tuple(rows))


# --------------------------------------------------------------------------- redundancy


def add_redundancy(
    schedule: Schedule,
    mode: RedundancyMode,
    *,
    replay: bool = True,
    replica_step_in_bubble: bool = True,
) -> Schedule:
    """Derive the schedule for redundancy ``mode`` from a schedule without redundancy.

    - ``off``: ``schedule`` itself.
    - ``lazy``: ``StashOutput`` after each forward (not on the last stage),
      ``StashInputGrad`` after each backward (not on stage 0), ``ReplicaLoad`` of stage 0's
      inputs after the last stage's load, and at the end of the last step the replica's
      gradient exchange (a ring). The replica's optimizer step (``ReplicaStep``) of a batch
      runs in the next batch's first bubble (``replica_step_in_bubble``, the default): a
      non-first position before its first ``RecvActivation`` (it waits there for its
      predecessors' first forwards), the first position before its last ``RecvGrad`` (it
      waits there for its successors' last backwards). The replica must equal its owner
      only at the next commit (a holder reports a received, committed update as "ready",
      and a recovery applies it), so the step need not sit on the critical path. With
      ``replica_step_in_bubble`` False it follows the commit at the end of the batch (the
      failover replay test needs this batch's stashes for it).
    - ``eager``: ``lazy`` plus one ``RedundantForward`` of stage ``(p+1) % S`` per micro-batch
      on each position ``p``, each in the earliest bubble of ``p`` (no forward or backward)
      after its input exists, one per bubble; the last position fetches stage 0's inputs
      early when that lets its redundant forward use an earlier bubble. Redundant forwards
      that fit no bubble go in extra steps at the end (they cost time); every position is
      padded to the same length and the end-of-batch actions move to the new last step. The
      replica's step stays at the end of the batch: the redundant forwards read the replica.

    With one stage there is no other position to hold a replica: ``lazy`` and ``eager`` add
    nothing.

    ``replay`` False (a sharded replica, ``spotline.plan.shards``: the holder has only some
    of the successor's tensors, so it can never replay it): ``lazy`` without the stashes and
    ``ReplicaLoad``, only the replica's gradient exchange and step; ``eager`` is refused.
    """
    if mode not in REDUNDANCY_MODES:
        raise ValueError(f"unknown redundancy mode {mode!r}; use one of {REDUNDANCY_MODES}")
    if not replay and mode == "eager":
        raise ValueError(
            "eager redundancy runs the successor's forward, which a replica without replay "
            "(sharded) cannot: use lazy"
        )
    if schedule.mode != "off":
        raise ValueError(
            f"add_redundancy takes a schedule without redundancy, got {schedule.mode!r}"
        )
    if mode == "off":
        return schedule
    if schedule.num_stages == 1:
        return replace(schedule, mode=mode)
    for position, _, _, action in _locations(schedule):
        if action.kind in _COMPUTE and action.stage != position:
            raise ValueError(
                f"add_redundancy needs the undisturbed placement (position p runs stage p), "
                f"but rank {position} runs {action}"
            )
    body, tails = _split_tails(schedule)
    if replay:
        body = _add_stashes(schedule.num_stages, body)
    if mode == "eager":
        body = _place_redundant_forwards(schedule.num_stages, body)
    num_stages = schedule.num_stages
    in_bubble = mode == "lazy" and replica_step_in_bubble
    if in_bubble:
        body = _place_replica_steps(num_stages, body)
    rows = []
    for position, row in enumerate(body):
        tail = _replica_tail(num_stages, position, tails[position], step=not in_bubble)
        rows.append(tuple(tuple(step) for step in row[:-1]) + (tuple(row[-1] + tail),))
    return Schedule(schedule.num_stages, schedule.num_micro_batches, mode, tuple(rows))


MutableGrid = list[list[list[Action]]]


def _split_tails(schedule: Schedule) -> tuple[MutableGrid, list[list[Action]]]:
    """The grid without its end-of-batch actions, and those actions per position."""
    body: MutableGrid = []
    tails = []
    for row in schedule.steps:
        last = list(row[-1])
        split = len(last)
        while split > 0 and last[split - 1].kind in _TAIL:
            split -= 1
        body.append([list(step) for step in row[:-1]] + [last[:split]])
        tails.append(last[split:])
    assert not any(a.kind in _TAIL for row in body for step in row for a in step)
    return body, tails


def _replica_tail(
    num_stages: int, position: int, tail: list[Action], *, step: bool
) -> list[Action]:
    """The end-of-batch actions with the replica's gradient exchange added, and its update
    after the commit when ``step``.

    The reduced gradients are sent before ``OptimizerStep`` because it zeroes them.
    """
    own = position
    replica = (position + 1) % num_stages
    reduces = [a for a in tail if a.kind is not ActionKind.OPTIMIZER_STEP]
    steps = [a for a in tail if a.kind is ActionKind.OPTIMIZER_STEP]
    return (
        reduces
        + [Action(own, ActionKind.REPLICA_GRAD_SEND), Action(replica, ActionKind.REPLICA_GRAD_RECV)]
        + steps
        + ([Action(replica, ActionKind.REPLICA_STEP)] if step else [])
    )


def _place_replica_steps(num_stages: int, body: MutableGrid) -> MutableGrid:
    """Put each position's ``ReplicaStep`` (of the previous batch) in its first bubble: right
    before the first ``RecvActivation`` on a non-first position, right before the last
    ``RecvGrad`` on the first (see :func:`add_redundancy`)."""
    out: MutableGrid = [[list(step) for step in row] for row in body]
    for position, row in enumerate(out):
        waits_for = ActionKind.RECV_ACTIVATION if position > 0 else ActionKind.RECV_GRAD
        found = [
            (index, order)
            for index, step in enumerate(row)
            for order, action in enumerate(step)
            if action.kind is waits_for
        ]
        assert found, f"rank {position} never waits for a neighbour"
        index, order = found[0] if position > 0 else found[-1]
        row[index].insert(order, Action((position + 1) % num_stages, ActionKind.REPLICA_STEP))
    return out


def _add_stashes(num_stages: int, body: MutableGrid) -> MutableGrid:
    """Insert the lazy mode's stashes right after the compute or load they keep."""
    last = num_stages - 1
    out: MutableGrid = []
    for row in body:
        new_row = []
        for step in row:
            new_step: list[Action] = []
            for action in step:
                new_step.append(action)
                if action.kind is ActionKind.FORWARD and action.stage != last:
                    new_step.append(replace(action, kind=ActionKind.STASH_OUTPUT))
                elif action.kind is ActionKind.BACKWARD and action.stage != 0:
                    new_step.append(replace(action, kind=ActionKind.STASH_INPUT_GRAD))
                elif action.kind is ActionKind.LOAD and action.stage == last:
                    new_step.append(Action(0, ActionKind.REPLICA_LOAD, action.micro_batch))
            new_row.append(new_step)
        out.append(new_row)
    return out


def _find(row: list[list[Action]], action: Action) -> int:
    for index, step in enumerate(row):
        if action in step:
            return index
    raise AssertionError(f"{action} not in row")


def _place_redundant_forwards(num_stages: int, body: MutableGrid) -> MutableGrid:
    """Add the eager mode's redundant forwards (see :func:`add_redundancy`)."""
    num_steps = len(body[0])
    overflow: list[list[Action]] = []
    for position, row in enumerate(body):
        stage = (position + 1) % num_stages
        bubbles = [
            index for index, step in enumerate(row) if not any(a.kind in _COMPUTE for a in step)
        ]
        micro_batches = sorted(
            a.micro_batch
            for step in row
            for a in step
            if a.kind is ActionKind.FORWARD and a.micro_batch is not None
        )
        extra: list[Action] = []
        for mb in micro_batches:
            redundant = Action(stage, ActionKind.REDUNDANT_FORWARD, mb)
            # Stage 0's inputs are data: its holder can fetch them at any step.
            ready = (
                0 if stage == 0 else _find(row, Action(position, ActionKind.STASH_OUTPUT, mb)) + 1
            )
            slot = next((b for b in bubbles if b >= ready), None)
            if slot is None:
                extra.append(redundant)
                continue
            bubbles.remove(slot)
            if stage == 0:
                keep = Action(0, ActionKind.REPLICA_LOAD, mb)
                loaded = _find(row, keep)
                if loaded > slot:
                    row[loaded].remove(keep)
                    row[slot].append(keep)
            row[slot].append(redundant)
        overflow.append(extra)
    num_extra = max(len(extra) for extra in overflow)
    out: MutableGrid = []
    for row, extra in zip(body, overflow, strict=True):
        padding: list[list[Action]] = [[] for _ in range(num_extra - len(extra))]
        out.append(row + [[a] for a in extra] + padding)
    assert all(len(row) == num_steps + num_extra for row in out)
    return out


# --------------------------------------------------------------------------- metrics


def num_extra_steps(schedule: Schedule) -> int:
    """Steps beyond DeepSpeed's ``2*(M+S-1)``: redundant forwards that fit no bubble."""
    return schedule.num_steps - _base_length(schedule.num_stages, schedule.num_micro_batches)


def hidden_fraction(schedule: Schedule, position: int | None = None) -> float:
    """The fraction of redundant forwards placed in bubbles (of ``position``, or overall).

    This bounds how much of the redundant work can be hidden; the rest sits in extra steps.
    Raises ``ValueError`` for a schedule without redundant forwards.
    """
    num_base = _base_length(schedule.num_stages, schedule.num_micro_batches)
    positions = range(schedule.num_positions) if position is None else [position]
    num_hidden = num_total = 0
    for p in positions:
        for index, step in enumerate(schedule.steps[p]):
            for action in step:
                if action.kind is ActionKind.REDUNDANT_FORWARD:
                    num_total += 1
                    num_hidden += index < num_base
    if num_total == 0:
        raise ValueError(
            "hidden_fraction needs redundant forwards: an 'eager' schedule with >= 2 stages"
        )
    return num_hidden / num_total


# --------------------------------------------------------------------------- display


def format_grid(
    schedule: Schedule, mark: tuple[int, int] | None = None, *, show_all: bool = False
) -> str:
    """The schedule as a table: one row per position (``rank p``), one column per step.

    Cells show the compute actions (F, B, RF), or every action with ``show_all``, joined
    by commas; ``.`` is an idle cell. The cell ``mark = (position, step)`` is shown as
    ``>cell<``.
    """
    cells = []
    for position, row in enumerate(schedule.steps):
        texts = []
        for index, step in enumerate(row):
            shown = [str(a) for a in step if show_all or a.kind in _COMPUTE]
            text = ",".join(shown) or "."
            if mark == (position, index):
                text = f">{text}<"
            texts.append(text)
        cells.append(texts)
    widths = [
        max([len(str(index))] + [len(texts[index]) for texts in cells])
        for index in range(schedule.num_steps)
    ]
    labels = [f"rank {p}" for p in range(schedule.num_positions)]
    label_width = max(len("step"), *(len(label) for label in labels))
    header = [str(index).rjust(width) for index, width in enumerate(widths)]
    lines = [" ".join(["step".ljust(label_width)] + header).rstrip()]
    for label, texts in zip(labels, cells, strict=True):
        padded = [text.rjust(width) for text, width in zip(texts, widths, strict=True)]
        lines.append(" ".join([label.ljust(label_width)] + padded).rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------- validation


Location = tuple[int, int, int]  # position, step, order within the step


def _locations(schedule: Schedule) -> Iterator[tuple[int, int, int, Action]]:
    for position, row in enumerate(schedule.steps):
        for index, step in enumerate(row):
            for order, action in enumerate(step):
                yield position, index, order, action


def _before(first: Location, second: Location) -> bool:
    """Whether ``first`` runs before ``second``: an earlier step, or earlier in one step."""
    if first[1] != second[1]:
        return first[1] < second[1]
    return first[0] == second[0] and first[2] < second[2]


# For each send and receive: the kind it pairs with, the peer's position and stage offsets
# (the replica exchange goes around the ring, so its position offset is taken mod S).
_PAIRS = {
    ActionKind.SEND_ACTIVATION: (ActionKind.RECV_ACTIVATION, +1, +1),
    ActionKind.RECV_ACTIVATION: (ActionKind.SEND_ACTIVATION, -1, -1),
    ActionKind.SEND_GRAD: (ActionKind.RECV_GRAD, -1, -1),
    ActionKind.RECV_GRAD: (ActionKind.SEND_GRAD, +1, +1),
    ActionKind.REPLICA_GRAD_SEND: (ActionKind.REPLICA_GRAD_RECV, -1, 0),
    ActionKind.REPLICA_GRAD_RECV: (ActionKind.REPLICA_GRAD_SEND, +1, 0),
}
_RING = frozenset({ActionKind.REPLICA_GRAD_SEND, ActionKind.REPLICA_GRAD_RECV})
_SENDS = frozenset({ActionKind.SEND_ACTIVATION, ActionKind.SEND_GRAD, ActionKind.REPLICA_GRAD_SEND})


def validate(schedule: Schedule) -> None:
    """Check the rules every schedule obeys; raise :class:`ScheduleError` at the first break.

    Rules (named in the error): ``in-range`` (stages and micro-batches exist),
    ``send-has-receive`` and ``receive-has-send`` (same step, neighbouring position:
    activations forward, gradients backward, replica gradients from p to p-1 mod S),
    ``one-forward`` and ``one-backward`` per (stage, micro-batch), ``backward-after-forward``,
    ``stash-after-compute`` (a stashed output is kept after its forward and before its
    backward frees it; a stashed input gradient after its backward),
    ``one-redundant-forward`` (at most one per (stage, micro-batch), exactly one in eager),
    ``redundant-forward-after-input`` (after ``(s-1)SO`` or ``0RL`` on its position),
    ``redundant-forward-before-step`` (before the end-of-batch actions of its position),
    ``reduce-after-backward``, ``optimizer-after-reduce``, ``replica-send-after-reduce``,
    ``one-replica-step`` (per received replica gradient, one ``ReplicaStep`` on its
    position), ``replica-step-after-recv`` (one after the commit follows the exchange),
    ``replica-step-before-exchange`` (one before the commit, which applies the previous
    batch's update, precedes the exchange that overwrites it),
    ``redundant-forward-after-replica-step`` (a redundant forward reads the replica only
    once it is up to date), ``one-compute-per-step`` (a position computes at most one
    of F, B, RF per step: a step is one slot of compute time).
    """
    checker = _Checker(schedule)
    checker.check_range()
    checker.check_pairs()
    checker.check_counts()
    checker.check_order()
    checker.check_eager()
    checker.check_compute_slots()


class _Checker:
    """The rule checks of :func:`validate`, over an index of where each action runs."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.seen: dict[Action, list[Location]] = {}
        for position, index, order, action in _locations(schedule):
            self.seen.setdefault(action, []).append((position, index, order))

    def fail(self, rule: str, detail: str, where: Location | None) -> ScheduleError:
        mark = None if where is None else (where[0], where[1])
        return ScheduleError(rule, detail, self.schedule, mark)

    def first(self, action: Action) -> Location | None:
        found = self.seen.get(action)
        return None if found is None else found[0]

    def on_position(self, action: Action, position: int) -> Location | None:
        return next((w for w in self.seen.get(action, []) if w[0] == position), None)

    def check_range(self) -> None:
        schedule = self.schedule
        for position, index, order, action in _locations(schedule):
            mb = action.micro_batch
            if action.stage >= schedule.num_stages or (
                mb is not None and mb >= schedule.num_micro_batches
            ):
                detail = f"{action} names no stage or micro-batch"
                raise self.fail("in-range", detail, (position, index, order))

    def check_pairs(self) -> None:
        schedule = self.schedule
        for position, index, order, action in _locations(schedule):
            if action.kind not in _PAIRS:
                continue
            kind, position_offset, stage_offset = _PAIRS[action.kind]
            peer_position = position + position_offset
            if action.kind in _RING:
                peer_position %= schedule.num_positions
            peer_stage = action.stage + stage_offset
            peer = f"{peer_stage}{kind.value}{'' if action.micro_batch is None else action.micro_batch}"
            if (
                not 0 <= peer_position < schedule.num_positions
                or not 0 <= peer_stage < schedule.num_stages
                or Action(peer_stage, kind, action.micro_batch)
                not in schedule.steps[peer_position][index]
            ):
                rule = "send-has-receive" if action.kind in _SENDS else "receive-has-send"
                detail = f"{action} has no {peer} on rank {peer_position} in its step"
                raise self.fail(rule, detail, (position, index, order))

    def check_counts(self) -> None:
        for stage in range(self.schedule.num_stages):
            for mb in range(self.schedule.num_micro_batches):
                forward = Action(stage, ActionKind.FORWARD, mb)
                backward = Action(stage, ActionKind.BACKWARD, mb)
                for action, rule in ((forward, "one-forward"), (backward, "one-backward")):
                    found = self.seen.get(action, [])
                    if len(found) != 1:
                        detail = f"{len(found)} x {action}, expected one"
                        raise self.fail(rule, detail, found[1] if found else None)
                if not _before(self.seen[forward][0], self.seen[backward][0]):
                    detail = f"{backward} runs before its forward"
                    raise self.fail("backward-after-forward", detail, self.seen[backward][0])

    def check_order(self) -> None:
        for position, index, order, action in _locations(self.schedule):
            where = (position, index, order)
            if action.kind is ActionKind.STASH_OUTPUT:
                self.check_stash_output(action, where)
            elif action.kind is ActionKind.STASH_INPUT_GRAD:
                made = self.on_position(replace(action, kind=ActionKind.BACKWARD), position)
                if made is None or not _before(made, where):
                    raise self.fail("stash-after-compute", f"{action} before its backward", where)
            elif action.kind is ActionKind.REDUNDANT_FORWARD:
                self.check_redundant_forward(action, where)
            elif action.kind is ActionKind.OPTIMIZER_STEP:
                self.check_after(action, ActionKind.REDUCE_GRADS, "optimizer-after-reduce", where)
            elif action.kind is ActionKind.REPLICA_GRAD_RECV:
                if (
                    self.on_position(replace(action, kind=ActionKind.REPLICA_STEP), position)
                    is None
                ):
                    detail = f"{action} without a {action.stage}RO to apply it"
                    raise self.fail("one-replica-step", detail, where)
            elif action.kind is ActionKind.REPLICA_GRAD_SEND:
                rule = "replica-send-after-reduce"
                self.check_after(action, ActionKind.REDUCE_GRADS, rule, where)
            elif action.kind is ActionKind.REPLICA_STEP:
                self.check_replica_step(action, where)
            elif action.kind is ActionKind.REDUCE_GRADS:
                for mb in range(self.schedule.num_micro_batches):
                    backward = Action(action.stage, ActionKind.BACKWARD, mb)
                    ran = self.first(backward)
                    if ran is not None and not _before(ran, where):
                        raise self.fail(
                            "reduce-after-backward", f"{action} before {backward}", where
                        )

    def check_after(self, action: Action, kind: ActionKind, rule: str, where: Location) -> None:
        earlier = Action(action.stage, kind)
        made = self.on_position(earlier, where[0])
        if made is None or not _before(made, where):
            raise self.fail(rule, f"{action} without an earlier {earlier}", where)

    def check_replica_step(self, action: Action, where: Location) -> None:
        """After its position's commit it applies this batch's update (so it follows the
        exchange); before it, the previous batch's, which this batch's exchange overwrites
        and which the replica's redundant forwards must already see."""
        position = where[0]
        if self.on_position(action, position) != where:
            raise self.fail("one-replica-step", f"{action} runs twice on rank {position}", where)
        received = self.on_position(Action(action.stage, ActionKind.REPLICA_GRAD_RECV), position)
        committed = self.kind_on_position(ActionKind.OPTIMIZER_STEP, position)
        if committed is not None and _before(committed, where):
            if received is None or not _before(received, where):
                detail = f"{action} after the commit without an earlier {action.stage}RR"
                raise self.fail("replica-step-after-recv", detail, where)
            return
        if received is not None and _before(received, where):
            detail = (
                f"{action} before the commit applies the previous batch's update, which "
                f"{action.stage}RR has already overwritten"
            )
            raise self.fail("replica-step-before-exchange", detail, where)
        row = self.schedule.steps[position]
        for index, step in enumerate(row):
            for order, other in enumerate(step):
                if other.kind is ActionKind.REDUNDANT_FORWARD and _before(
                    (position, index, order), where
                ):
                    detail = f"{other} reads the replica before {action} brings it up to date"
                    raise self.fail(
                        "redundant-forward-after-replica-step", detail, (position, index, order)
                    )

    def kind_on_position(self, kind: ActionKind, position: int) -> Location | None:
        """Where ``position`` first runs an action of ``kind``."""
        for index, step in enumerate(self.schedule.steps[position]):
            for order, action in enumerate(step):
                if action.kind is kind:
                    return position, index, order
        return None

    def check_stash_output(self, action: Action, where: Location) -> None:
        made = self.on_position(replace(action, kind=ActionKind.FORWARD), where[0])
        frees = self.first(replace(action, kind=ActionKind.BACKWARD))
        if made is None or not _before(made, where):
            raise self.fail("stash-after-compute", f"{action} before its forward", where)
        if frees is not None and not _before(where, frees):
            raise self.fail("stash-after-compute", f"{action} after its backward freed it", where)

    def check_redundant_forward(self, action: Action, where: Location) -> None:
        position, index, order = where
        if self.seen[action][0] != where:
            raise self.fail("one-redundant-forward", f"{action} runs twice", where)
        if action.stage == 0:
            source = Action(0, ActionKind.REPLICA_LOAD, action.micro_batch)
        else:
            source = Action(action.stage - 1, ActionKind.STASH_OUTPUT, action.micro_batch)
        made = self.on_position(source, position)
        if made is None or not _before(made, where):
            detail = f"{action} runs before its input {source} exists on rank {position}"
            raise self.fail("redundant-forward-after-input", detail, where)
        row = self.schedule.steps[position]
        done = [a for step in row[:index] for a in step] + list(row[index][:order])
        ended = next((a for a in done if a.kind in _TAIL), None)
        if ended is not None:
            detail = f"{action} after the end-of-batch action {ended}"
            raise self.fail("redundant-forward-before-step", detail, where)

    def check_eager(self) -> None:
        schedule = self.schedule
        if schedule.mode != "eager" or schedule.num_stages == 1:
            return
        for stage in range(schedule.num_stages):
            for mb in range(schedule.num_micro_batches):
                redundant = Action(stage, ActionKind.REDUNDANT_FORWARD, mb)
                if redundant not in self.seen:
                    detail = f"eager schedule without {redundant}"
                    raise self.fail("one-redundant-forward", detail, None)

    def check_compute_slots(self) -> None:
        for position, row in enumerate(self.schedule.steps):
            for index, step in enumerate(row):
                compute = [str(a) for a in step if a.kind in _COMPUTE]
                if len(compute) > 1:
                    detail = f"rank {position} computes {', '.join(compute)} in one step"
                    raise self.fail("one-compute-per-step", detail, (position, index, 0))


# --------------------------------------------------------------------------- lowering

_INSTRUCTION_NAMES = {
    ActionKind.LOAD: "LoadMicroBatch",
    ActionKind.FORWARD: "ForwardPass",
    ActionKind.BACKWARD: "BackwardPass",
    ActionKind.SEND_ACTIVATION: "SendActivation",
    ActionKind.RECV_ACTIVATION: "RecvActivation",
    ActionKind.SEND_GRAD: "SendGrad",
    ActionKind.RECV_GRAD: "RecvGrad",
    ActionKind.REDUCE_TIED_GRADS: "ReduceTiedGrads",
    ActionKind.REDUCE_GRADS: "ReduceGrads",
    ActionKind.OPTIMIZER_STEP: "OptimizerStep",
    ActionKind.STASH_OUTPUT: "StashOutput",
    ActionKind.STASH_INPUT_GRAD: "StashInputGrad",
    ActionKind.REPLICA_LOAD: "ReplicaLoad",
    ActionKind.REDUNDANT_FORWARD: "RedundantForward",
    ActionKind.REPLICA_GRAD_SEND: "ReplicaGradSend",
    ActionKind.REPLICA_GRAD_RECV: "ReplicaGradRecv",
    ActionKind.REPLICA_STEP: "ReplicaStep",
}
assert set(_INSTRUCTION_NAMES) == set(ActionKind)
# Kinds that work on the executing stage's DeepSpeed pipe buffers: kwargs {"buffer_id"}.
_BUFFER_KINDS = frozenset(
    {
        ActionKind.LOAD,
        ActionKind.FORWARD,
        ActionKind.BACKWARD,
        ActionKind.SEND_ACTIVATION,
        ActionKind.RECV_ACTIVATION,
        ActionKind.SEND_GRAD,
        ActionKind.RECV_GRAD,
    }
)


def lower(schedule: Schedule, position: int) -> list[list[tuple[str, dict[str, int]]]]:
    """Per step, the instruction names and kwargs that ``position`` executes.

    DeepSpeed's names and ``buffer_id = micro_batch % num_pipe_buffers(stage)`` for its own
    instructions (so ``lower(train_schedule(S, M), s)`` equals ``TrainSchedule(M, S, s)``);
    Spotline's for the others: ``StashOutput`` and ``StashInputGrad`` take ``buffer_id``
    (the pipe buffer they read) and ``micro_batch_id`` (the stash key), ``ReplicaLoad`` and
    ``RedundantForward`` take ``micro_batch_id``, the replica's tail instructions none.
    """
    if not 0 <= position < schedule.num_positions:
        raise ValueError(f"position {position} not in 0..{schedule.num_positions - 1}")
    out = []
    for step in schedule.steps[position]:
        lowered = []
        for action in step:
            kwargs: dict[str, int] = {}
            mb = action.micro_batch
            if mb is not None and (
                action.kind in _BUFFER_KINDS
                or action.kind in (ActionKind.STASH_OUTPUT, ActionKind.STASH_INPUT_GRAD)
            ):
                buffers = num_pipe_buffers(
                    schedule.num_stages, schedule.num_micro_batches, action.stage
                )
                kwargs["buffer_id"] = mb % buffers
            if mb is not None and action.kind not in _BUFFER_KINDS:
                kwargs["micro_batch_id"] = mb
            lowered.append((_INSTRUCTION_NAMES[action.kind], kwargs))
        out.append(lowered)
    return out


# --------------------------------------------------------------------------- logical workers

BEGIN_LOGICAL_WORKER = "BeginLogicalWorker"
KEEP_LOGICAL_GRADIENTS = "KeepLogicalGradients"
REPLICA_GRAD_POST = "ReplicaGradPost"
STREAM_UNTIED_GRADS = "StreamUntiedGrads"
_TAIL_NAMES = frozenset(_INSTRUCTION_NAMES[kind] for kind in _TAIL)


class GradPart(IntEnum):
    """Which of a stage's gradients an end-of-step instruction covers (its ``part``
    kwarg): all of them, or the ``UNTIED`` ones, final before the tied reduction, and the
    ``TIED`` ones, the rest. Where a stage's tied copies come after all its other
    parameters (``send_untied_early``), those split it; on stage 0, whose tied copies come
    first (``stream_untied``), the layers after the last one holding a tied copy are the
    untied ones."""

    ALL = 0
    UNTIED = 1
    TIED = 2


def lower_logical_step(
    schedule: Schedule,
    position: int,
    num_hosted: int,
    *,
    send_untied_early: bool = False,
    stream_untied: bool = False,
) -> list[list[tuple[str, dict[str, int]]]]:
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
    lowered = lower(schedule, position)
    *head, last = lowered
    split = len(last)
    while split > 0 and last[split - 1][0] in _TAIL_NAMES:
        split -= 1
    body = [*head, last[:split]]
    tail = last[split:]
    reduce_tied = _INSTRUCTION_NAMES[ActionKind.REDUCE_TIED_GRADS]
    assert tail and tail[0][0] == reduce_tied, f"unexpected end of batch {tail}"
    replica_step = _INSTRUCTION_NAMES[ActionKind.REPLICA_STEP]
    send = _INSTRUCTION_NAMES[ActionKind.REPLICA_GRAD_SEND]
    reduce = _INSTRUCTION_NAMES[ActionKind.REDUCE_GRADS]
    exchanges = any(name == _INSTRUCTION_NAMES[ActionKind.REPLICA_GRAD_RECV] for name, _ in tail)
    out: list[list[tuple[str, dict[str, int]]]] = []
    for index in range(num_hosted):
        # A ReplicaStep in the body applies the previous optimizer step's update: once, in
        # the first hosted logical worker's bubble.
        steps = [[x for x in step if index == 0 or x[0] != replica_step] for step in body]
        steps[0].insert(0, (BEGIN_LOGICAL_WORKER, {"index": index}))
        if index == 0 and exchanges:
            _insert_post(steps, replica_step)
        early = send_untied_early and exchanges and index == num_hosted - 1
        streamed = stream_untied and exchanges and index == num_hosted - 1
        if streamed:
            _insert_before_last_backward(steps, (STREAM_UNTIED_GRADS, {"index": index}))
            steps[-1] += [
                (reduce_tied, {}),
                (KEEP_LOGICAL_GRADIENTS, {"index": index, "part": GradPart.TIED.value}),
            ]
        elif early:
            untied = {"part": GradPart.UNTIED.value}
            steps[-1] += [
                (KEEP_LOGICAL_GRADIENTS, {"index": index, **untied}),
                (reduce, dict(untied)),
                (send, dict(untied)),
                (reduce_tied, {}),
                (KEEP_LOGICAL_GRADIENTS, {"index": index, "part": GradPart.TIED.value}),
            ]
        else:
            steps[-1] += [(reduce_tied, {}), (KEEP_LOGICAL_GRADIENTS, {"index": index})]
        out += steps
    rest = tail[1:]
    if (send_untied_early or stream_untied) and exchanges:
        tied = {"part": GradPart.TIED.value}
        rest = [(name, dict(tied)) if name in (reduce, send) else (name, kw) for name, kw in rest]
    out[-1] += rest
    return out


def _insert_before_last_backward(
    steps: list[list[tuple[str, dict[str, int]]]], instruction: tuple[str, dict[str, int]]
) -> None:
    """Put ``instruction`` right before the last ``BackwardPass`` of ``steps``."""
    backward = _INSTRUCTION_NAMES[ActionKind.BACKWARD]
    for step in reversed(steps):
        for order in range(len(step) - 1, -1, -1):
            if step[order][0] == backward:
                step.insert(order, instruction)
                return
    raise AssertionError("a training step without a backward pass")


def _insert_post(steps: list[list[tuple[str, dict[str, int]]]], replica_step: str) -> None:
    """Put ``ReplicaGradPost`` right after the body's ``ReplicaStep``, else first after
    ``BeginLogicalWorker``: the receive needs the replica's buffer, which the gradients of
    the update still to apply use until that step drops them."""
    for step in steps:
        for order, (name, _) in enumerate(step):
            if name == replica_step:
                step.insert(order + 1, (REPLICA_GRAD_POST, {}))
                return
    steps[0].insert(1, (REPLICA_GRAD_POST, {}))
