"""The exposure rule (spotline.plan.exposure): which plans leave a stage few copies, and the
checkpoints that follow from it, the coordinator's and the simulator's alike."""

from __future__ import annotations

import math

import pytest

from spotline.plan.exposure import (
    EXPOSED_DOMAINS,
    exposed_interval_s,
    exposed_stages,
    first_exposure,
    is_burst,
    observed_mtbf_s,
)
from spotline.plan.grid import Layout


def grid(num_stages: int, groups: tuple[tuple[int, ...], ...], pipelines: int) -> Layout:
    """A layout whose worker on (pipeline p, physical stage i) is named ``w{p}.{i}``."""
    slots = tuple(tuple(f"w{p}.{i}" for i in range(len(groups))) for p in range(pipelines))
    return Layout(num_stages, pipelines, groups, slots)


FOUR = ((0,), (1,), (2,), (3,))


def each_worker(worker: str) -> str:
    return worker


def by_pipeline(worker: str) -> str:
    """Every pipeline on a machine of its own."""
    return worker.split(".")[0]


def test_one_pipeline_with_its_replicas_is_exposed_at_every_stage() -> None:
    # A stage's copies: its worker and its predecessor's (the replica): two workers.
    assert EXPOSED_DOMAINS == 2
    assert exposed_stages(grid(4, FOUR, 1), each_worker) == (0, 1, 2, 3)


def test_two_pipelines_of_single_workers_are_not_exposed() -> None:
    # Four copies of every stage, on four workers.
    assert exposed_stages(grid(4, FOUR, 2), each_worker) == ()


def test_two_pipelines_on_two_machines_are_exposed() -> None:
    # Four copies, but on the two machines of the two pipelines: one burst of two losses.
    assert exposed_stages(grid(4, FOUR, 2), by_pipeline) == (0, 1, 2, 3)
    # Three pipelines on three machines: a burst must take all three.
    assert exposed_stages(grid(4, FOUR, 3), by_pipeline) == ()


def test_a_stage_with_its_copies_on_two_machines_is_exposed_alone() -> None:
    # Two pipelines; stage 2's worker and its predecessor (stage 1) of both pipelines sit on
    # machines A and B only; every other stage has a copy on a third machine.
    machines = {"w0.0": "C", "w1.0": "C", "w0.1": "A", "w1.1": "B", "w0.2": "A", "w1.2": "B"}
    machines |= {"w0.3": "D", "w1.3": "E"}
    assert exposed_stages(grid(4, FOUR, 2), machines.__getitem__) == (2,)


def test_without_replicas_a_stage_has_only_its_runners_as_copies() -> None:
    layout = grid(4, FOUR, 2)
    assert exposed_stages(layout, each_worker, replicas=False) == (0, 1, 2, 3)
    assert exposed_stages(grid(4, FOUR, 3), each_worker, replicas=False) == ()


def test_merged_stages_count_the_workers_that_run_or_replicate_them() -> None:
    # One physical stage running all four: no replica, two pipelines = two copies.
    one = ((0, 1, 2, 3),)
    assert exposed_stages(grid(4, one, 2), each_worker) == (0, 1, 2, 3)
    assert exposed_stages(grid(4, one, 3), each_worker) == ()
    # Two physical stages of two: each member holds both (its own and its successor's).
    halves = ((0, 1), (2, 3))
    assert exposed_stages(grid(4, halves, 1), each_worker) == (0, 1, 2, 3)
    assert exposed_stages(grid(4, halves, 2), each_worker) == ()


def test_a_burst_takes_two_domains_or_more_at_once() -> None:
    assert not is_burst(["m1"])
    assert not is_burst(["m1", "m1"])  # two workers of one machine: one domain
    assert is_burst(["m1", "m2"])
    assert is_burst(["w3", "w4", "w9"])


def test_the_exposed_interval_is_young_daly_of_the_observed_bursts_capped_by_the_base() -> None:
    assert observed_mtbf_s(1000.0, 0) is None
    assert observed_mtbf_s(1000.0, 5) == 200.0
    # No burst seen: no rate, the base interval.
    assert exposed_interval_s(3600.0, 10.0, 1000.0, 0) == 3600.0
    # 5 bursts in 1000 s: MTBF 200 s, sqrt(2 x 10 x 200) = sqrt(4000).
    assert exposed_interval_s(3600.0, 10.0, 1000.0, 5) == math.sqrt(4000.0)
    # Never longer than the base interval.
    assert exposed_interval_s(30.0, 10.0, 1000.0, 5) == 30.0


@pytest.mark.parametrize(
    ("now", "before", "restarted", "expected"),
    [
        (True, False, False, True),  # just became exposed, state in memory: save now
        (True, True, False, False),  # still exposed: the interval decides
        (False, False, False, False),
        (False, True, False, False),
        (True, False, True, False),  # a restart's state is the checkpoint it read
    ],
)
def test_a_first_exposure_is_exposed_now_not_before_and_held_in_memory(
    now: bool, before: bool, restarted: bool, expected: bool
) -> None:
    assert first_exposure(now, before, restarted=restarted) is expected
