"""The global sampler and the logical-worker assignment (pure planning code, milliseconds)."""

from collections import Counter

import pytest
from conftest import sampler_strategy
from hypothesis import given, settings
from hypothesis import strategies as st

from spotline.plan.logical import assign_logical_workers, moves, rebalance
from spotline.plan.sampler import GlobalSampler

FAST = settings(max_examples=200, deadline=None)


def samplers():  # the shared strategy, with this module's bounds
    return sampler_strategy(max_logical_workers=6, max_micro_batch_size=4, max_steps=5, max_tail=7)


def _epoch_indices(sampler: GlobalSampler, epoch: int) -> list[int]:
    out: list[int] = []
    first = epoch * sampler.steps_per_epoch
    for step in range(first, first + sampler.steps_per_epoch):
        for worker in range(sampler.num_logical_workers):
            for mb in range(sampler.num_micro_batches):
                out.extend(sampler.indices(step, worker, mb))
    return out


@FAST
@given(samplers(), st.integers(0, 3))
def test_one_epoch_reads_each_sample_at_most_once(sampler: GlobalSampler, epoch: int) -> None:
    seen = _epoch_indices(sampler, epoch)
    assert len(seen) == sampler.steps_per_epoch * sampler.samples_per_step
    assert len(set(seen)) == len(seen)
    assert all(0 <= i < sampler.num_samples for i in seen)
    # Only the dropped tail of the permutation is missing.
    dropped = set(sampler.epoch_permutation(epoch)[len(seen) :])
    assert set(seen) | dropped == set(range(sampler.num_samples))


def test_sizes_and_epochs() -> None:
    sampler = GlobalSampler(100, 4, 2, 3, seed=7)
    assert sampler.samples_per_step == 24
    assert sampler.steps_per_epoch == 4
    assert [sampler.epoch_of(s) for s in (0, 3, 4, 9)] == [0, 0, 1, 2]
    assert len(sampler.indices(5, 3, 2)) == 2


def test_epochs_and_seeds_differ_and_repeat() -> None:
    a = GlobalSampler(64, 2, 4, 2, seed=1)
    b = GlobalSampler(64, 2, 4, 2, seed=2)
    assert a.epoch_permutation(0) != a.epoch_permutation(1)
    assert a.epoch_permutation(0) != b.epoch_permutation(0)
    assert a.indices(3, 1, 1) == GlobalSampler(64, 2, 4, 2, seed=1).indices(3, 1, 1)


def test_permutation_is_pinned() -> None:
    # The sample order is part of the reproducibility promise: a change here changes every run.
    sampler = GlobalSampler(10, 1, 2, 1, seed=0)
    assert sampler.epoch_permutation(0) == (0, 4, 9, 6, 5, 7, 3, 2, 1, 8)
    assert sampler.epoch_permutation(1) == (5, 6, 8, 1, 2, 3, 7, 4, 9, 0)
    assert sampler.indices(0, 0, 0) == (0, 4)
    assert sampler.indices(1, 0, 0) == (9, 6)
    assert sampler.indices(5, 0, 0) == (5, 6)  # step 5 is the first of epoch 1
    wide = GlobalSampler(10, 2, 2, 2, seed=0)
    # Logical-worker-major: worker 1's micro-batch 0 follows worker 0's two micro-batches.
    assert wide.indices(0, 1, 0) == (5, 7)


