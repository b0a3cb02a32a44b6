"""A lowered schedule is dispatched on its instructions' types (spotline.plan.pipe_instructions),
through a map each engine builds for itself: every type a schedule lowers to has a handler,
the handler is the engine class's own override, and importing a module extends nothing."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import typing  # noqa: E402
from types import MethodType  # noqa: E402

import pytest  # noqa: E402
from deepspeed.runtime.pipe import schedule as ds_schedule  # noqa: E402
from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: E402

from spotline.config import RedundancySection  # noqa: E402
from spotline.pipeline.engine import SpotlinePipelineEngine  # noqa: E402
from spotline.pipeline.redundancy import RedundantPipelineEngine  # noqa: E402
from spotline.plan import pipe_instructions as pi  # noqa: E402
from spotline.plan.lowering import lower_logical_step  # noqa: E402
from spotline.plan.redundancy_mode import REDUNDANCY_MODES, RedundancyMode  # noqa: E402
from spotline.plan.schedule import Schedule, add_redundancy, train_schedule  # noqa: E402


def lowered_types(mode: RedundancyMode) -> set[type[pi.Instruction]]:
    """Every instruction type a schedule of ``mode`` lowers to, over shapes, positions,
    hosted logical workers and both ways of sending untied gradients early."""
    found: set[type[pi.Instruction]] = set()
    for num_stages, num_micro_batches in [(1, 1), (2, 3), (3, 4)]:
        for replay in (True, False) if mode == "lazy" else (True,):
            base = train_schedule(num_stages, num_micro_batches)
            schedule = add_redundancy(base, mode, replay=replay)
            for position in range(num_stages):
                for num_hosted in (1, 2):
                    for early, streamed in [(False, False), (True, False), (False, True)]:
                        lowered = lower_logical_step(
                            schedule,
                            position,
                            num_hosted,
                            send_untied_early=early,
                            stream_untied=streamed,
                        )
                        found |= {type(x) for step in lowered for x in step}
    return found


@pytest.mark.parametrize("mode", REDUNDANCY_MODES)
def test_every_lowered_instruction_type_has_a_handler(mode: RedundancyMode) -> None:
    handlers = RedundantPipelineEngine.instruction_handlers()
    types = lowered_types(mode)
    assert not types - set(handlers), f"no handler for {types - set(handlers)}"
    if mode == "off":
        # The plain engine runs the schedules without redundancy on its own handlers.
        assert not types - set(SpotlinePipelineEngine.instruction_handlers())
    else:
        assert pi.ReplicaStep in types and pi.StreamUntiedGrads in types


def test_handlers_are_the_engine_classes_own_overrides() -> None:
    """DeepSpeed's map holds PipelineEngine's functions; an engine's must hold its own
    overrides, for DeepSpeed's classes (eval_batch's InferenceSchedule) and the plan's."""
    handlers = RedundantPipelineEngine.instruction_handlers()
    for ours, theirs in [
        (pi.ForwardPass, ds_schedule.ForwardPass),
        (pi.BackwardPass, ds_schedule.BackwardPass),
        (pi.OptimizerStep, ds_schedule.OptimizerStep),
        (pi.ReduceGrads, ds_schedule.ReduceGrads),
        (pi.ReduceTiedGrads, ds_schedule.ReduceTiedGrads),
    ]:
        name = PipelineEngine._INSTRUCTION_MAP[theirs].__name__
        assert handlers[ours] is handlers[theirs] is getattr(RedundantPipelineEngine, name)
    assert handlers[pi.ForwardPass] is not PipelineEngine._exec_forward_pass
    assert set(pi.DEEPSPEED_INSTRUCTIONS) <= set(handlers)
    assert set(PipelineEngine._INSTRUCTION_MAP) <= set(handlers)


def test_no_module_extends_a_map_when_imported() -> None:
    """The redundant engine's instructions are its own: importing its module (done above)
    left the plain engine's handlers and DeepSpeed's class-level map as they were."""
    plain = SpotlinePipelineEngine.instruction_handlers()
    assert pi.StashOutput not in plain and pi.ReplicaStep not in plain
    assert pi.BeginLogicalWorker in plain
    assert "_INSTRUCTION_MAP" not in vars(SpotlinePipelineEngine)
    assert "_INSTRUCTION_MAP" not in vars(RedundantPipelineEngine)
    assert all(cls.__module__.startswith("deepspeed") for cls in PipelineEngine._INSTRUCTION_MAP)


class _StandIn:
    """What ``_train_schedule`` reads of an engine, around a given plan and handlers."""

    def __init__(self, plan: Schedule, handlers: dict[type, typing.Any]) -> None:
        self._plan = plan
        self._lowered: dict[int, typing.Any] = {}
        self.stage_id = 0
        self.hosted_logical_workers = (0,)
        self._INSTRUCTION_MAP = handlers

    def _sends_untied_early(self) -> bool:
        return False

    def _streams_untied(self) -> bool:
        return False


def test_a_schedule_with_an_instruction_no_handler_runs_is_refused_before_it_runs() -> None:
    """An engine whose handlers miss a type its schedule lowers to fails when it lowers
    the schedule, naming the type, not halfway through a step."""
    lazy = add_redundancy(train_schedule(2, 2), "lazy")
    plain = SpotlinePipelineEngine.instruction_handlers()
    with pytest.raises(AssertionError, match="no handler for .*ReplicaStep"):
        MethodType(SpotlinePipelineEngine._train_schedule, _StandIn(lazy, plain))()
    redundant = RedundantPipelineEngine.instruction_handlers()
    lowered = MethodType(SpotlinePipelineEngine._train_schedule, _StandIn(lazy, redundant))()
    assert pi.ReplicaStep in lowered.instruction_types() <= set(redundant)


def test_instruction_kwargs_leave_defaults_out_as_deepspeeds_do() -> None:
    """DeepSpeed calls a handler with the instruction's kwargs: the split reductions'
    ``part`` only where it is not the whole."""
    assert pi.ReduceGrads().kwargs == {} == ds_schedule.ReduceGrads().kwargs
    assert pi.ReduceGrads(pi.GradPart.TIED).kwargs == {"part": pi.GradPart.TIED}
    assert (
        pi.ForwardPass(1).kwargs == {"buffer_id": 1} == ds_schedule.ForwardPass(buffer_id=1).kwargs
    )
    assert pi.StashOutput(1, 5).kwargs == {"buffer_id": 1, "micro_batch_id": 5}
    assert pi.KeepLogicalGradients(2).kwargs == {"index": 2}
    assert pi.ForwardPass(0) != pi.BackwardPass(0) and pi.ForwardPass(0).name == "ForwardPass"


def test_the_redundancy_mode_is_declared_once() -> None:
    """One declaration, in the plan, which the config imports (an equal Literal declared
    again would be the same cached object at run time: the source is what tells)."""
    import ast
    from pathlib import Path

    from spotline.plan.redundancy_mode import redundancy_on

    package = Path(__file__).resolve().parents[1] / "integration"
    declared = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "RedundancyMode" for t in node.targets)
    ]
    assert declared == ["plan/redundancy_mode.py"]
    assert typing.get_type_hints(RedundancySection)["mode"] is RedundancyMode
    assert [redundancy_on(m) for m in REDUNDANCY_MODES] == [False, True, True]
