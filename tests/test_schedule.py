"""spotline.plan.schedule: pipeline schedules as data (pure, milliseconds)."""

import subprocess
import sys
from dataclasses import replace

import pytest

from spotline.plan.actions import Action, ActionKind, parse_action
from spotline.plan.lowering import Lowered, lower
from spotline.plan.redundancy_mode import REDUNDANCY_MODES
from spotline.plan.schedule import (
    Schedule,
    add_redundancy,
    format_grid,
    hidden_fraction,
    num_extra_steps,
    train_schedule,
)
from spotline.plan.schedule_rules import ScheduleError, validate

PAIRS = [(stages, mbs) for stages in range(1, 9) for mbs in range(1, 13)]
SPOTLINE_KINDS = {
    ActionKind.STASH_OUTPUT,
    ActionKind.STASH_INPUT_GRAD,
    ActionKind.REPLICA_LOAD,
    ActionKind.REDUNDANT_FORWARD,
    ActionKind.REPLICA_GRAD_SEND,
    ActionKind.REPLICA_GRAD_RECV,
    ActionKind.REPLICA_STEP,
}
COMPUTE = {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.REDUNDANT_FORWARD}
F, B, RF = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.REDUNDANT_FORWARD


def eager(num_stages: int, num_mbs: int) -> Schedule:
    return add_redundancy(train_schedule(num_stages, num_mbs), "eager")


def edit(schedule: Schedule, position: int, step: int, actions: list[Action]) -> Schedule:
    """``schedule`` with the cell (position, step) replaced by ``actions``."""
    rows = [list(row) for row in schedule.steps]
    rows[position][step] = tuple(actions)
    return replace(schedule, steps=tuple(tuple(row) for row in rows))


def named(lowered: Lowered) -> list[list[tuple[str, dict[str, int]]]]:
    """A lowered schedule as (name, kwargs) pairs, the form DeepSpeed's instructions print."""
    return [[(x.name, x.kwargs) for x in step] for step in lowered]


def where(schedule: Schedule, action: Action) -> list[tuple[int, int]]:
    return [
        (position, index)
        for position, row in enumerate(schedule.steps)
        for index, step in enumerate(row)
        if action in step
    ]


# ------------------------------------------------------------------ the base schedule


def test_train_schedule_shape_and_slots() -> None:
    """Forward of mb m at step 2m + s, backward at 2m + 2S - 1 - s; tail in the last step."""
    num_stages, num_mbs = 4, 6
    schedule = train_schedule(num_stages, num_mbs)
    assert schedule.num_steps == 2 * (num_mbs + num_stages - 1)
    assert schedule.mode == "off"
    for stage in range(num_stages):
        for mb in range(num_mbs):
            assert where(schedule, Action(stage, F, mb)) == [(stage, 2 * mb + stage)]
            backward_step = 2 * mb + 2 * num_stages - 1 - stage
            assert where(schedule, Action(stage, B, mb)) == [(stage, backward_step)]
        codes = [str(a) for a in schedule.steps[stage][-1][-3:]]
        assert codes == [f"{stage}RT", f"{stage}RD", f"{stage}O"]


def test_train_schedule_rejects_empty_pipeline() -> None:
    with pytest.raises(ValueError, match="stage"):
        train_schedule(0, 4)
    with pytest.raises(ValueError, match="micro-batch"):
        train_schedule(2, 0)


# ------------------------------------------------------------------ redundancy modes


@pytest.mark.parametrize("num_stages", range(1, 9))
def test_every_mode_validates(num_stages: int) -> None:
    for num_mbs in range(1, 13):
        base = train_schedule(num_stages, num_mbs)
        for mode in REDUNDANCY_MODES:
            schedule = add_redundancy(base, mode)
            assert schedule.mode == mode
            validate(schedule)
            assert len({len(row) for row in schedule.steps}) == 1


def test_off_is_the_base() -> None:
    for num_stages, num_mbs in PAIRS:
        base = train_schedule(num_stages, num_mbs)
        assert add_redundancy(base, "off") == base


