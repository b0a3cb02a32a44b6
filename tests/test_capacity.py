"""Memory capacity (issue 14): no planned worker holds more logical stages than it can, its
own and its replicas; a membership too small waits for capacity or falls back, and says which.

The planner (spotline.plan.layout with spotline.plan.capacity) first, then the simulator's
policies under the same limit (the acceptance test), then the config key.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from spotline.config import parse_config
from spotline.errors import UserError
from spotline.launch.simulate import main as simulate_main
from spotline.plan.capacity import Capacity
from spotline.plan.grid import Layout
from spotline.plan.layout import (
    FatalLoss,
    GenerationPlan,
    WaitForCapacity,
    WorkerReport,
    committed_state,
    contiguous_groupings,
    initial_layout,
    member_holdings,
    plan_generation,
)
from spotline.plan.traces import Trace, TraceEvent
from spotline.sim.calibration import load_calibration
from spotline.sim.results import PolicyResult
from spotline.sim.sim_config import SimConfig
from spotline.sim.simulator import POLICY_MODELS, simulate


def workers(count: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


def most_run(layout: Layout) -> int:
    """The most logical stages a member of ``layout`` runs."""
    return max(len(group) for group in layout.groups)


def capacities() -> st.SearchStrategy[Capacity]:
    return st.builds(Capacity, st.integers(2, 5), st.booleans()) | st.builds(
        lambda c: Capacity(c, replicas=False), st.just(1)
    )


# -- the bound ---------------------------------------------------------------------------------


def test_the_bound_is_exact_against_every_grouping() -> None:
    """``Capacity.allows`` says yes exactly when some contiguous grouping fits, and a worker
    keeps its successor's replica only where the stages it runs leave room."""
    for num_stages in range(1, 9):
        for stages_per_worker, replicas in itertools.product(range(1, 7), (False, True)):
            if replicas and stages_per_worker < 2:
                continue
            capacity = Capacity(stages_per_worker, replicas)
            for num_physical in range(1, num_stages + 1):
                groupings = list(contiguous_groupings(num_stages, num_physical))
                fitting = [g for g in groupings if capacity.fits(g)]
                assert capacity.allows(num_stages, num_physical) == bool(fitting)
                for groups in fitting:
                    for index in range(num_physical):
                        assert capacity.held(groups, index) <= stages_per_worker
            fewest = capacity.fewest_physical_stages(num_stages)
            assert capacity.allows(num_stages, fewest)
            assert fewest == 1 or not capacity.allows(num_stages, fewest - 1)
    two = Capacity(2)
    # One stage each: the stage and its successor's replica, Bamboo's steady state.
    assert [two.held(((0,), (1,), (2,)), i) for i in range(3)] == [2, 2, 2]
    # After a takeover the predecessor runs two stages in the replica's room: no replica.
    takeover = ((0,), (1, 2), (3,))
    assert [two.keeps_replica(takeover, i) for i in range(3)] == [False, False, True]
    assert [two.held(takeover, i) for i in range(3)] == [1, 2, 2]
    assert not two.fits(((0,), (1, 2, 3)))


def test_a_capacity_a_worker_cannot_have_is_refused_in_one_line() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="integer >= 1"):
            Capacity(bad, replicas=False)
    with pytest.raises(ValueError, match="at least 2, or redundancy off"):
        Capacity(1, replicas=True)
    with pytest.raises(ValueError, match="integer >= 1"):
        Capacity(True, replicas=False)  # type: ignore[arg-type]


# -- the planner -------------------------------------------------------------------------------


