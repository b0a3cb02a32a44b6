"""The rules every pipeline schedule obeys (``spotline.plan.schedule``), checked by
:func:`validate`; a broken rule raises :class:`ScheduleError` with the grid printed and the
failing cell marked.

Pure: no torch or DeepSpeed import.
"""

from __future__ import annotations

from dataclasses import replace

from spotline.plan.actions import COMPUTE_KINDS, TAIL_KINDS, Action, ActionKind
from spotline.plan.schedule import Location, Schedule, format_grid


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
        for where, action in schedule.locations():
            self.seen.setdefault(action, []).append(where)

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
        for (position, index, order), action in schedule.locations():
            mb = action.micro_batch
            if action.stage >= schedule.num_stages or (
                mb is not None and mb >= schedule.num_micro_batches
            ):
                detail = f"{action} names no stage or micro-batch"
                raise self.fail("in-range", detail, (position, index, order))

    def check_pairs(self) -> None:
        schedule = self.schedule
        for (position, index, order), action in schedule.locations():
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
        for (position, index, order), action in self.schedule.locations():
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
        ended = next((a for a in done if a.kind in TAIL_KINDS), None)
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
                compute = [str(a) for a in step if a.kind in COMPUTE_KINDS]
                if len(compute) > 1:
                    detail = f"rank {position} computes {', '.join(compute)} in one step"
                    raise self.fail("one-compute-per-step", detail, (position, index, 0))