def test_one_stage_has_no_replica() -> None:
    """A single stage has no other position to hold its replica: nothing is added."""
    base = train_schedule(1, 4)
    for mode in ("lazy", "eager"):
        assert add_redundancy(base, mode).steps == base.steps


@pytest.mark.parametrize(("num_stages", "num_mbs"), [p for p in PAIRS if p[0] > 1])
def test_lazy_adds_no_compute_and_keeps_base_order(num_stages: int, num_mbs: int) -> None:
    base = train_schedule(num_stages, num_mbs)
    lazy = add_redundancy(base, "lazy")
    assert lazy.num_steps == base.num_steps
    assert num_extra_steps(lazy) == 0
    for lazy_row, base_row in zip(lazy.steps, base.steps, strict=True):
        for lazy_step, base_step in zip(lazy_row, base_row, strict=True):
            assert [a for a in lazy_step if a.kind not in SPOTLINE_KINDS] == list(base_step)
            assert not any(a.kind is RF for a in lazy_step)


@pytest.mark.parametrize(("num_stages", "num_mbs"), [p for p in PAIRS if p[0] > 1])
def test_eager_runs_one_redundant_forward_per_stage_and_micro_batch(
    num_stages: int, num_mbs: int
) -> None:
    schedule = eager(num_stages, num_mbs)
    for stage in range(num_stages):
        for mb in range(num_mbs):
            (located,) = where(schedule, Action(stage, RF, mb))
            assert located[0] == (stage - 1) % num_stages  # the holder of stage's replica
    num_rf = sum(a.kind is RF for row in schedule.steps for step in row for a in step)
    assert num_rf == num_stages * num_mbs
    # Without its redundant forwards (and the moved tail) eager is lazy plus empty steps.
    lazy = add_redundancy(train_schedule(num_stages, num_mbs), "lazy")
    for eager_row, lazy_row in zip(schedule.steps, lazy.steps, strict=True):
        computes = [[a for a in s if a.kind in (F, B)] for s in eager_row]
        assert computes[: lazy.num_steps] == [[a for a in s if a.kind in (F, B)] for s in lazy_row]


def test_stashes_follow_their_compute() -> None:
    schedule = add_redundancy(train_schedule(3, 2), "lazy")
    assert [str(a) for a in schedule.steps[0][0]] == ["0L0", "0F0", "0SO0"]
    assert [str(a) for a in schedule.steps[1][4]] == ["1RG0", "1SA1", "1B0", "1SI0"]
    # The last stage keeps stage 0's inputs right after its own load, stashes no output.
    # (After the previous step's replica update, in the bubble before its first receive.)
    assert [str(a) for a in schedule.steps[2][2]] == ["0RO", "2RA0", "2L0", "0RL0", "2F0"]
    assert not any(
        a.kind is ActionKind.STASH_INPUT_GRAD and a.stage == 0
        for row in schedule.steps
        for step in row
        for a in step
    )


def test_replica_tail_is_a_ring_before_the_optimizer_zeroes_gradients() -> None:
    for mode in ("lazy", "eager"):
        schedule = add_redundancy(train_schedule(3, 4), mode, replica_step_in_bubble=False)
        tails = [[str(a) for a in row[-1] if a.kind not in COMPUTE] for row in schedule.steps]
        assert tails[0][-6:] == ["0RT", "0RD", "0SR", "1RR", "0O", "1RO"]
        assert tails[1][-6:] == ["1RT", "1RD", "1SR", "2RR", "1O", "2RO"]
        assert tails[2][-6:] == ["2RT", "2RD", "2SR", "0RR", "2O", "0RO"]