def test_bamboos_takeover_fits_two_per_worker_and_a_third_stage_waits() -> None:
    """Four stages, one pipeline: w2 lost, its predecessor w1 runs stages 1 and 2 (Bamboo's
    takeover, two stages: the same plan as without a limit); w3 lost next, two workers run
    two stages each. Then one of them lost: the last one holds every stage, but would run
    all four; two per worker waits for a worker with the state kept, four per worker runs."""
    layout = initial_layout(4, 1, workers(4))
    assert layout is not None
    version = 7
    plans = []
    for lost in ({"w2"}, {"w3"}):
        held = member_holdings(layout, version, replicas=True)
        reports = [
            WorkerReport(w, held[w], layout.slot_of(w)) for w in layout.members if w not in lost
        ]
        plan = plan_generation(1, 4, 1, reports, capacity=Capacity(2))
        assert isinstance(plan, GenerationPlan) and plan.layout is not None
        assert plan == plan_generation(1, 4, 1, reports)  # as without a limit
        layout, version = plan.layout, version + 1
        plans.append(layout.groups)
    assert plans == [((0,), (1, 2), (3,)), ((0, 1), (2, 3))]
    held = member_holdings(layout, version, replicas=True)
    last = [WorkerReport("w0", held["w0"], layout.slot_of("w0"))]
    assert len(held["w0"]) == 4
    unlimited = plan_generation(2, 4, 1, last)
    assert isinstance(unlimited, GenerationPlan) and unlimited.layout is not None
    assert unlimited.layout.groups == ((0, 1, 2, 3),)
    waits = plan_generation(2, 4, 1, last, capacity=Capacity(2))
    assert isinstance(waits, WaitForCapacity)
    assert (waits.resume_step, waits.live, waits.needed) == (version, 1, 2)
    assert "waiting for 2" in waits.reason and "state survives" in waits.reason
    assert plan_generation(2, 4, 1, last, capacity=Capacity(4)) == unlimited


def test_a_lost_stage_with_too_few_workers_falls_back_and_says_so() -> None:
    """Owner and replica holder of stage 2 both lost: the state is gone, a fatal loss (the
    checkpoint), whatever the capacity; a restart on one worker then waits for another."""
    layout = initial_layout(4, 1, workers(4))
    assert layout is not None
    held = member_holdings(layout, 7, replicas=True)
    reports = [WorkerReport(w, held[w], layout.slot_of(w)) for w in ("w0", "w3")]
    result = plan_generation(1, 4, 1, reports, capacity=Capacity(2))
    assert isinstance(result, FatalLoss) and result.lost_stages == (2,)
    assert initial_layout(4, 1, ["w0"], elastic=True, capacity=Capacity(2)) is None
    assert initial_layout(4, 1, ["w0", "w3"], elastic=True, capacity=Capacity(2)) is not None
    assert initial_layout(4, 1, ["w0"], elastic=True, capacity=Capacity(4)) is not None


@st.composite
def memberships(draw: st.DrawFn) -> tuple[int, int, list[WorkerReport]]:
    """A layout's survivors after losses and arrivals, some generations on: the planner's
    input in the runtime and the simulator (planned without a limit first, so that the
    holdings are as spread as the old planner left them)."""
    num_stages = draw(st.integers(1, 7))
    num_pipelines = draw(st.integers(1, 3))
    live = workers(num_stages * num_pipelines + draw(st.integers(0, 2)))
    layout = initial_layout(num_stages, num_pipelines, live)
    assert layout is not None
    version = 3
    reports: list[WorkerReport] = []
    for generation in range(draw(st.integers(1, 3))):
        held = member_holdings(layout, version, replicas=True)
        members = list(layout.members)
        lost = set(draw(st.lists(st.sampled_from(members), max_size=len(members))))
        arrivals = workers(draw(st.integers(0, 3)), f"g{generation}n")
        reports = [
            WorkerReport(w, held[w], layout.slot_of(w)) for w in members if w not in lost
        ] + [WorkerReport(w) for w in [*layout.standby, *arrivals]]
        if not reports:
            reports = [WorkerReport("late")]
        unlimited = plan_generation(generation, num_stages, num_pipelines, reports, elastic=True)
        if isinstance(unlimited, FatalLoss) or unlimited.layout is None:
            break
        layout = unlimited.layout
    return num_stages, num_pipelines, reports