@pytest.mark.parametrize(
    "args",
    [
        (0, 1, 1, 1, 0),
        (10, 0, 1, 1, 0),
        (10, 1, 0, 1, 0),
        (10, 1, 1, 0, 0),
        (10, 2, 3, 2, 0),  # 10 samples cannot fill a step of 12
        (10, True, 1, 1, 0),
    ],
)
def test_invalid_sizes_raise(args: tuple[int, int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        GlobalSampler(*args)


def test_too_small_names_the_sizes() -> None:
    with pytest.raises(ValueError, match="10 samples cannot fill one step of 12"):
        GlobalSampler(10, 2, 3, 2, seed=0)


def test_invalid_indices_raise() -> None:
    sampler = GlobalSampler(100, 4, 2, 3, seed=7)
    for step, worker, mb in [(-1, 0, 0), (0, 4, 0), (0, -1, 0), (0, 0, 3), (0, 0, -1)]:
        with pytest.raises(ValueError):
            sampler.indices(step, worker, mb)


# --- logical-worker assignment -------------------------------------------------------------


def _check_assignment(assignment: dict[str, tuple[int, ...]], num_logical_workers: int) -> None:
    placed = [w for ws in assignment.values() for w in ws]
    assert sorted(placed) == list(range(num_logical_workers))


def test_proportional_assignment() -> None:
    assignment = assign_logical_workers(12, {"a": 2.0, "b": 1.0, "c": 1.0})
    assert assignment == {"a": (0, 1, 2, 3, 4, 5), "b": (6, 7, 8), "c": (9, 10, 11)}
    half = assign_logical_workers(9, {"fast": 1.0, "slow": 0.5})
    assert half == {"fast": (0, 1, 2, 3, 4, 5), "slow": (6, 7, 8)}


def test_largest_remainder_ties_go_to_smaller_process_id() -> None:
    assert assign_logical_workers(4, {"b": 1.0, "a": 1.0, "c": 1.0}) == {
        "a": (0, 1),
        "b": (2,),
        "c": (3,),
    }


def test_every_process_gets_one_when_possible() -> None:
    assignment = assign_logical_workers(3, {"a": 100.0, "b": 1.0, "c": 1.0})
    assert assignment == {"a": (0,), "b": (1,), "c": (2,)}
    # Fewer logical workers than processes: some processes run nothing.
    sparse = assign_logical_workers(2, {"a": 1.0, "b": 1.0, "c": 1.0})
    _check_assignment(sparse, 2)
    assert sum(1 for ws in sparse.values() if not ws) == 1


@pytest.mark.parametrize(
    "num_logical_workers, speeds",
    [(0, {"a": 1.0}), (2, {}), (2, {"a": 0.0}), (2, {"a": -1.0}), (2, {"a": float("nan")})],
)
def test_assignment_rejects_bad_input(num_logical_workers: int, speeds: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        assign_logical_workers(num_logical_workers, speeds)


def test_rebalance_keeps_an_unchanged_assignment() -> None:
    speeds = {"a": 3.0, "b": 1.0, "c": 2.0}
    current = assign_logical_workers(8, speeds)
    assert rebalance(current, speeds) == current
    assert moves(current, rebalance(current, speeds)) == []


def test_rebalance_after_a_loss_moves_only_the_lost_workers() -> None:
    current = assign_logical_workers(8, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0})
    after = rebalance(current, {"a": 1.0, "b": 1.0, "d": 1.0})
    _check_assignment(after, 8)
    moved = moves(current, after)
    assert sorted(w for w, _, _ in moved) == list(current["c"])
    assert all(source == "c" for _, source, _ in moved)
    for p in ("a", "b", "d"):
        assert set(current[p]) <= set(after[p])


def test_rebalance_on_arrival_takes_from_the_busiest() -> None:
    current = {"a": (0, 1, 2, 3), "b": (4, 5)}
    after = rebalance(current, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert after == {"a": (0, 1), "b": (4, 5), "c": (2, 3)}
    assert moves(current, after) == [(2, "a", "c"), (3, "a", "c")]


def test_rebalance_rejects_a_broken_assignment() -> None:
    with pytest.raises(ValueError):
        rebalance({"a": (0, 1), "b": (1,)}, {"a": 1.0})
    with pytest.raises(ValueError):
        rebalance({"a": (0, 2)}, {"a": 1.0})


# --- rescales do not change what is read ---------------------------------------------------

PROCESS_IDS = ["p0", "p1", "p2", "p3", "p4"]


@st.composite
def rescale_runs(
    draw: st.DrawFn,
) -> tuple[GlobalSampler, int, list[tuple[int, dict[str, float]]]]:
    sampler = draw(samplers())
    num_steps = draw(st.integers(1, 3 * sampler.steps_per_epoch))
    num_events = draw(st.integers(0, 6))
    events: list[tuple[int, dict[str, float]]] = []
    for _ in range(num_events):
        step = draw(st.integers(0, num_steps - 1))
        live = draw(st.lists(st.sampled_from(PROCESS_IDS), min_size=1, max_size=5, unique=True))
        speeds = {p: draw(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])) for p in live}
        events.append((step, speeds))
    events.sort(key=lambda event: event[0])
    return sampler, num_steps, events


def _simulate(
    sampler: GlobalSampler, num_steps: int, events: list[tuple[int, dict[str, float]]]
) -> dict[int, Counter[int]]:
    """Samples read per epoch when processes come and go at the given steps."""
    assignment = assign_logical_workers(sampler.num_logical_workers, {"p0": 1.0})
    per_epoch: dict[int, Counter[int]] = {}
    pending = list(events)
    for step in range(num_steps):
        while pending and pending[0][0] == step:
            _, speeds = pending.pop(0)
            before = assignment
            assignment = rebalance(assignment, speeds)
            assert set(assignment) == set(speeds)
            # Every move names the new owner; lost processes own nothing afterwards.
            for _, _, target in moves(before, assignment):
                assert target in speeds
        _check_assignment(assignment, sampler.num_logical_workers)
        epoch = sampler.epoch_of(step)
        for process_id in sorted(assignment):
            for worker in assignment[process_id]:
                for mb in range(sampler.num_micro_batches):
                    per_epoch.setdefault(epoch, Counter()).update(sampler.indices(step, worker, mb))
    return per_epoch


@FAST
@given(rescale_runs())
def test_rescales_do_not_change_what_is_read(
    run: tuple[GlobalSampler, int, list[tuple[int, dict[str, float]]]],
) -> None:
    sampler, num_steps, events = run
    rescaled = _simulate(sampler, num_steps, events)
    static = _simulate(sampler, num_steps, [])
    assert rescaled == static
    for epoch, counts in rescaled.items():
        assert max(counts.values()) == 1, f"epoch {epoch} reads a sample twice"
        steps_in_epoch = min(num_steps, (epoch + 1) * sampler.steps_per_epoch) - (
            epoch * sampler.steps_per_epoch
        )
        assert sum(counts.values()) == steps_in_epoch * sampler.samples_per_step
