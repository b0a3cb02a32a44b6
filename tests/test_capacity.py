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
from spotline.plan.layout import (
    FatalLoss,
    GenerationPlan,
    Layout,
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
from spotline.sim.engine import POLICY_MODELS, PolicyResult, SimConfig, simulate


def workers(count: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


def most_held(layout: Layout, *, replicas: bool) -> int:
    """The most logical stages a member of ``layout`` holds, counted the runtime's way (what
    it reports holding: spotline.plan.layout.member_holdings)."""
    return max(len(held) for held in member_holdings(layout, 0, replicas=replicas).values())


def capacities() -> st.SearchStrategy[Capacity]:
    return st.builds(Capacity, st.integers(2, 5), st.booleans()) | st.builds(
        lambda c: Capacity(c, replicas=False), st.just(1)
    )


# -- the bound ---------------------------------------------------------------------------------


def test_the_bound_is_exact_against_every_grouping() -> None:
    """``Capacity.allows`` (a closed form) says yes exactly when some contiguous grouping
    fits, and ``fits`` counts what member_holdings says a member holds."""
    for num_stages in range(1, 9):
        for stages_per_worker, replicas in itertools.product(range(1, 7), (False, True)):
            if replicas and stages_per_worker < 2:
                continue
            capacity = Capacity(stages_per_worker, replicas)
            for num_physical in range(1, num_stages + 1):
                groupings = list(contiguous_groupings(num_stages, num_physical))
                fitting = [g for g in groupings if capacity.fits(g)]
                assert capacity.allows(num_stages, num_physical) == bool(fitting), (
                    num_stages,
                    num_physical,
                    capacity,
                )
                for groups in groupings[:5]:
                    layout = Layout(num_stages, 1, groups, (tuple(workers(num_physical)),))
                    held = most_held(layout, replicas=replicas)
                    assert (held <= stages_per_worker) == capacity.fits(groups)
            fewest = capacity.fewest_physical_stages(num_stages)
            assert capacity.allows(num_stages, fewest)
            assert fewest == 1 or not capacity.allows(num_stages, fewest - 1)


def test_a_capacity_a_worker_cannot_have_is_refused_in_one_line() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="integer >= 1"):
            Capacity(bad, replicas=False)
    with pytest.raises(ValueError, match="at least 2, or redundancy off"):
        Capacity(1, replicas=True)
    with pytest.raises(ValueError, match="integer >= 1"):
        Capacity(True, replicas=False)  # type: ignore[arg-type]


# -- the planner -------------------------------------------------------------------------------


def test_a_lost_stage_waits_for_capacity_instead_of_folding_three_stages() -> None:
    """Four stages, one pipeline, w2 lost: without a limit w1 runs stages 1 and 2 and holds
    stage 3's replica (three stages). Two per worker: wait, the survivors keep the state;
    three: that fold."""
    layout = initial_layout(4, 1, workers(4))
    assert layout is not None
    held = member_holdings(layout, 7, replicas=True)
    reports = [WorkerReport(w, held[w], layout.slot_of(w)) for w in ("w0", "w1", "w3")]
    unlimited = plan_generation(1, 4, 1, reports)
    assert isinstance(unlimited, GenerationPlan) and unlimited.layout is not None
    assert most_held(unlimited.layout, replicas=True) == 3
    waits = plan_generation(1, 4, 1, reports, capacity=Capacity(2))
    assert isinstance(waits, WaitForCapacity)
    assert (waits.resume_step, waits.live, waits.needed) == (7, 3, 4)
    assert "waiting for 4" in waits.reason and "state survives" in waits.reason
    folds = plan_generation(1, 4, 1, reports, capacity=Capacity(3))
    assert isinstance(folds, GenerationPlan) and folds.layout == unlimited.layout
    # Without replicas two per worker fit that fold too: (0,) (1, 2) (3,).
    plain = member_holdings(layout, 7, replicas=False)
    bare = [WorkerReport(w, plain[w] + held[w], layout.slot_of(w)) for w in ("w0", "w1", "w3")]
    result = plan_generation(1, 4, 1, bare, capacity=Capacity(2, replicas=False))
    assert isinstance(result, GenerationPlan) and result.layout is not None
    assert max(len(g) for g in result.layout.groups) == 2


def test_a_lost_stage_with_too_few_workers_falls_back_and_says_so() -> None:
    """Owner and replica holder of stage 2 both lost: the state is gone, a fatal loss (the
    checkpoint), whatever the capacity; the initial layout on the survivors then waits."""
    layout = initial_layout(4, 1, workers(4))
    assert layout is not None
    held = member_holdings(layout, 7, replicas=True)
    reports = [WorkerReport(w, held[w], layout.slot_of(w)) for w in ("w0", "w3")]
    result = plan_generation(1, 4, 1, reports, capacity=Capacity(2))
    assert isinstance(result, FatalLoss) and result.lost_stages == (2,)
    assert initial_layout(4, 1, ["w0", "w3"], elastic=True, capacity=Capacity(2)) is None
    assert initial_layout(4, 1, ["w0", "w3"], elastic=True, capacity=Capacity(4)) is not None


@st.composite
def memberships(draw: st.DrawFn) -> tuple[int, int, list[WorkerReport]]:
    """A layout's survivors after losses and arrivals, some generations on: the planner's
    input in the runtime and the simulator (planned without a limit first, so that the
    holdings are as spread as the old planner left them)."""
    num_stages = draw(st.integers(1, 6))
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
    fatal loss; and with one worker per stage and pipeline the limit changes nothing."""
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
        return
    if isinstance(result, FatalLoss):
        return
    if result.layout is None:  # too few for the rigid pipelines
        assert not elastic and len(reports) < num_pipelines
        return
    assert most_held(result.layout, replicas=capacity.replicas) <= capacity.stages_per_worker
    assert len(reports) >= needed
    if len(reports) >= num_stages * num_pipelines and capacity.allows(num_stages, num_stages):
        # Enough workers for one stage each: the very plan of the planner without a limit.
        assert result == unlimited


# -- the acceptance test: a run with fewer workers than the limit allows ----------------------


def _checked(result: PolicyResult, capacity: Capacity) -> int:
    """Every layout the run adopted holds at most ``capacity`` per worker; how many."""
    for planned in result.layouts:
        held = most_held(planned.layout, replicas=capacity.replicas)
        assert held <= capacity.stages_per_worker, (result.policy, planned)
    return len(result.layouts)


def test_a_run_short_of_workers_waits_or_falls_back_and_never_overfills_a_worker() -> None:
    """gpt2's 8 stages on 8 nodes; nodes 1, 3 and 5 preempted at 1 h (every stage survives:
    their replicas are on 0, 2 and 4), node 6 at 2 h (stage 6 lost: its owner and its
    replica holder 5 are gone), four nodes back at 3 h. With 2 stages per worker, replicas
    included, the Spotline policies wait at 1 h (5 < 8 workers, and no worker may run 2
    stages beside a replica), fall back to the checkpoint at 2 h and wait on; checkpoint-
    restart, whose workers hold no replica, runs 2 stages on a worker from 4 nodes on."""
    calibration = load_calibration()
    model = calibration.model("gpt2")
    assert model.num_stages == 8
    events = [TraceEvent(0.0, "add", f"n{i}") for i in range(8)]
    events += [TraceEvent(3600.0, "remove", f"n{i}") for i in (1, 3, 5)]
    events += [TraceEvent(7200.0, "remove", "n6")]
    events += [TraceEvent(10800.0, "add", f"m{i}") for i in range(4)]
    trace = Trace(tuple(events), 4 * 3600.0)
    hour = 3600.0
    ready = hour * 3 + calibration.node_ready_s  # when the arrivals are ready
    config = SimConfig(calibration, model, 8, record_layouts=True, record_timeline=True)
    results = {p: simulate(trace, p, config) for p in ("spotline", "spotline-rigid")}
    for policy, result in results.items():
        capacity = POLICY_MODELS[policy].capacity(config)
        assert capacity == Capacity(2, replicas=True)
        assert _checked(result, capacity) >= 2
        # Waiting (not training) from the first preemption to the arrivals, state kept
        # until the fatal loss at 2 h: one fallback, then the restart on 8 workers.
        assert result.num_fatal_failures == 1, policy
        assert result.waiting_s >= ready - hour - 120.0, (policy, result.waiting_s)
        idle = [p for p in result.timeline if hour <= p.t_s < ready]
        assert idle and all(p.samples_per_s == 0 for p in idle), policy
        assert all(len(p.layout.members) == 8 for p in result.layouts), policy
    restart = simulate(trace, "checkpoint-restart", config)
    capacity = POLICY_MODELS["checkpoint-restart"].capacity(config)
    assert capacity == Capacity(2, replicas=False)
    assert _checked(restart, capacity) >= 3
    # 5 workers after 1 h, 4 after 2 h: every one of them runs, two stages at most.
    folded = [p for p in restart.layouts if hour <= p.t_s < ready]
    assert [len(p.layout.members) for p in folded] == [5, 4]
    assert folded[-1].layout.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert restart.waiting_s < results["spotline"].waiting_s / 10  # it trains on
    # Without the limit (8 stages per worker) the Spotline policy folds and trains on.
    loose = simulate(
        trace,
        "spotline",
        SimConfig(calibration, model, 8, record_layouts=True, stages_per_worker=8),
    )
    assert max(most_held(p.layout, replicas=True) for p in loose.layouts) > 2
    assert loose.waiting_s < results["spotline"].waiting_s


def test_below_the_fewest_workers_checkpoint_restart_waits_too() -> None:
    """Three nodes of gpt2's 8 stages: 3 workers cannot hold 8 stages at 2 per worker, so
    no policy trains (before the limit, Spotline folded 8 stages onto 3 workers)."""
    calibration = load_calibration()
    model = calibration.model("gpt2")
    events = [TraceEvent(0.0, "add", f"n{i}") for i in range(8)]
    events += [TraceEvent(3600.0, "remove", f"n{i}") for i in range(3, 8)]
    trace = Trace(tuple(events), 2 * 3600.0)
    config = SimConfig(calibration, model, 8, record_layouts=True)
    for policy in ("spotline", "spotline-rigid", "checkpoint-restart"):
        result = simulate(trace, policy, config)
        assert all(p.t_s < 3600.0 for p in result.layouts), policy
        assert result.waiting_s >= 3600.0, policy


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


def test_cli_stages_per_worker_is_recorded_and_loosens_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """p3-trace.csv on 16 nodes: 8 stages per worker lets the Spotline policy fold through
    the hours with fewer than 8 nodes, which the default (2) waits through."""
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
    assert committed[2] > committed[0]


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