@settings(max_examples=400, deadline=None)
@given(membership=memberships(), capacity=capacities(), elastic=st.booleans())
def test_no_planned_worker_ever_holds_more_than_its_capacity(
    membership: tuple[int, int, list[WorkerReport]], capacity: Capacity, elastic: bool
) -> None:
    """Over random memberships, both modes and capacities: a plan within capacity, a wait
    exactly when every stage survives but the live workers are fewer than needed, or a
    fatal loss; and where the planner without a limit stays within it, the same plan."""
    num_stages, num_pipelines, reports = membership
    result = plan_generation(
        9, num_stages, num_pipelines, reports, elastic=elastic, capacity=capacity
    )
    unlimited = plan_generation(9, num_stages, num_pipelines, reports, elastic=elastic)
    needed = capacity.fewest_workers(num_stages, num_pipelines, elastic=elastic)
    event(type(result).__name__)
    if isinstance(result, WaitForCapacity):
        assert not isinstance(committed_state(reports, num_stages), FatalLoss)
        assert result.live == len(reports) < result.needed == needed
        assert isinstance(unlimited, GenerationPlan) and unlimited.layout is not None
        assert most_run(unlimited.layout) > capacity.stages_per_worker
        return
    if isinstance(result, FatalLoss):
        return
    if result.layout is None:  # too few for the rigid pipelines
        assert not elastic and len(reports) < num_pipelines and unlimited == result
        return
    groups = result.layout.groups
    assert most_run(result.layout) <= capacity.stages_per_worker
    assert all(capacity.held(groups, i) <= capacity.stages_per_worker for i in range(len(groups)))
    assert len(reports) >= needed
    if isinstance(unlimited, GenerationPlan) and unlimited.layout is not None:
        if most_run(unlimited.layout) <= capacity.stages_per_worker:
            assert result == unlimited  # the limit changes no plan it does not have to


# -- the acceptance test: a run with fewer workers than the limit allows ----------------------


def _checked(result: PolicyResult, capacity: Capacity) -> int:
    """Every layout the run adopted runs at most ``capacity`` per worker; how many."""
    for planned in result.layouts:
        assert most_run(planned.layout) <= capacity.stages_per_worker, (result.policy, planned)
    return len(result.layouts)


HOUR = 3600.0


def _scarce_trace() -> Trace:
    """gpt2's 8 stages on 8 nodes. 1 h: nodes 1, 3, 5 and 7 preempted (4 left, every stage
    held: n0 holds 0-3, n2 2-5, n4 4-7, n6 6-7 and 0-1). 2 h: n6 preempted (3 left, every
    stage still held). 2.5 h: n0 preempted (stages 0 and 1 lost: n0 ran them and n6 held
    their replica). 3 h: two nodes back (4 workers)."""
    events = [TraceEvent(0.0, "add", f"n{i}") for i in range(8)]
    events += [TraceEvent(HOUR, "remove", f"n{i}") for i in (1, 3, 5, 7)]
    events += [TraceEvent(2 * HOUR, "remove", "n6"), TraceEvent(2.5 * HOUR, "remove", "n0")]
    events += [TraceEvent(3 * HOUR, "add", f"m{i}") for i in range(2)]
    return Trace(tuple(events), 4 * HOUR)


def test_a_run_short_of_workers_waits_or_falls_back_and_never_overfills_a_worker() -> None:
    """Issue 14's acceptance test. Two stages per worker (the default): with 4 workers each
    policy trains, two stages on a worker; with 3 (fewer than the 4 the limit needs) none
    does: the Spotline policies wait with the state kept, then fall back to the checkpoint
    when n0's stages are lost, and restart once 4 workers are back; checkpoint-restart, under
    the same limit, waits too. Without a limit, the Spotline policy ran 3 stages on a
    worker (or more) from 2 h."""
    calibration = load_calibration()
    model = calibration.model("gpt2")
    assert model.num_stages == 8
    trace = _scarce_trace()
    back = 3 * HOUR + calibration.node_ready_s  # when the arrivals are ready
    config = SimConfig(calibration, model, 8, record_layouts=True, record_timeline=True)
    results = {p: simulate(trace, p, config) for p in ("spotline", "spotline-rigid")}
    results["checkpoint-restart"] = simulate(trace, "checkpoint-restart", config)
    for policy, result in results.items():
        capacity = POLICY_MODELS[policy].capacity(config)
        assert capacity.stages_per_worker == 2
        assert _checked(result, capacity) >= 3
        # 4 workers from 1 h: two stages on each.
        scarce = [p for p in result.layouts if HOUR <= p.t_s < 2 * HOUR]
        assert scarce and all(p.layout.groups == ((0, 1), (2, 3), (4, 5), (6, 7)) for p in scarce)
        # Nothing trains from 2 h (3 workers) until the arrivals are ready.
        idle = [p for p in result.timeline if 2 * HOUR <= p.t_s < back]
        assert idle and all(p.samples_per_s == 0 for p in idle), policy
        assert not [p for p in result.layouts if 2 * HOUR <= p.t_s < back], policy
        assert result.waiting_s >= back - 2 * HOUR, policy
        assert [p.t_s for p in result.layouts if p.t_s >= back] == [back], policy
    for policy in ("spotline", "spotline-rigid"):
        # Waiting kept the state until n0 went: one fallback, at 2.5 h.
        spot = results[policy]
        assert (spot.num_fatal_failures, spot.num_failovers) == (1, 2), policy
        assert spot.redone_samples > 0
    # Without a limit the Spotline policy runs 3 stages or more on a worker from 2 h.
    loose = simulate(
        trace,
        "spotline",
        SimConfig(calibration, model, 8, record_layouts=True, stages_per_worker=8),
    )
    assert max(most_run(p.layout) for p in loose.layouts) >= 3
    assert loose.waiting_s < results["spotline"].waiting_s


