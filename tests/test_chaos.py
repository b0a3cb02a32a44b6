"""Fault injection as data: --inject parsing and trace/Poisson replays (spotline.plan.chaos)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from spotline.errors import UserError
from spotline.plan.chaos import (
    Injection,
    TimedEvent,
    check_injections,
    injections_at,
    injections_for_step,
    live_workers_over_time,
    parse_injection,
    parse_injections,
    random_preemptions,
    replay_trace,
    signal_number,
    trace_cycle,
    trace_events,
)
from spotline.plan.traces import Trace, TraceEvent, live_nodes_over_time, load_trace

TRACES = Path(
    os.environ.get(
        "SPOTLINE_TRACES",
        Path(__file__).resolve().parent.parent / "integration" / "assets" / "traces",
    )
)
TRACE_FILES = (
    "p3-trace.csv",
    "g4dn-trace.csv",
    "aws-spot-instances-g4dn-xlarge-us-east-1c-2020-11-20-1930-to-2020-11-21-2200.csv",
    "aws-spot-instances-p2-xlarge-2020-11-20-to-2020-11-23.csv",
    "v100x1-east1c.txt",
)
EXPECTED_FORM = "expected SIGNAL:STEP:WORKER[:PHASE] with SIGNAL kill, term or stop, or add:STEP"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # STEP counts from 1 (the progress lines' count); an Injection holds it 0-based.
        ("kill:3:1", Injection("kill", 2, 1, None)),
        ("term:1:0", Injection("term", 0, 0, None)),
        ("kill:12:2:backward", Injection("kill", 11, 2, "backward")),
        ("term:5:1:optimizer", Injection("term", 4, 1, "optimizer")),
        ("kill:5:1:recv", Injection("kill", 4, 1, "recv")),
        ("stop:4:1", Injection("stop", 3, 1, None)),
        ("stop:2:3:send", Injection("stop", 1, 3, "send")),
        ("add:7", Injection("add", 6, None, None)),
        ("  add:1 ", Injection("add", 0, None, None)),
    ],
)
def test_parse_injection_accepts_the_documented_forms(text: str, expected: Injection) -> None:
    assert parse_injection(text) == expected
    assert parse_injection(str(expected)) == expected  # str() round-trips
    assert str(expected) == text.strip()  # in the flag's count, from 1


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("kill:x:1", "STEP must be a positive integer"),
        ("kill:-1:1", "STEP must be a positive integer"),
        ("kill:+1:1", "STEP must be a positive integer"),
        ("kill:0:1", "there is no step 0: steps count from 1"),
        ("add:0", "there is no step 0: steps count from 1"),
        ("kill:1:w", "WORKER must be a non-negative integer"),
        ("kill:1", "kill takes STEP:WORKER"),
        ("kill:1:2:forward:extra", "kill takes STEP:WORKER"),
        (
            "term:1:2:sideways",
            "PHASE must be one of forward, backward, send, recv, optimizer, committed",
        ),
        ("hang:1:2", "unknown SIGNAL 'hang'"),
        ("KILL:1:2", "unknown SIGNAL 'KILL'"),
        ("add:1:2", "add takes only a STEP"),
        ("add:", "STEP must be a positive integer"),
        ("", "unknown SIGNAL ''"),
    ],
)
def test_parse_injection_rejects_malformed_text_in_one_line(text: str, why: str) -> None:
    with pytest.raises(UserError) as caught:
        parse_injection(text)
    message = str(caught.value)
    assert message.startswith(f"--inject {text!r}: {why}")
    assert message.endswith(EXPECTED_FORM)
    assert "\n" not in message
    assert isinstance(caught.value, ValueError)


def test_the_brief_example_message_exactly() -> None:
    with pytest.raises(UserError) as caught:
        parse_injection("kill:x:1")
    assert str(caught.value) == (
        "--inject 'kill:x:1': STEP must be a positive integer; " + EXPECTED_FORM
    )


def test_injection_rejects_inconsistent_fields() -> None:
    with pytest.raises(ValueError, match="names no worker"):
        Injection("add", 1, 0, None)
    with pytest.raises(ValueError, match="needs a worker index"):
        Injection("kill", 1, None, None)
    with pytest.raises(ValueError, match="step must be an integer"):
        Injection("kill", -1, 0, None)


def test_parse_injections_sorts_by_step_and_rejects_duplicates() -> None:
    parsed = parse_injections(["kill:5:1", "add:2", "term:5:0:forward", "add:2"])
    assert [str(injection) for injection in parsed] == [
        "add:2",
        "add:2",
        "kill:5:1",
        "term:5:0:forward",
    ]
    with pytest.raises(UserError, match="already receives a signal at step 5"):
        parse_injections(["kill:5:1", "term:5:1"])
    # The same worker in another phase of the same step is a different fault.
    assert len(parse_injections(["kill:5:1", "term:5:1:send"])) == 2


def test_check_injections_bounds_steps_and_workers() -> None:
    injections = parse_injections(["kill:3:1", "add:10"])
    check_injections(injections, num_workers=2, num_steps=10)  # add:10, the last step
    with pytest.raises(UserError, match="step 10 is past the run's last step 9; use a step from 1"):
        check_injections(injections, num_workers=2, num_steps=9)
    with pytest.raises(UserError, match=r"worker 1 does not exist; the run starts 1 workers"):
        check_injections(injections, num_workers=1, num_steps=10)


def test_injections_at_matches_step_phase_and_worker_exactly() -> None:
    # The 4th and 5th steps: indices 3 and 4, as the engine and the coordinator ask.
    injections = parse_injections(["kill:4:1", "kill:4:1:backward", "term:4:0", "add:4", "add:5"])
    assert injections_at(injections, 3, None, 1) == [Injection("kill", 3, 1, None)]
    assert injections_at(injections, 3, "backward", 1) == [Injection("kill", 3, 1, "backward")]
    assert injections_at(injections, 3, "forward", 1) == []
    assert injections_at(injections, 3, None, None) == [Injection("add", 3, None, None)]
    assert injections_at(injections, 4, None, 1) == []
    assert len(injections_for_step(injections, 3)) == 4


def test_signal_number() -> None:
    assert signal_number("kill") == signal.SIGKILL
    assert signal_number("term") == signal.SIGTERM


def tiny_trace() -> Trace:
    # Starts at t=10 with 3 nodes; a 2-node drop at 70, a replacement in the same instant as
    # a preemption at 130, an arrival at 190; ends at 250.
    return Trace(
        (
            TraceEvent(10.0, "add", "a"),
            TraceEvent(10.0, "add", "b"),
            TraceEvent(10.0, "add", "c"),
            TraceEvent(70.0, "remove", "a"),
            TraceEvent(70.0, "remove", "c"),
            TraceEvent(130.0, "add", "d"),
            TraceEvent(130.0, "remove", "b"),
            TraceEvent(190.0, "add", "e"),
        ),
        250.0,
        "tiny",
    )


def test_trace_events_on_a_hand_made_trace() -> None:
    replay = replay_trace(tiny_trace(), max_workers=4, time_scale=2.0, removal="term")
    assert replay.initial_workers == 3  # the first instant is the starting state
    assert replay.events == (
        TimedEvent(30.0, "remove", "term", 2),  # (70 - 10) / 2
        TimedEvent(60.0, "remove", "term", 1),  # removals first at one instant
        TimedEvent(60.0, "add", None, 1),
        TimedEvent(90.0, "add", None, 1),
    )
    assert replay.duration_s == 120.0
    assert trace_events(tiny_trace(), max_workers=4, time_scale=2.0, removal="term") == list(
        replay.events
    )
    assert live_workers_over_time(replay.initial_workers, replay.events) == [
        (0.0, 3),
        (30.0, 1),
        (60.0, 0),
        (60.0, 1),
        (90.0, 2),
    ]


def test_a_run_longer_than_its_trace_replays_it_again() -> None:
    replay = replay_trace(tiny_trace(), max_workers=4, time_scale=2.0, removal="term")
    assert replay.final_workers == 2
    assert trace_cycle(replay, 0) == replay.events
    # Cycle 1: back from 2 to the initial 3 at 120 s, then the events 120 s later.
    assert trace_cycle(replay, 1) == (
        TimedEvent(120.0, "add", None, 1),
        TimedEvent(150.0, "remove", "term", 2),
        TimedEvent(180.0, "remove", "term", 1),
        TimedEvent(180.0, "add", None, 1),
        TimedEvent(210.0, "add", None, 1),
    )
    events = [e for cycle in range(4) for e in trace_cycle(replay, cycle)]
    assert [e.at_s for e in events] == sorted(e.at_s for e in events)
    # Every cycle starts from the initial count, so the counts never drift.
    counts = live_workers_over_time(replay.initial_workers, events)
    assert counts[-1][1] == replay.final_workers
    assert min(count for _, count in counts) >= 0
    with pytest.raises(ValueError, match="cycle"):
        trace_cycle(replay, -1)


def test_a_trace_that_ends_above_its_start_removes_at_the_wrap() -> None:
    grows = Trace(
        (TraceEvent(0.0, "add", "a"), TraceEvent(10.0, "add", "b"), TraceEvent(20.0, "add", "c")),
        20.0,
        "grows",
    )
    replay = replay_trace(grows, max_workers=4, time_scale=1.0, removal="kill")
    assert (replay.initial_workers, replay.final_workers) == (1, 3)
    assert trace_cycle(replay, 2)[0] == TimedEvent(40.0, "remove", "kill", 2)


def test_time_scale_divides_trace_time() -> None:
    slow = trace_events(tiny_trace(), max_workers=4, time_scale=1.0, removal="kill")
    fast = trace_events(tiny_trace(), max_workers=4, time_scale=60.0, removal="kill")
    assert [event.at_s for event in slow] == [60.0, 120.0, 120.0, 180.0]
    assert [event.at_s for event in fast] == [1.0, 2.0, 2.0, 3.0]
    assert [(e.kind, e.how, e.count) for e in slow] == [(e.kind, e.how, e.count) for e in fast]


def test_trace_events_scales_down_a_trace_larger_than_the_local_cap() -> None:
    replay = replay_trace(tiny_trace(), max_workers=2, time_scale=1.0, removal="kill")
    assert replay.initial_workers == 2
    counts = live_workers_over_time(replay.initial_workers, replay.events)
    assert max(count for _, count in counts) <= 2
    assert [e.kind for e in replay.events if e.at_s == 60.0] == ["remove"]  # the 2-node drop


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_workers": 0, "time_scale": 1.0, "removal": "kill"}, "max_workers"),
        ({"max_workers": 2, "time_scale": 0.0, "removal": "kill"}, "time_scale"),
        ({"max_workers": 2, "time_scale": -1.0, "removal": "kill"}, "time_scale"),
        ({"max_workers": 2, "time_scale": float("inf"), "removal": "kill"}, "time_scale"),
        ({"max_workers": 2, "time_scale": 1.0, "removal": "stop"}, "removal"),
    ],
)
def test_trace_events_validates_inputs(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        trace_events(tiny_trace(), **kwargs)  # type: ignore[arg-type]


def test_trace_events_rejects_an_empty_trace() -> None:
    with pytest.raises(ValueError, match="holds no events"):
        trace_events(Trace((), 10.0, "empty"), max_workers=2, time_scale=1.0, removal="kill")


@pytest.mark.parametrize("name", TRACE_FILES)
@pytest.mark.parametrize("max_workers", [2, 4])
def test_real_traces_keep_every_drop_as_a_removal(name: str, max_workers: int) -> None:
    trace = load_trace(TRACES / name)
    time_scale = 60.0
    replay = replay_trace(trace, max_workers=max_workers, time_scale=time_scale, removal="kill")
    start_t = trace.events[0].t_s
    counts = live_workers_over_time(replay.initial_workers, replay.events)
    assert 1 <= replay.initial_workers <= max_workers
    assert all(0 <= count <= max_workers for _, count in counts)
    assert all(
        earlier.at_s <= later.at_s
        for earlier, later in zip(replay.events, replay.events[1:], strict=False)
    )
    assert replay.duration_s == (trace.duration_s - start_t) / time_scale
    removal_times = {event.at_s for event in replay.events if event.kind == "remove"}
    level_points = live_nodes_over_time(trace)
    num_drops = 0
    for (_, before), (t_s, after) in zip(level_points, level_points[1:], strict=False):
        if t_s <= start_t or after >= before:
            continue
        at_s = (t_s - start_t) / time_scale
        local_before = [count for point_s, count in counts if point_s < at_s][-1]
        if local_before > 0:
            # Every drop of the recorded cloud preempts at least one live local worker.
            assert at_s in removal_times, (name, t_s)
            num_drops += 1
    assert num_drops > 0


def test_random_preemptions_is_deterministic_per_seed() -> None:
    rate, num_workers, duration_s = 6.0, 4, 3600.0
    first = random_preemptions(rate, num_workers, duration_s, 1, 60.0, 45.0)
    again = random_preemptions(rate, num_workers, duration_s, 1, 60.0, 45.0)
    other = random_preemptions(rate, num_workers, duration_s, 2, 60.0, 45.0)
    assert first == again
    assert first != other
    assert any(event.kind == "remove" for event in first)
    assert all(event.how == "kill" for event in first if event.kind == "remove")
    assert all(0 <= event.at_s <= 60.0 for event in first)  # one trace hour in 60 wall seconds
    counts = live_workers_over_time(num_workers, first)
    assert all(0 <= count <= num_workers for _, count in counts)
    # A replacement arrives 45 trace seconds (0.75 wall seconds) after each preemption.
    removals = [e.at_s for e in first if e.kind == "remove" for _ in range(e.count)]
    arrivals = [e.at_s for e in first if e.kind == "add" for _ in range(e.count)]
    expected = [t + 0.75 for t in removals if t * 60.0 + 45.0 < duration_s]
    assert sorted(arrivals) == pytest.approx(sorted(expected))
    slower = random_preemptions(rate, num_workers, duration_s, 1, 30.0, 45.0)
    assert [e.at_s for e in slower] == pytest.approx([e.at_s * 2 for e in first])
    termed = random_preemptions(rate, num_workers, duration_s, 1, 60.0, 45.0, removal="term")
    assert {e.how for e in termed if e.kind == "remove"} == {"term"}


def test_random_preemptions_validates_inputs() -> None:
    with pytest.raises(ValueError, match="time_scale"):
        random_preemptions(1.0, 2, 60.0, 0, 0.0, 1.0)
    with pytest.raises(ValueError, match="rate_per_worker_hour"):
        random_preemptions(-1.0, 2, 60.0, 0, 1.0, 1.0)
    with pytest.raises(ValueError, match="num_workers"):
        random_preemptions(1.0, 0, 60.0, 0, 1.0, 1.0)
    assert random_preemptions(0.0, 2, 60.0, 0, 1.0, 1.0) == []


def test_timed_event_validates() -> None:
    with pytest.raises(ValueError, match="needs how"):
        TimedEvent(1.0, "remove", None, 1)
    with pytest.raises(ValueError, match="has no how"):
        TimedEvent(1.0, "add", "kill", 1)
    with pytest.raises(ValueError, match="count"):
        TimedEvent(1.0, "add", None, 0)
    with pytest.raises(ValueError, match="at_s"):
        TimedEvent(-1.0, "add", None, 1)


def test_rescales_parse_in_order_and_refuse_what_cannot_run() -> None:
    from spotline.plan.chaos import ScaleTo, check_rescales, parse_rescales

    assert parse_rescales(None) == () and parse_rescales(" ") == ()
    # From the 3rd, 6th and 9th steps on: after 2, 5 and 8 steps (the boundaries' indices).
    assert parse_rescales("3:2, 6:3,9:1") == (ScaleTo(2, 2), ScaleTo(5, 3), ScaleTo(8, 1))
    assert str(ScaleTo(2, 2)) == "3:2"
    for bad in ("3", "3:2:1", "a:2", "3:-1", "3:2,3:1", "3:0", "0:2"):
        with pytest.raises(UserError):
            parse_rescales(bad)
    check_rescales(parse_rescales("2:2,5:3"), num_steps=5, num_stages=2, max_workers=4)
    for text in ("1:2", "6:2", "2:1", "2:5"):
        with pytest.raises(UserError):
            check_rescales(parse_rescales(text), num_steps=5, num_stages=2, max_workers=4)
