"""spotline.plan.lowering lowers a schedule to exactly DeepSpeed's TrainSchedule instructions."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
from deepspeed.runtime.pipe.schedule import TrainSchedule  # noqa: E402

from spotline.plan.lowering import Lowered, lower  # noqa: E402
from spotline.plan.schedule import add_redundancy, num_pipe_buffers, train_schedule  # noqa: E402

PAIRS = [(stages, mbs) for stages in range(1, 7) for mbs in range(1, 9)]


def deepspeed_steps(num_stages: int, num_mbs: int, stage: int) -> list[list[tuple[str, dict]]]:
    schedule = TrainSchedule(micro_batches=num_mbs, stages=num_stages, stage_id=stage)
    return [[(type(c).__name__, c.kwargs) for c in cmds] for cmds in schedule.steps()]


def named(lowered: Lowered) -> list[list[tuple[str, dict]]]:
    """A lowered schedule as (name, kwargs) pairs, the form DeepSpeed's instructions print."""
    return [[(x.name, x.kwargs) for x in step] for step in lowered]


@pytest.mark.parametrize(("num_stages", "num_mbs"), PAIRS)
def test_lower_equals_train_schedule(num_stages: int, num_mbs: int) -> None:
    base = train_schedule(num_stages, num_mbs)
    off = add_redundancy(base, "off")
    for stage in range(num_stages):
        expected = deepspeed_steps(num_stages, num_mbs, stage)
        assert named(lower(base, stage)) == expected
        assert named(lower(off, stage)) == expected


@pytest.mark.parametrize(("num_stages", "num_mbs"), PAIRS)
def test_num_pipe_buffers_equals_deepspeed(num_stages: int, num_mbs: int) -> None:
    for stage in range(num_stages):
        ds = TrainSchedule(micro_batches=num_mbs, stages=num_stages, stage_id=stage)
        assert num_pipe_buffers(num_stages, num_mbs, stage) == ds.num_pipe_buffers()


def test_lazy_keeps_deepspeed_instructions_in_order() -> None:
    """Dropping Spotline's instructions from a lazy row gives DeepSpeed's row back."""
    spotline_names = {
        "StashOutput",
        "StashInputGrad",
        "ReplicaLoad",
        "RedundantForward",
        "ReplicaGradSend",
        "ReplicaGradRecv",
        "ReplicaStep",
    }
    for num_stages, num_mbs in [(2, 3), (4, 5)]:
        for mode in ("lazy", "eager"):
            schedule = add_redundancy(train_schedule(num_stages, num_mbs), mode)
            for stage in range(num_stages):
                rows = [
                    [(n, k) for n, k in step if n not in spotline_names]
                    for step in named(lower(schedule, stage))
                ]
                expected = deepspeed_steps(num_stages, num_mbs, stage)
                if mode == "eager":
                    # Extra steps hold only redundant forwards; the tail moves to the last step.
                    tail = expected[-1][-3:]
                    expected[-1] = expected[-1][:-3]
                    expected += [[] for _ in range(len(rows) - len(expected))]
                    expected[-1] = expected[-1] + tail
                assert rows == expected