def test_sim_config_refuses_a_capacity_below_a_stage_and_its_replica() -> None:
    calibration = load_calibration()
    with pytest.raises(ValueError, match="at least 2"):
        SimConfig(calibration, calibration.model("gpt2"), 8, stages_per_worker=1)


# -- the config key ----------------------------------------------------------------------------


def _config(redundancy: dict[str, object]) -> dict[str, object]:
    return {"spotline": {"redundancy": redundancy}}


def test_the_config_key_defaults_to_a_stage_and_its_replica() -> None:
    cfg = parse_config({})
    assert cfg.spotline.redundancy.stages_per_worker == 2
    assert cfg.capacity == Capacity(2, replicas=True)
    assert cfg.spotline.redundancy.mode == "lazy"
    assert parse_config(_config({"stages_per_worker": 4})).capacity == Capacity(4)
    off = parse_config(_config({"mode": "off", "stages_per_worker": 1}))
    assert off.capacity == Capacity(1, replicas=False)


@pytest.mark.parametrize(
    ("redundancy", "message"),
    [
        ({"stages_per_worker": 0}, "is 0; expected an integer >= 1"),
        ({"stages_per_worker": 1}, "use at least 2, or set 'spotline.redundancy.mode'"),
        ({"stages_per_worker": 1, "mode": "eager"}, "redundancy mode 'eager'"),
        ({"stages_per_worker": 2.5}, "expected an integer"),
        ({"stages_per_worker": True}, "expected an integer"),
        ({"stage_per_worker": 2}, "is unknown; expected one of"),
    ],
)
def test_a_bad_capacity_is_one_line_naming_the_key(
    redundancy: dict[str, object], message: str
) -> None:
    with pytest.raises(UserError) as error:
        parse_config(_config(redundancy))
    text = str(error.value)
    assert message in text and "\n" not in text
    assert "spotline.redundancy.stage" in text


# -- spotline simulate --stages-per-worker -----------------------------------------------------

TRACES = Path(__file__).resolve().parent.parent / "integration" / "assets" / "traces"


def test_cli_stages_per_worker_is_recorded_and_a_loose_limit_is_the_old_simulator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """p3-trace.csv on 16 nodes: with 8 stages per worker (no limit for gpt2's 8 stages) the
    Spotline policy commits what it did before the limit (tests/test_sim.py's figure); the
    default (2) differs. (Since exposure checkpoints, spotline.plan.exposure, both commit
    more: 1445136 and 1443288 before them.)"""
    committed = {}
    for extra in ([], ["--stages-per-worker", "8"]):
        output = tmp_path / f"out{len(extra)}"
        args = ["--trace", str(TRACES / "p3-trace.csv"), "--nodes", "16", "--output"]
        args += [str(output), "--policies", "spotline", "--no-progress", *extra]
        assert simulate_main(args) == 0
        document = json.loads((output / "results.json").read_text())
        key = "stages_per_worker (memory, own stage + replicas; checkpoint-restart keeps none)"
        assert document["assumptions"][key] == (8 if extra else 2)
        assert ("--stages-per-worker" in document["command"]) == bool(extra)
        committed[len(extra)] = document["results"]["spotline"]["committed_samples"]
    capsys.readouterr()
    assert committed == {0: 1456752, 2: 1454904}


@pytest.mark.parametrize("value", ["1", "0", "two", "2.5"])
def test_cli_bad_stages_per_worker_is_one_line_exit_2(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "out"
    args = ["--preempt-rate", "0.1", "--nodes", "16", "--output", str(output)]
    assert simulate_main([*args, "--stages-per-worker", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spotline: error: ") and err.count("\n") == 1
    assert "argument --stages-per-worker: must be a whole number >= 2" in err
    assert not output.exists()