@pytest.mark.parametrize(("num_stages", "num_micro_batches"), [(2, 1), (2, 4), (3, 4), (5, 8)])
def test_lazy_replica_step_runs_in_the_next_batch_s_first_bubble(
    num_stages: int, num_micro_batches: int
) -> None:
    """Off the critical path: a non-first position applies the previous batch's replica
    update while it waits for its first activation, the first position while it waits for
    its last output gradient; the batch then ends with the exchange and the commit only."""
    schedule = add_redundancy(train_schedule(num_stages, num_micro_batches), "lazy")
    validate(schedule)
    for position, row in enumerate(schedule.steps):
        replica = (position + 1) % num_stages
        assert [str(a) for a in row[-1] if a.kind not in COMPUTE][-5:] == [
            f"{position}RT",
            f"{position}RD",
            f"{position}SR",
            f"{replica}RR",
            f"{position}O",
        ]
        flat = [a for step in row for a in step]
        (step_at,) = [i for i, a in enumerate(flat) if a.kind is ActionKind.REPLICA_STEP]
        assert flat[step_at] == Action(replica, ActionKind.REPLICA_STEP)
        waits = [
            i
            for i, a in enumerate(flat)
            if a.kind is (ActionKind.RECV_ACTIVATION if position else ActionKind.RECV_GRAD)
        ]
        # Right before the wait, so the update fills time the position would sit idle.
        assert step_at + 1 == (waits[0] if position else waits[-1])
    # Eager's redundant forwards read the replica: its update stays after the commit.
    for row in add_redundancy(train_schedule(num_stages, num_micro_batches), "eager").steps:
        assert row[-1][-1].kind is ActionKind.REPLICA_STEP


def test_validator_places_the_replica_step_around_the_exchange() -> None:
    lazy = add_redundancy(train_schedule(2, 2), "lazy")
    last = lazy.num_steps - 1
    # Moved from the bubble to between the exchange and the commit: it would apply the
    # previous batch's update from a buffer the exchange has just overwritten.
    tail = [a for a in lazy.steps[1][last]]
    body = [a for a in lazy.steps[1][1] if a.kind is not ActionKind.REPLICA_STEP]
    tail.insert(
        tail.index(Action(1, ActionKind.OPTIMIZER_STEP)), Action(0, ActionKind.REPLICA_STEP)
    )
    moved = edit(edit(lazy, 1, 1, body), 1, last, tail)
    assert_breaks(moved, "replica-step-before-exchange", (1, last))
    # Dropped: the received gradients are never applied.
    assert_breaks(edit(lazy, 1, 1, body), "one-replica-step", (1, last))
    # Twice: the update applied twice.
    twice = edit(lazy, 1, 2, [*lazy.steps[1][2], Action(0, ActionKind.REPLICA_STEP)])
    assert_breaks(twice, "one-replica-step", (1, 2))
    # In the body of an eager schedule, after a redundant forward that reads the replica.
    eager_schedule = add_redundancy(train_schedule(2, 2), "eager")
    rows = eager_schedule.steps
    (rf_step,) = [i for i, step in enumerate(rows[0]) if Action(1, RF, 0) in step]
    end = eager_schedule.num_steps - 1
    early = edit(
        eager_schedule, 0, end, [a for a in rows[0][end] if a.kind is not ActionKind.REPLICA_STEP]
    )
    late = edit(early, 0, rf_step + 1, [Action(1, ActionKind.REPLICA_STEP), *rows[0][rf_step + 1]])
    assert_breaks(late, "redundant-forward-after-replica-step", (0, rf_step))


def test_add_redundancy_rejects_bad_input() -> None:
    base = train_schedule(2, 2)
    swapped = replace(base, steps=(base.steps[1], base.steps[0]))
    with pytest.raises(ValueError, match="undisturbed placement"):
        add_redundancy(swapped, "lazy")
    lazy = add_redundancy(base, "lazy")
    with pytest.raises(ValueError, match="without redundancy"):
        add_redundancy(lazy, "eager")
    with pytest.raises(ValueError, match="unknown redundancy mode"):
        add_redundancy(train_schedule(2, 2), "always")  # type: ignore[arg-type]


# ------------------------------------------------------------------ hidden work, by hand

# Worked by hand from F(s, m) at step 2m + s, B(s, m) at 2m + 2S - 1 - s: position p's
# redundant forward of mb m is ready after step 2m + p (the last position: any step, it
# fetches stage 0's inputs itself) and takes the earliest free bubble; the grid has
# 2(S-1) bubbles per position.
EAGER_2x2 = """\
step      0    1   2   3    4    5
rank 0  0F0 1RF0 0F1 0B0 1RF1  0B1
rank 1 0RF0  1F0 1B0 1F1  1B1 0RF1"""


