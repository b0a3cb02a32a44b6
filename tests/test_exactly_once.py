"""Every sample of an epoch is trained on exactly once, across any rescales and rollbacks.

Pure planning code (``spotline.plan.logical`` and ``spotline.plan.sampler``): no processes,
no torch; the whole file runs in seconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import pytest
from conftest import sampler_strategy
from hypothesis import given, settings
from hypothesis import strategies as st

from spotline.plan.logical import (
    Event,
    Rescale,
    Rollback,
    RunPlan,
    WorkItem,
    assign_logical_workers,
    plan_run,
    samples_by_epoch,
    step_work,
)
from spotline.plan.sampler import GlobalSampler

PROPERTIES = settings(max_examples=150, deadline=None)

# --- the checkers (plain asserts, so a test can show that they fail) -----------------------


def check_partition(assignment: Mapping[str, tuple[int, ...]], num_logical_workers: int) -> None:
    """Every logical worker is placed on exactly one process."""
    placed = Counter(w for ws in assignment.values() for w in ws)
    twice = sorted(w for w, n in placed.items() if n > 1)
    assert not twice, f"logical workers {twice} are placed more than once"
    missing = sorted(set(range(num_logical_workers)) - set(placed))
    assert not missing, f"logical workers {missing} are placed nowhere"
    extra = sorted(set(placed) - set(range(num_logical_workers)))
    assert not extra, f"logical workers {extra} do not exist"


def check_step_work(
    sampler: GlobalSampler,
    step: int,
    assignment: Mapping[str, tuple[int, ...]],
    work: Mapping[str, tuple[WorkItem, ...]],
) -> None:
    """``work`` runs each logical worker of the step once, on its process, in order."""
    assert set(work) == set(assignment), "work and assignment name different processes"
    ran = Counter(w for items in work.values() for w, _, _ in items)
    num_mb = sampler.num_micro_batches
    twice = sorted(w for w, n in ran.items() if n > num_mb)
    assert not twice, f"logical workers {twice} run more than once in step {step}"
    skipped = sorted(w for w in range(sampler.num_logical_workers) if ran[w] < num_mb)
    assert not skipped, f"logical workers {skipped} are skipped (or cut short) in step {step}"
    for process_id, items in work.items():
        expected = [(w, mb) for w in sorted(assignment[process_id]) for mb in range(num_mb)]
        assert [(w, mb) for w, mb, _ in items] == expected, f"{process_id!r} runs out of order"
        for w, mb, indices in items:
            assert indices == sampler.indices(step, w, mb), f"wrong samples for ({w}, {mb})"


def check_epochs(sampler: GlobalSampler, num_steps: int, epochs: dict[int, list[int]]) -> None:
    """Full epochs use each kept sample once and the dropped tail never; no epoch repeats one."""
    steps_per_epoch, per_step = sampler.steps_per_epoch, sampler.samples_per_step
    last_epoch = sampler.epoch_of(num_steps - 1) if num_steps else -1
    assert sorted(epochs) == list(range(last_epoch + 1))
    for epoch, samples in epochs.items():
        counts = Counter(samples)
        repeated = sorted(i for i, n in counts.items() if n > 1)
        assert not repeated, f"epoch {epoch} trains on samples {repeated} more than once"
        permutation = sampler.epoch_permutation(epoch)
        steps_run = min(num_steps - epoch * steps_per_epoch, steps_per_epoch)
        assert sorted(samples) == sorted(permutation[: steps_run * per_step])
        if steps_run == steps_per_epoch:
            kept = steps_per_epoch * per_step
            assert not set(samples) & set(permutation[kept:]), "the dropped tail was used"


def check_plan(sampler: GlobalSampler, run_plan: RunPlan) -> None:
    """Each attempt runs a partition; each step commits exactly once."""
    for attempt in run_plan.attempts:
        check_partition(attempt.assignment, sampler.num_logical_workers)
        work = step_work(sampler, attempt.step, attempt.assignment)
        check_step_work(sampler, attempt.step, attempt.assignment, work)
    committed = Counter(a.step for a in run_plan.attempts if a.committed)
    assert committed == Counter(range(run_plan.num_steps))
    for step in range(run_plan.num_steps):
        last = [a for a in run_plan.attempts if a.step == step][-1]
        assert last.committed, f"step {step}: only its last execution counts"


def step_samples(
    sampler: GlobalSampler, run_plan: RunPlan
) -> dict[int, dict[tuple[int, int], tuple[int, ...]]]:
    """Committed step -> {(logical worker, micro-batch): sample indices}."""
    out: dict[int, dict[tuple[int, int], tuple[int, ...]]] = {}
    for attempt in run_plan.committed():
        work = step_work(sampler, attempt.step, attempt.assignment)
        out[attempt.step] = {(w, mb): ix for items in work.values() for w, mb, ix in items}
    return out


# --- strategies ----------------------------------------------------------------------------


def samplers():  # the shared strategy, with this module's bounds
    return sampler_strategy(max_logical_workers=10, max_micro_batch_size=3, max_steps=4, max_tail=5)


# Very uneven speeds on purpose: a process 10^12 times faster than another still leaves the
# slow one a logical worker when there are enough.
speeds = st.one_of(
    st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False),
    st.sampled_from([1e-12, 1e-3, 1.0, 1.0, 2.0, 1e3, 1e12]),
)


@st.composite
def process_sets(draw: st.DrawFn, pool: list[str]) -> dict[str, float]:
    live = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=8, unique=True))
    return {p: draw(speeds) for p in live}


@st.composite
def runs(draw: st.DrawFn) -> tuple[GlobalSampler, int, list[Event], dict[str, float]]:
    """A sampler, a run length, a timeline of rescales and rollbacks, and the first processes."""
    sampler = draw(samplers())
    num_steps = draw(st.integers(1, 3 * sampler.steps_per_epoch + 2))
    # Random string ids, drawn from a small pool so that processes leave and come back.
    pool = draw(st.lists(st.text(max_size=4), min_size=1, max_size=10, unique=True))
    initial = draw(process_sets(pool))
    events: list[Event] = []
    position = 0
    for _ in range(draw(st.integers(0, 8))):
        step = draw(st.integers(position, num_steps - 1))
        if draw(st.booleans()):
            events.append(Rescale(step, draw(process_sets(pool))))
            position = step
        else:
            to_step = draw(st.integers(0, step))
            events.append(Rollback(step, to_step))
            position = to_step
    return sampler, num_steps, events, initial


Run = tuple[GlobalSampler, int, list[Event], dict[str, float]]


# --- properties ----------------------------------------------------------------------------


@PROPERTIES
@given(runs())
def test_every_sample_of_an_epoch_is_used_exactly_once(run: Run) -> None:
    sampler, num_steps, events, initial = run
    run_plan = plan_run(sampler, num_steps, events, initial)
    check_epochs(sampler, num_steps, samples_by_epoch(sampler, run_plan))


@PROPERTIES
@given(runs())
def test_each_step_reads_the_same_samples_whatever_the_rescales(run: Run) -> None:
    sampler, num_steps, events, initial = run
    rescaled = plan_run(sampler, num_steps, events, initial)
    static = plan_run(sampler, num_steps, [], {"solo": 1.0})
    assert step_samples(sampler, rescaled) == step_samples(sampler, static)
    assert samples_by_epoch(sampler, rescaled) == samples_by_epoch(sampler, static)


@PROPERTIES
@given(runs())
def test_each_attempt_runs_every_logical_worker_once(run: Run) -> None:
    sampler, num_steps, events, initial = run
    run_plan = plan_run(sampler, num_steps, events, initial)
    check_plan(sampler, run_plan)
    # The processes of each attempt are the ones the latest rescale named.
    live = dict(initial)
    attempts = iter(run_plan.attempts)
    position = 0
    for event in [*events, None]:
        end = num_steps if event is None else event.step
        for _ in range(position, end):
            assert set(next(attempts).assignment) == set(live)
        if isinstance(event, Rescale):
            live, position = dict(event.process_speeds), event.step
        elif isinstance(event, Rollback):
            assert next(attempts).step == event.step
            position = event.to_step
    assert next(attempts, None) is None


@PROPERTIES
@given(runs(), st.data())
def test_the_checker_catches_a_dropped_or_duplicated_logical_worker(
    run: Run, data: st.DataObject
) -> None:
    sampler, num_steps, events, initial = run
    run_plan = plan_run(sampler, num_steps, events, initial)
    attempt = data.draw(st.sampled_from(run_plan.attempts))
    good = step_work(sampler, attempt.step, attempt.assignment)
    busy = sorted(p for p, items in good.items() if items)
    victim = data.draw(st.sampled_from(busy))
    dropped = {**good, victim: good[victim][: -sampler.num_micro_batches]}
    with pytest.raises(AssertionError, match="skipped"):
        check_step_work(sampler, attempt.step, attempt.assignment, dropped)
    other = data.draw(st.sampled_from(sorted(good)))
    duplicated = {**good, other: good[other] + good[victim][-sampler.num_micro_batches :]}
    with pytest.raises(AssertionError, match="more than once"):
        check_step_work(sampler, attempt.step, attempt.assignment, duplicated)


# --- examples ------------------------------------------------------------------------------


def test_a_hand_made_bad_assignment_is_caught() -> None:
    sampler = GlobalSampler(48, 3, 2, 2, seed=5)
    good = {"a": (0, 1), "b": (2,)}
    check_partition(good, 3)
    check_step_work(sampler, 0, good, step_work(sampler, 0, good))
    bad_assignments: list[tuple[dict[str, tuple[int, ...]], str]] = [
        ({"a": (0, 1), "b": (1,)}, "more than once"),  # 1 twice, 2 nowhere
        ({"a": (0,), "b": (2,)}, "placed nowhere"),  # 1 dropped
        ({"a": (0, 1), "b": (2, 3)}, "do not exist"),
    ]
    for bad, complaint in bad_assignments:
        with pytest.raises(AssertionError, match=complaint):
            check_partition(bad, 3)
        with pytest.raises(ValueError):
            step_work(sampler, 0, bad)


def test_a_duplicated_sample_fails_the_epoch_check() -> None:
    sampler = GlobalSampler(20, 2, 2, 1, seed=3)  # 5 steps per epoch
    epochs = samples_by_epoch(sampler, plan_run(sampler, 5, [], {"a": 1.0}))
    check_epochs(sampler, 5, epochs)
    with pytest.raises(AssertionError, match="more than once"):
        check_epochs(sampler, 5, {0: epochs[0][:-1] + epochs[0][:1]})


def test_counting_undone_attempts_would_repeat_samples() -> None:
    sampler = GlobalSampler(40, 2, 2, 1, seed=11)  # 10 steps per epoch
    run_plan = plan_run(sampler, 6, [Rollback(4, to_step=2)], {"a": 1.0, "b": 1.0})
    assert [(a.step, a.committed) for a in run_plan.attempts] == [
        (0, True),
        (1, True),
        (2, False),
        (3, False),
        (4, False),  # failed before its commit
        (2, True),
        (3, True),
        (4, True),
        (5, True),
    ]
    every_attempt = [
        i
        for a in run_plan.attempts
        for items in step_work(sampler, a.step, a.assignment).values()
        for _, _, ix in items
        for i in ix
    ]
    assert len(set(every_attempt)) < len(every_attempt)
    check_epochs(sampler, 6, samples_by_epoch(sampler, run_plan))


def test_samples_follow_the_epoch_permutation_in_order() -> None:
    sampler = GlobalSampler(50, 4, 2, 3, seed=7)  # 24 per step, 2 steps per epoch, 2 dropped
    events: list[Event] = [
        Rescale(1, {"fast": 100.0, "slow": 1.0}),
        Rescale(3, {"x": 1.0, "y": 2.0, "z": 3.0}),
        Rollback(4, to_step=1),
        Rescale(1, {"x": 1.0}),
    ]
    epochs = samples_by_epoch(sampler, plan_run(sampler, 5, events, {"a": 1.0, "b": 1.0}))
    assert epochs[0] == list(sampler.epoch_permutation(0)[:48])
    assert epochs[1] == list(sampler.epoch_permutation(1)[:48])
    assert epochs[2] == list(sampler.epoch_permutation(2)[:24])


def test_step_work_runs_workers_and_micro_batches_in_order() -> None:
    sampler = GlobalSampler(100, 4, 2, 3, seed=7)
    work = step_work(sampler, 5, {"b": (3, 1), "a": (2, 0), "idle": ()})
    assert list(work) == ["a", "b", "idle"]
    assert [(w, mb) for w, mb, _ in work["a"]] == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (2, 2)]
    assert work["b"][4] == (3, 1, sampler.indices(5, 3, 1))
    assert work["idle"] == ()


def test_rescales_follow_rebalance_and_processes_come_and_go() -> None:
    sampler = GlobalSampler(64, 4, 1, 1, seed=0)
    events: list[Event] = [Rescale(2, {"a": 1.0, "b": 1.0}), Rescale(3, {"b": 1.0, "c": 3.0})]
    run_plan = plan_run(sampler, 4, events, {"a": 1.0})
    assert [dict(a.assignment) for a in run_plan.attempts] == [
        {"a": (0, 1, 2, 3)},
        {"a": (0, 1, 2, 3)},
        {"a": (0, 1), "b": (2, 3)},
        {"b": (2,), "c": (0, 1, 3)},
    ]
    assert run_plan.attempts[0].assignment == assign_logical_workers(4, {"a": 1.0})
    assert all(a.committed for a in run_plan.attempts)


def test_a_rollback_to_the_same_step_retries_it() -> None:
    sampler = GlobalSampler(16, 2, 1, 1, seed=0)
    run_plan = plan_run(sampler, 3, [Rollback(1, 1), Rollback(1, 1)], {"a": 1.0})
    assert [(a.step, a.committed) for a in run_plan.attempts] == [
        (0, True),
        (1, False),
        (1, False),
        (1, True),
        (2, True),
    ]


def test_events_at_the_same_step_apply_in_order() -> None:
    sampler = GlobalSampler(16, 2, 1, 1, seed=0)
    events: list[Event] = [Rollback(2, 0), Rescale(0, {"b": 1.0}), Rescale(0, {"c": 1.0})]
    run_plan = plan_run(sampler, 3, events, {"a": 1.0})
    assert [(a.step, sorted(a.assignment)) for a in run_plan.attempts] == [
        (0, ["a"]),
        (1, ["a"]),
        (2, ["a"]),
        (0, ["c"]),
        (1, ["c"]),
        (2, ["c"]),
    ]
    check_plan(sampler, run_plan)


def test_a_run_with_no_steps_is_empty() -> None:
    sampler = GlobalSampler(16, 2, 1, 1, seed=0)
    run_plan = plan_run(sampler, 0, [], {"a": 1.0})
    assert run_plan.attempts == ()
    assert samples_by_epoch(sampler, run_plan) == {}


def test_plans_and_events_are_frozen() -> None:
    speeds = {"a": 1.0}
    event = Rescale(0, speeds)
    speeds["b"] = 2.0  # the event keeps its own copy
    assert dict(event.process_speeds) == {"a": 1.0}
    run_plan = plan_run(GlobalSampler(16, 2, 1, 1, seed=0), 1, [event], {"z": 1.0})
    with pytest.raises(AttributeError):
        run_plan.attempts = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        run_plan.attempts[0].assignment["a"] = ()  # type: ignore[index]


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "events, message",
    [
        ([Rescale(5, {"a": 1.0})], r"Rescale\(step=5.*at or after the end"),
        ([Rollback(7, 2)], r"Rollback\(step=7, to_step=2\).*at or after the end"),
        (
            [Rescale(3, {"a": 1.0}), Rescale(2, {"b": 1.0})],
            r"event 1 Rescale\(step=2.*out of order",
        ),
        ([Rollback(3, 1), Rollback(0, 0)], r"event 1 Rollback\(step=0.*reached step 1"),
        ([Rollback(4, 4), Rescale(3, {"a": 1.0})], r"event 1 .*out of order"),
        ([(1, {"a": 1.0})], r"event 0 must be a Rescale or a Rollback"),
    ],
)
def test_plan_run_rejects_bad_events(events: list[Event], message: str) -> None:
    sampler = GlobalSampler(64, 2, 1, 1, seed=0)
    with pytest.raises(ValueError, match=message):
        plan_run(sampler, 5, events, {"a": 1.0})


def test_bad_events_are_rejected_when_made() -> None:
    with pytest.raises(ValueError, match=r"Rollback\(step=2, to_step=3\).*to_step must be <= step"):
        Rollback(2, 3)
    with pytest.raises(ValueError, match="Rollback to_step"):
        Rollback(2, -1)
    with pytest.raises(ValueError, match="Rescale step"):
        Rescale(-1, {"a": 1.0})
    with pytest.raises(ValueError, match="Rescale step"):
        Rescale(True, {"a": 1.0})
    with pytest.raises(ValueError, match="at least one process"):
        Rescale(0, {})
    with pytest.raises(ValueError, match="finite and > 0"):
        Rescale(0, {"a": 0.0})


def test_plan_run_rejects_bad_runs() -> None:
    sampler = GlobalSampler(64, 2, 1, 1, seed=0)
    with pytest.raises(ValueError, match="num_steps"):
        plan_run(sampler, -1, [], {"a": 1.0})
    with pytest.raises(ValueError, match="at least one process"):
        plan_run(sampler, 3, [], {})
    other = GlobalSampler(64, 4, 1, 1, seed=0)
    with pytest.raises(ValueError, match="the plan is for 2 logical workers"):
        samples_by_epoch(other, plan_run(sampler, 3, [], {"a": 1.0}))
