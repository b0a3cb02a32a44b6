"""The one step loop (spotline.worker.loop): its contract, and that every entry point trains through it.

That the two entry points compute the same bits through it is checked end to end by
tests/test_train.py::test_deepspeed_launcher_runs_the_same_code_path (`deepspeed
launch/train.py` and `spotline train` end with the same param_sha256); the checks here are
cheap (no processes) and fail as soon as one path stops calling the shared loop.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable

from spotline.launch import elastic_worker
from spotline.launch.bench import stock_worker
from spotline.worker import elastic
from spotline.worker import launched as trainer
from spotline.worker.loop import StepDone, StepHooks, StepLog, run_steps, slow_machine


class _Recorder(StepHooks):
    def __init__(self, name: str, events: list[tuple[str, str, int]], stop_at: int | None) -> None:
        self.name = name
        self.events = events
        self.stop_at = stop_at

    def before_step(self, step: int) -> bool:
        self.events.append((self.name, "before", step))
        return step == self.stop_at

    def after_step(self, done: StepDone) -> None:
        self.events.append((self.name, "after", done.step))


def test_run_steps_calls_hooks_in_order_and_stops_at_a_boundary() -> None:
    events: list[tuple[str, str, int]] = []
    ran: list[int] = []

    def step_fn(step: int) -> float:
        ran.append(step)
        return float(step) / 2

    log = StepLog()
    end = run_steps(
        step_fn,
        start=2,
        stop=10,
        hooks=[_Recorder("a", events, None), log, _Recorder("b", events, 4)],
    )
    assert end.stopped_at == 4 and ran == [2, 3]
    assert events == [
        ("a", "before", 2),
        ("b", "before", 2),
        ("a", "after", 2),
        ("b", "after", 2),
        ("a", "before", 3),
        ("b", "before", 3),
        ("a", "after", 3),
        ("b", "after", 3),
        ("a", "before", 4),
        ("b", "before", 4),
    ]
    assert log.losses == {2: 1.0, 3: 1.5} and sorted(log.step_times) == [2, 3]


def test_run_steps_without_a_stop_runs_every_step() -> None:
    log = StepLog()
    end = run_steps(float, start=0, stop=3, hooks=[log])
    assert end.stopped_at is None and log.losses == {0: 0.0, 1: 1.0, 2: 2.0}


def test_slow_machine_hook_reports_the_slowed_time() -> None:
    told: list[tuple[int, float]] = []
    slow_machine(3.0, lambda worker, seconds: told.append((worker, seconds)))(5, 0.001)
    assert told == [(5, 0.001 * 3.0)]


def _calls(function: Callable[..., object]) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    return names


def test_both_entry_points_and_the_baseline_train_through_the_one_loop() -> None:
    # deepspeed launch/train.py -> launch/worker.py -> trainer.run_worker
    assert "train_engine" in _calls(trainer.run_worker)
    # spotline train -> launch/elastic_worker.py -> ElasticWorker.run -> ... -> _train
    assert "train_engine" in _calls(elastic.ElasticWorker._train)
    assert "ElasticWorker" in _calls(elastic_worker.main)
    assert "run_steps" in _calls(stock_worker.run)
    # No second loop over the training steps left in either path.
    for function in (trainer.run_worker, elastic.ElasticWorker._train, stock_worker.run):
        assert "for step in range" not in inspect.getsource(function)