def test_eager_2x2_grid_exactly() -> None:
    assert format_grid(eager(2, 2)) == EAGER_2x2


@pytest.mark.parametrize(
    ("num_stages", "num_mbs", "per_position", "num_extra"),
    [
        (2, 1, (1.0, 1.0), 0),
        (2, 2, (1.0, 1.0), 0),
        # bubbles 1, 8 (rank 0) and 0, 9 (rank 1): two of four fit on each.
        (2, 4, (0.5, 0.5), 2),
        (4, 4, (1.0, 1.0, 1.0, 1.0), 0),
        # rank 0 bubbles 1,3,5,16,18,20: 6 fit; rank 1 bubbles 0,2,4,17,19,21, ready from
        # 2: 5; rank 2 bubbles 0,1,3,18,20,21, ready from 3: 4; rank 3: 6. 4 extra on rank 2.
        (4, 8, (6 / 8, 5 / 8, 4 / 8, 6 / 8), 4),
    ],
)
def test_hidden_fraction_by_hand(
    num_stages: int, num_mbs: int, per_position: tuple[float, ...], num_extra: int
) -> None:
    schedule = eager(num_stages, num_mbs)
    got = tuple(hidden_fraction(schedule, p) for p in range(num_stages))
    assert got == per_position
    assert hidden_fraction(schedule) == sum(per_position) / num_stages
    assert num_extra_steps(schedule) == num_extra
    assert schedule.num_steps == 2 * (num_mbs + num_stages - 1) + num_extra


def test_two_stages_hide_two_redundant_forwards_per_position() -> None:
    """With two stages each position has two bubbles, both usable: min(M, 2) of M fit."""
    for num_mbs in range(1, 13):
        assert hidden_fraction(eager(2, num_mbs)) == min(num_mbs, 2) / num_mbs


def test_hidden_fraction_needs_redundant_forwards() -> None:
    for schedule in (
        train_schedule(3, 3),
        add_redundancy(train_schedule(3, 3), "lazy"),
        eager(1, 3),
    ):
        with pytest.raises(ValueError, match="redundant forwards"):
            hidden_fraction(schedule)


def test_extra_steps_hold_only_overflow_and_the_tail_is_last() -> None:
    schedule = eager(2, 4)
    base_steps = 2 * (4 + 2 - 1)
    for row in schedule.steps:
        for step in row[base_steps:]:
            assert all(
                a.kind is RF or a.kind.value in {"RT", "RD", "SR", "RR", "O", "RO"} for a in step
            )
        assert row[-1][-1].kind is ActionKind.REPLICA_STEP
    # The last position's late redundant forwards read inputs kept at its own loads.
    assert where(schedule, Action(0, ActionKind.REPLICA_LOAD, 3)) == [(1, 7)]
    # Its first one ran in the warm-up bubble, fetching the inputs there.
    assert [str(a) for a in schedule.steps[1][0]] == ["0RL0", "0RF0"]


# ------------------------------------------------------------------ text forms


def test_parse_action_inverts_str() -> None:
    for num_stages, num_mbs in [(1, 3), (2, 4), (5, 7), (8, 12)]:
        for mode in REDUNDANCY_MODES:
            schedule = add_redundancy(train_schedule(num_stages, num_mbs), mode)
            for row in schedule.steps:
                for step in row:
                    for action in step:
                        assert parse_action(str(action)) == action
    assert parse_action("2RF0") == Action(2, RF, 0)
    assert parse_action("0SA1") == Action(0, ActionKind.SEND_ACTIVATION, 1)
    assert parse_action("1RA1") == Action(1, ActionKind.RECV_ACTIVATION, 1)
    assert parse_action("3RT") == Action(3, ActionKind.REDUCE_TIED_GRADS)
    assert str(Action(12, B, 10)) == "12B10"


@pytest.mark.parametrize("text", ["", "F0", "1X0", "1F", "0RT1", "a1F0", "1F0x"])
def test_parse_action_rejects_bad_text(text: str) -> None:
    with pytest.raises(ValueError):
        parse_action(text)


def test_schedule_rejects_ragged_grid() -> None:
    base = train_schedule(2, 2)
    rows = (base.steps[0], base.steps[1][:-1])
    with pytest.raises(ValueError, match="same number of steps"):
        replace(base, steps=rows)


