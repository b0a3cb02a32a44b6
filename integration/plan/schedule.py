"""Pipeline schedules as data: DeepSpeed's 1F1B train schedule and Bamboo-style redundancy.

A schedule is a grid ``steps[position][step] -> tuple[Action, ...]`` (``spotline.plan.actions``):
the pipeline position (a rank within one pipeline) that executes the actions, and the
lock-step step in which it executes them. In the undisturbed placement position ``p`` owns
stage ``p`` and holds the replica of its successor stage ``(p + 1) % S`` (the last stage
holds stage 0's, as Bamboo does).

- :func:`train_schedule` models DeepSpeed's ``TrainSchedule`` (synchronous 1F1B, ``2*(M+S-1)``
  steps, the same instructions in the same order per step) with micro-batch ids.
- :func:`add_redundancy` derives the ``lazy`` and ``eager`` schedules from it: stashes that
  let a replica holder replay a lost stage, the replica's gradient exchange and optimizer
  step, and (``eager``) one redundant forward per (stage, micro-batch) placed in the bubbles.
- :func:`format_grid`, :func:`hidden_fraction`, :func:`num_extra_steps` inspect a schedule;
  ``spotline.plan.schedule_rules.validate`` checks it, ``spotline.plan.lowering`` turns one
  position's row into the typed instructions the runtime executes.

Pure code: no torch or DeepSpeed import, so it is testable in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from spotline.plan.actions import COMPUTE_KINDS, TAIL_KINDS, Action, ActionKind
from spotline.plan.redundancy_mode import REDUNDANCY_MODES, RedundancyMode, redundancy_on

Grid = tuple[tuple[tuple[Action, ...], ...], ...]
Location = tuple[int, int, int]  # position, step, order within the step


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

    @property
    def redundant(self) -> bool:
        """Whether the schedule keeps replicas (its mode is not ``off``)."""
        return redundancy_on(self.mode)

    def locations(self) -> Iterator[tuple[Location, Action]]:
        """Every action with where it runs, position by position, step by step, in order."""
        for position, row in enumerate(self.steps):
            for index, step in enumerate(row):
                for order, action in enumerate(step):
                    yield (position, index, order), action


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
    if schedule.redundant:
        raise ValueError(
            f"add_redundancy takes a schedule without redundancy, got {schedule.mode!r}"
        )
    if not redundancy_on(mode):
        return schedule
    if schedule.num_stages == 1:
        return replace(schedule, mode=mode)
    for (position, _, _), action in schedule.locations():
        if action.kind in COMPUTE_KINDS and action.stage != position:
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
        while split > 0 and last[split - 1].kind in TAIL_KINDS:
            split -= 1
        body.append([list(step) for step in row[:-1]] + [last[:split]])
        tails.append(last[split:])
    assert not any(a.kind in TAIL_KINDS for row in body for step in row for a in step)
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
            index
            for index, step in enumerate(row)
            if not any(a.kind in COMPUTE_KINDS for a in step)
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
            shown = [str(a) for a in step if show_all or a.kind in COMPUTE_KINDS]
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
