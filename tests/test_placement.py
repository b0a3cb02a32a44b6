"""Placement of the logical topology on live workers: spotline.plan.placement."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spotline.plan.placement import (
    FailoverPlan,
    FatalLoss,
    LogicalTopology,
    Placement,
    StateTransfer,
    Takeover,
    initial_placement,
    is_degraded,
    on_arrival,
    on_failure,
    rebalance,
)

TOPOLOGY = LogicalTopology(num_stages=4, num_pipelines=2)


def workers(count: int) -> list[str]:
    return [f"w{i}" for i in range(count)]


def failover(placement: Placement, lost: list[str], *, elastic: bool = False) -> FailoverPlan:
    plan = on_failure(placement, lost, elastic=elastic)
    assert isinstance(plan, FailoverPlan)
    return plan


def test_topology_validates() -> None:
    assert LogicalTopology(8, 8).num_slots == 64
    for bad in ((0, 1), (1, 0), (True, 1)):
        with pytest.raises(ValueError):
            LogicalTopology(*bad)


def test_initial_placement_fills_pipelines_in_order() -> None:
    placement = initial_placement(TOPOLOGY, workers(10))
    assert placement.stage_owners == (("w0", "w1", "w2", "w3"), ("w4", "w5", "w6", "w7"))
    assert placement.standby == ("w8", "w9")
    # Bamboo's ring: the owner of stage s-1 holds stage s's replica.
    assert [placement.replica_holder(0, s) for s in range(4)] == ["w3", "w0", "w1", "w2"]
    assert not is_degraded(placement)
    partial = initial_placement(TOPOLOGY, workers(6))
    assert partial.active_pipelines == (0,) and partial.dissolved_pipelines == (1,)
    assert partial.standby == ("w4", "w5")
    with pytest.raises(ValueError, match="waiting for workers"):
        initial_placement(TOPOLOGY, workers(3))
    with pytest.raises(ValueError, match="unique"):
        initial_placement(TOPOLOGY, ["a", "a", "b", "c"])


def test_placement_validation() -> None:
    with pytest.raises(ValueError, match="too many stages"):
        Placement(TOPOLOGY, (("a", "b", "c", "d"), ("a", "e", "f", "g")))
    with pytest.raises(ValueError, match="not neighbours"):
        Placement(TOPOLOGY, (("a", "b", "a", "d"), None))
    with pytest.raises(ValueError, match="standby"):
        Placement(TOPOLOGY, (("a", "b", "c", "d"), None), ("a",))
    with pytest.raises(ValueError, match="active pipeline"):
        Placement(TOPOLOGY, (None, None))
    wrapped = Placement(TOPOLOGY, (("a", "b", "c", "a"), None))  # stages 3 and 0 on the ring
    assert wrapped.stages_of("a") == ((0, 0), (0, 3))


def test_single_failure_predecessor_takes_over() -> None:
    placement = initial_placement(TOPOLOGY, workers(8))
    plan = failover(placement, ["w2"])
    assert plan.takeovers == (Takeover(0, 2, "w2", "w1", "w1"),)
    assert not plan.takeovers[0].from_standby
    assert plan.placement.stage_owners[0] == ("w0", "w1", "w1", "w3")
    assert plan.placement.stage_owners[1] == placement.stage_owners[1]
    assert is_degraded(plan.placement)
    # The doubled-up worker holds no replica: stages 2 and 3 are unprotected.
    assert plan.placement.unprotected() == ((0, 2), (0, 3))
    assert plan.replica_builds == ()


def test_standby_fills_the_hole_from_the_replica_holder() -> None:
    placement = initial_placement(TOPOLOGY, workers(9))
    plan = failover(placement, ["w2"])
    assert plan.takeovers == (Takeover(0, 2, "w2", "w8", "w1"),)
    assert plan.takeovers[0].from_standby
    assert plan.placement.stage_owners[0] == ("w0", "w1", "w8", "w3")
    assert plan.placement.standby == ()
    # w8 now holds stage 3's replica, which was on the lost w2: it must be rebuilt.
    assert plan.replica_builds == (StateTransfer(0, 3, "w3", "w8", "replica"),)
    assert not is_degraded(plan.placement)


def test_adjacent_failure_is_fatal() -> None:
    placement = initial_placement(TOPOLOGY, workers(10))
    result = on_failure(placement, ["w2", "w1"])
    assert result == FatalLoss(("w1", "w2"), ((0, 2),))
    # A doubled-up worker's loss is fatal too: stage 1 still has its replica on w0, but
    # stage 2 had its only other copy on w1 itself.
    doubled = failover(initial_placement(TOPOLOGY, workers(8)), ["w2"]).placement
    assert on_failure(doubled, ["w1"]) == FatalLoss(("w1",), ((0, 2),))
    # And so is losing the successor of a takeover (its replica holder is doubled up).
    assert on_failure(doubled, ["w3"]) == FatalLoss(("w3",), ((0, 3),))


def test_elastic_dissolves_only_the_broken_pipeline() -> None:
    placement = initial_placement(TOPOLOGY, workers(8))
    plan = failover(placement, ["w1", "w2"], elastic=True)
    assert plan.dissolved_pipelines == (0,)
    assert plan.placement.stage_owners == (None, ("w4", "w5", "w6", "w7"))
    assert plan.placement.standby == ("w0", "w3")
    both = on_failure(placement, ["w1", "w2", "w5", "w6"], elastic=True)
    assert both == FatalLoss(("w1", "w2", "w5", "w6"), ((0, 2), (1, 2)))


def test_unknown_and_standby_losses() -> None:
    placement = initial_placement(TOPOLOGY, workers(10))
    plan = failover(placement, ["w9", "stranger"])
    assert plan.lost == ("w9",)
    assert not plan.owners_lost
    assert plan.placement.standby == ("w8",)


def test_arrival_relieves_doubled_worker_first() -> None:
    doubled = failover(initial_placement(TOPOLOGY, workers(8)), ["w2"]).placement
    plan = on_arrival(doubled, ["n1", "n2"])
    assert plan.placement.stage_owners[0] == ("w0", "w1", "n1", "w3")
    assert plan.placement.standby == ("n2",)
    assert plan.transfers == (
        StateTransfer(0, 2, "w1", "n1", "stage"),
        StateTransfer(0, 3, "w3", "n1", "replica"),
    )
    assert not is_degraded(plan.placement)
    assert plan.placement.unprotected() == ()


def test_arrival_relieves_a_takeover_across_the_ring_wrap() -> None:
    doubled = failover(initial_placement(TOPOLOGY, workers(8)), ["w0"]).placement
    assert doubled.stage_owners[0] == ("w3", "w1", "w2", "w3")
    plan = on_arrival(doubled, ["n1"])
    assert plan.placement.stage_owners[0] == ("n1", "w1", "w2", "w3")


def test_arrival_rebuilds_a_dissolved_pipeline_from_a_peer() -> None:
    dissolved = failover(initial_placement(TOPOLOGY, workers(8)), ["w1", "w2"], elastic=True)
    plan = on_arrival(dissolved.placement, ["n1", "n2", "n3"])
    # Standby queue: w0, w3 (survivors), then n1, n2, n3: four of them rebuild pipeline 0.
    assert plan.placement.stage_owners[0] == ("w0", "w3", "n1", "n2")
    assert plan.placement.standby == ("n3",)
    stage_moves = [t for t in plan.transfers if t.what == "stage"]
    assert stage_moves == [
        StateTransfer(0, s, f"w{4 + s}", worker, "stage")
        for s, worker in enumerate(("w0", "w3", "n1", "n2"))
    ]
    few = on_arrival(dissolved.placement, ["n1"])
    assert few.placement.standby == ("w0", "w3", "n1") and not few.changed
    with pytest.raises(ValueError, match="new and unique"):
        on_arrival(dissolved.placement, ["w4"])


def test_decisions_are_deterministic() -> None:
    first = initial_placement(LogicalTopology(8, 8), workers(70))
    second = initial_placement(LogicalTopology(8, 8), workers(70))
    lost = ["w3", "w20", "w45", "w66"]
    assert on_failure(first, lost) == on_failure(second, list(reversed(lost)))
    plan = failover(first, lost)
    assert rebalance(plan.placement) == rebalance(failover(second, lost).placement)


@settings(max_examples=150, deadline=None)
@given(
    num_stages=st.integers(1, 5),
    num_pipelines=st.integers(1, 4),
    extra=st.integers(0, 6),
    elastic=st.booleans(),
    operations=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 60), max_size=4)), max_size=25
    ),
)
def test_every_stage_has_one_live_owner_or_the_loss_is_fatal(
    num_stages: int,
    num_pipelines: int,
    extra: int,
    elastic: bool,
    operations: list[tuple[bool, list[int]]],
) -> None:
    topology = LogicalTopology(num_stages, num_pipelines)
    live = workers(topology.num_slots + extra)
    placement = initial_placement(topology, live)
    next_id = len(live)
    for is_failure, picks in operations:
        if is_failure:
            members = sorted(placement.workers)
            lost = sorted({members[i % len(members)] for i in picks})
            result = on_failure(placement, lost, elastic=elastic)
            live = [w for w in live if w not in lost]
            if isinstance(result, FatalLoss):
                for pipeline, stage in result.unrecoverable:
                    assert placement.owner(pipeline, stage) in lost
                    holder = placement.replica_holder(pipeline, stage)
                    assert holder is None or holder in lost
                if len(live) < num_stages:
                    return
                placement = initial_placement(topology, live)
                continue
            new = result.placement
            for takeover in result.takeovers:
                assert takeover.from_worker in lost
                assert takeover.state_source == placement.replica_holder(
                    takeover.pipeline, takeover.stage
                )
        else:
            arriving = [f"n{next_id + i}" for i in range(len(picks))]
            next_id += len(picks)
            live.extend(arriving)
            new = on_arrival(placement, arriving).placement
        # Nobody is lost or forgotten: the placement holds exactly the live workers.
        assert new.workers == frozenset(live)
        owned = [
            (pipeline, stage) for worker in new.workers for pipeline, stage in new.stages_of(worker)
        ]
        expected = [(p, s) for p in new.active_pipelines for s in range(num_stages)]
        assert sorted(owned) == expected  # each active (pipeline, stage) exactly once
        assert all(len(new.stages_of(w)) <= 2 for w in new.workers)
        assert elastic or new.active_pipelines == placement.active_pipelines or not is_failure
        placement = new