def test_format_grid_columns_are_fixed_width_and_marked() -> None:
    schedule = eager(4, 8)
    for show_all in (False, True):
        text = format_grid(schedule, (2, 5), show_all=show_all)
        lines = text.splitlines()
        assert len(lines) == 1 + 4
        assert len({len(line) for line in lines}) == 1
        assert lines[3].startswith("rank 2")
    assert ">2B0<" in format_grid(schedule, (2, 5))
    assert ">.<" in format_grid(schedule, (1, 0))
    assert "0SA0" in format_grid(schedule, show_all=True)
    assert "SA" not in format_grid(schedule)


# ------------------------------------------------------------------ lowering


def test_lower_names_spotline_instructions() -> None:
    schedule = eager(2, 2)
    rank0 = named(lower(schedule, 0))
    assert rank0[0] == [
        ("LoadMicroBatch", {"buffer_id": 0}),
        ("ForwardPass", {"buffer_id": 0}),
        ("StashOutput", {"buffer_id": 0, "micro_batch_id": 0}),
    ]
    assert rank0[1][-1] == ("RedundantForward", {"micro_batch_id": 0})
    assert [name for name, _ in rank0[-1][-6:]] == [
        "ReduceTiedGrads",
        "ReduceGrads",
        "ReplicaGradSend",
        "ReplicaGradRecv",
        "OptimizerStep",
        "ReplicaStep",
    ]
    rank1 = named(lower(schedule, 1))
    assert rank1[0] == [
        ("ReplicaLoad", {"micro_batch_id": 0}),
        ("RedundantForward", {"micro_batch_id": 0}),
    ]
    assert ("StashInputGrad", {"buffer_id": 1, "micro_batch_id": 1}) in rank1[4]
    with pytest.raises(ValueError, match="position"):
        lower(schedule, 2)


# ------------------------------------------------------------------ the validator


def assert_breaks(schedule: Schedule, rule: str, mark: tuple[int, int] | None) -> str:
    with pytest.raises(ScheduleError) as caught:
        validate(schedule)
    message = str(caught.value)
    assert caught.value.rule == rule
    assert caught.value.mark == mark
    assert f"'{rule}'" in message.splitlines()[0]
    assert "rank 0" in message and "step" in message.splitlines()[1]  # the grid
    if mark is not None:
        marked = message.splitlines()[2 + mark[0]]
        assert marked.startswith(f"rank {mark[0]}") and ">" in marked and "<" in marked
    return message


def test_validator_catches_a_missing_receive() -> None:
    schedule = eager(2, 2)
    assert [str(a) for a in schedule.steps[1][1]] == ["1RA0", "1L0", "1F0"]
    broken = edit(schedule, 1, 1, list(schedule.steps[1][1][1:]))
    message = assert_breaks(broken, "send-has-receive", (0, 1))
    assert ">0SA0,1RF0<" in message


def test_validator_catches_a_missing_send() -> None:
    schedule = train_schedule(3, 2)
    assert [str(a) for a in schedule.steps[2][4]] == ["2SG0", "2RA1", "2L1", "2F1"]
    step = list(schedule.steps[2][4][1:])
    message = assert_breaks(edit(schedule, 2, 4, step), "receive-has-send", (1, 4))
    assert ">1RG0,1SA1,1B0<" in message


def test_validator_catches_a_missing_replica_receive() -> None:
    schedule = add_redundancy(train_schedule(3, 2), "lazy")
    last = [a for a in schedule.steps[2][-1] if a.kind is not ActionKind.REPLICA_GRAD_RECV]
    assert_breaks(edit(schedule, 2, schedule.num_steps - 1, last), "send-has-receive", (0, 7))


def test_validator_catches_a_duplicate_forward() -> None:
    schedule = eager(4, 4)
    assert schedule.steps[0][10] == ()
    broken = edit(schedule, 0, 10, [Action(0, F, 1)])
    message = assert_breaks(broken, "one-forward", (0, 10))
    assert ">0F1<" in message


def test_validator_catches_a_missing_forward() -> None:
    schedule = train_schedule(1, 2)
    step = [a for a in schedule.steps[0][2] if a.kind is not F]
    assert_breaks(edit(schedule, 0, 2, step), "one-forward", None)


def test_validator_catches_a_backward_before_its_forward() -> None:
    schedule = train_schedule(1, 2)  # rank 0: L0 F0 | B0 | L1 F1 | B1 + tail
    swapped = edit(schedule, 0, 1, [Action(0, F, 0)])
    swapped = edit(swapped, 0, 0, [Action(0, ActionKind.LOAD, 0), Action(0, B, 0)])
    assert_breaks(swapped, "backward-after-forward", (0, 0))


def test_validator_catches_a_redundant_forward_before_its_input() -> None:
    schedule = eager(3, 2)
    assert where(schedule, Action(2, RF, 0)) == [(1, 2)]
    assert schedule.steps[1][0] == ()  # a warm-up bubble, before 1F0 and 1SO0
    moved = edit(schedule, 1, 2, [a for a in schedule.steps[1][2] if a.kind is not RF])
    moved = edit(moved, 1, 0, [Action(2, RF, 0)])
    message = assert_breaks(moved, "redundant-forward-after-input", (1, 0))
    assert ">2RF0<" in message


def test_validator_catches_a_redundant_forward_after_the_step() -> None:
    schedule = eager(2, 4)
    last = schedule.num_steps - 1
    step = list(schedule.steps[0][last])
    assert str(step[0]) == "1RF3"
    broken = edit(schedule, 0, last, step[1:] + step[:1])
    assert_breaks(broken, "redundant-forward-before-step", (0, last))


def test_validator_catches_a_redundant_forward_in_a_busy_step() -> None:
    schedule = eager(4, 4)
    assert where(schedule, Action(1, RF, 0)) == [(0, 1)]
    moved = edit(schedule, 0, 1, [a for a in schedule.steps[0][1] if a.kind is not RF])
    moved = edit(moved, 0, 2, [*schedule.steps[0][2], Action(1, RF, 0)])  # beside 0F1
    assert_breaks(moved, "one-compute-per-step", (0, 2))


def test_validator_catches_a_missing_redundant_forward_in_eager() -> None:
    schedule = eager(2, 2)
    dropped = edit(schedule, 0, 4, [a for a in schedule.steps[0][4] if a.kind is not RF])
    assert_breaks(dropped, "one-redundant-forward", None)


def test_validator_catches_step_before_reduce() -> None:
    schedule = add_redundancy(train_schedule(2, 2), "lazy")
    last = schedule.num_steps - 1
    tail = list(schedule.steps[0][last])
    names = [str(a) for a in tail]
    optimizer, reduce = names.index("0O"), names.index("0RD")
    tail[optimizer], tail[reduce] = tail[reduce], tail[optimizer]
    assert_breaks(edit(schedule, 0, last, tail), "optimizer-after-reduce", (0, last))

    # After the commit, the replica's update must follow the exchange that brings it.
    schedule = add_redundancy(train_schedule(2, 2), "lazy", replica_step_in_bubble=False)
    tail = list(schedule.steps[0][last])
    assert str(tail[-1]) == "1RO"
    received = tail.pop(tail.index(Action(1, ActionKind.REPLICA_GRAD_RECV)))
    tail.append(received)
    assert_breaks(edit(schedule, 0, last, tail), "replica-step-after-recv", (0, last))


def test_validator_catches_a_stash_before_its_compute() -> None:
    schedule = add_redundancy(train_schedule(2, 2), "lazy")
    step = list(schedule.steps[0][0])
    assert [str(a) for a in step] == ["0L0", "0F0", "0SO0"]
    assert_breaks(edit(schedule, 0, 0, [step[0], step[2], step[1]]), "stash-after-compute", (0, 0))


def test_validator_catches_out_of_range_actions() -> None:
    schedule = train_schedule(2, 2)
    broken = edit(schedule, 0, 1, [*schedule.steps[0][1], Action(0, RF, 7)])
    assert_breaks(broken, "in-range", (0, 1))


# ------------------------------------------------------------------ purity


def test_module_imports_neither_torch_nor_deepspeed() -> None:
    code = (
        "import sys, spotline.plan.schedule; "
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_validator_catches_a_send_off_the_pipeline() -> None:
    """Stage 0 has no predecessor: its gradient send is an error, not a crash."""
    schedule = train_schedule(2, 2)
    broken = edit(schedule, 0, 1, [*schedule.steps[0][1], Action(0, ActionKind.SEND_GRAD, 0)])
    assert_breaks(broken, "send-has-receive", (0, 1))


# --------------------------------------------------------------------------- logical workers


def _names(steps: list[list[tuple[str, dict[str, int]]]]) -> list[str]:
    return [name for step in steps for name, _ in step]


@pytest.mark.parametrize("mode", ["off", "lazy", "eager"])
@pytest.mark.parametrize(("num_stages", "num_micro_batches"), [(1, 1), (2, 3), (4, 4)])
@pytest.mark.parametrize("num_hosted", [1, 2, 3])
def test_a_pipeline_runs_each_hosted_logical_worker_through_the_whole_body(
    mode, num_stages, num_micro_batches, num_hosted
) -> None:
    from spotline.plan.lowering import lower_logical_step

    schedule = add_redundancy(train_schedule(num_stages, num_micro_batches), mode)
    for position in range(num_stages):
        plain = named(lower(schedule, position))
        logical = named(lower_logical_step(schedule, position, num_hosted))
        ends = {"ReduceTiedGrads", "ReduceGrads", "OptimizerStep"}
        ends |= {"ReplicaGradSend", "ReplicaGradRecv", "ReplicaStep"}
        names = [n for n, _ in plain[-1]]
        split = len(names)
        while split and names[split - 1] in ends:
            split -= 1
        tail = names[split:]
        body = [n for n in _names(plain)][: len(_names(plain)) - len(tail)]
        expected: list[str] = []
        for index in range(num_hosted):
            # The previous step's replica update (lazy, in a bubble): once, in the first.
            copy = [n for n in body if index == 0 or n != "ReplicaStep"]
            if index == 0 and "ReplicaGradRecv" in tail:
                # The receive is posted once, as soon as that update freed its buffer.
                at = copy.index("ReplicaStep") + 1 if "ReplicaStep" in copy else 0
                copy.insert(at, "ReplicaGradPost")
            expected += ["BeginLogicalWorker", *copy, "ReduceTiedGrads", "KeepLogicalGradients"]
        expected += tail[1:]  # the step's one reduction, replica exchange and optimizer steps
        assert _names(logical) == expected
        assert ("ReplicaGradPost" in expected) == (mode != "off" and num_stages > 1)
        begins = [kw["index"] for step in logical for n, kw in step if n == "BeginLogicalWorker"]
        keeps = [kw["index"] for step in logical for n, kw in step if n == "KeepLogicalGradients"]
        assert begins == keeps == list(range(num_hosted))
        assert len(logical) == num_hosted * len(plain)  # k times the lock-step length


def _tied_tail(num_hosted: int, mode: str) -> list[tuple[str, dict[str, int]]]:
    """A split step's end from its ReduceTiedGrads on: the last logical worker's tied part
    kept, reduced and sent, the exchange waited for, the commit."""
    from spotline.plan.pipe_instructions import GradPart

    tied = {"part": GradPart.TIED}
    return [
        ("ReduceTiedGrads", {}),
        ("KeepLogicalGradients", {"index": num_hosted - 1, **tied}),
        ("ReduceGrads", tied),
        ("ReplicaGradSend", tied),
        ("ReplicaGradRecv", {}),
        ("OptimizerStep", {}),
        # eager: the replica's step follows the commit (its redundant forwards read it)
        *([("ReplicaStep", {})] if mode == "eager" else []),
    ]


@pytest.mark.parametrize("mode", ["lazy", "eager"])
@pytest.mark.parametrize("num_hosted", [1, 3])
def test_a_tied_suffix_is_reduced_and_sent_in_two_parts_around_the_tied_reduction(
    mode, num_hosted
) -> None:
    """The last logical worker's untied gradients are kept, reduced and sent before the
    ReduceTiedGrads that waits for the tied partner, the tied ones after it; the receive is
    posted once, before either arrives; earlier logical workers are unchanged."""
    from spotline.plan.lowering import lower_logical_step
    from spotline.plan.pipe_instructions import GradPart

    schedule = add_redundancy(train_schedule(2, 3), mode)
    plain = named(lower_logical_step(schedule, 1, num_hosted))
    early = named(lower_logical_step(schedule, 1, num_hosted, send_untied_early=True))
    flat = [(n, kw) for step in early for n, kw in step]
    last_begin = max(i for i, (n, _) in enumerate(flat) if n == "BeginLogicalWorker")
    untied = {"part": GradPart.UNTIED}
    start = flat.index(("KeepLogicalGradients", {"index": num_hosted - 1, **untied}))
    assert flat[start:] == [
        ("KeepLogicalGradients", {"index": num_hosted - 1, **untied}),
        ("ReduceGrads", untied),
        ("ReplicaGradSend", untied),
        *_tied_tail(num_hosted, mode),
    ]
    tail = [n for n, _ in flat[last_begin:]]
    assert tail.index("ReplicaGradSend") < tail.index("ReduceTiedGrads")
    assert [n for n, _ in flat].count("ReplicaGradPost") == 1
    assert [n for n, _ in flat].index("ReplicaGradPost") < [n for n, _ in flat].index(
        "ReplicaGradSend"
    )
    # Everything before the last logical worker's end is as without the split.
    plain_flat = [(n, kw) for step in plain for n, kw in step]
    cut = [n for n, _ in plain_flat].index("ReduceTiedGrads", last_begin)
    assert flat[:cut] == plain_flat[:cut]
    assert len(early) == len(plain)  # the same lock-step length
    # Without a replica exchange there is nothing to send early.
    off = add_redundancy(train_schedule(2, 3), "off")
    assert lower_logical_step(off, 1, num_hosted, send_untied_early=True) == lower_logical_step(
        off, 1, num_hosted
    )


@pytest.mark.parametrize("mode", ["lazy", "eager"])
@pytest.mark.parametrize("num_hosted", [1, 3])
def test_stage_0_streams_its_untied_gradients_from_its_last_backward_pass(mode, num_hosted) -> None:
    """StreamUntiedGrads comes right before the last logical worker's last BackwardPass of
    stage 0; the tied part is kept, reduced and sent after ReduceTiedGrads; the receive is
    posted once; everything else is as without streaming."""
    from spotline.plan.lowering import lower_logical_step

    schedule = add_redundancy(train_schedule(3, 4), mode)
    plain = named(lower_logical_step(schedule, 0, num_hosted))
    streamed = named(lower_logical_step(schedule, 0, num_hosted, stream_untied=True))
    flat = [(n, kw) for step in streamed for n, kw in step]
    names = [n for n, _ in flat]
    arm = names.index("StreamUntiedGrads")
    assert flat[arm] == ("StreamUntiedGrads", {"index": num_hosted - 1})
    assert names.count("StreamUntiedGrads") == 1
    last_backward = max(i for i, n in enumerate(names) if n == "BackwardPass")
    assert arm == last_backward - 1
    assert arm > max(i for i, n in enumerate(names) if n == "BeginLogicalWorker")
    assert flat[last_backward + 1 :] == _tied_tail(num_hosted, mode)
    assert names.count("ReplicaGradPost") == 1
    plain_flat = [(n, kw) for step in plain for n, kw in step]
    assert flat[:arm] == plain_flat[:arm]
    assert len(streamed) == len(plain)
    with pytest.raises(ValueError, match="either its last or its first"):
        lower_logical_step(schedule, 0, 1, stream_untied=True, send_untied_early=True)
    off = add_redundancy(train_schedule(3, 4), "off")
    assert lower_logical_step(off, 0, num_hosted, stream_untied=True) == lower_logical_step(
        off, 0, num_hosted
    )


def test_a_pipeline_hosting_no_logical_worker_is_refused() -> None:
    from spotline.plan.lowering import lower_logical_step

    with pytest.raises(ValueError, match="at least one logical worker"):
        lower_logical_step(train_schedule(2, 2), 0, 0)
