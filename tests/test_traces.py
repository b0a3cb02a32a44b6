"""Trace parsing (events, aws, gcp), scaling and synthetic traces: spotline.plan.traces."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spotline.errors import UserError
from spotline.plan.traces import (
    Trace,
    TraceEvent,
    live_nodes_over_time,
    load_trace,
    resize_trace,
    scale_trace,
    synthetic_trace,
    trace_from_levels,
)

# The public traces ship in integration/assets/traces; SPOTLINE_TRACES points elsewhere.
TRACES = Path(
    os.environ.get(
        "SPOTLINE_TRACES",
        Path(__file__).resolve().parent.parent / "integration" / "assets" / "traces",
    )
)


def write(tmp_path: Path, name: str, text: str, newline: str = "\n") -> Path:
    path = tmp_path / name
    path.write_bytes(text.replace("\n", newline).encode())
    return path


def levels(trace: Trace) -> list[tuple[float, int]]:
    return list(live_nodes_over_time(trace))


def test_events_format_keeps_names_and_converts_ms(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "0,add,a\n0,add,b\n1500,remove,a\n2000,add,c\n")
    trace = load_trace(path)
    assert trace.events == (
        TraceEvent(0.0, "add", "a"),
        TraceEvent(0.0, "add", "b"),
        TraceEvent(1.5, "remove", "a"),
        TraceEvent(2.0, "add", "c"),
    )
    assert trace.initial_nodes == 2
    assert trace.duration_s == 2.0
    assert levels(trace) == [(0.0, 2), (1.5, 1), (2.0, 2)]


def test_aws_format_crlf_paired_rows_in_seconds(tmp_path: Path) -> None:
    text = "0,0\n21529,0\n21529,4\n21556,4\n21556,12\n30000,12\n30000,3\n300000,3\n"
    trace = load_trace(write(tmp_path, "aws.csv", text, newline="\r\n"))
    assert levels(trace) == [(0.0, 0), (21529.0, 4), (21556.0, 12), (30000.0, 3)]
    assert trace.duration_s == 300000.0
    assert trace.num_removals == 9


def test_aws_format_small_x_is_hours_and_unit_can_be_forced(tmp_path: Path) -> None:
    path = write(tmp_path, "aws.csv", "0.0,0\n0.25,0\n0.25,9\n0.5,9\n0.5,2\n88.75,2\n", "\r\n")
    trace = load_trace(path)
    assert levels(trace) == [(0.0, 0), (900.0, 9), (1800.0, 2)]
    assert trace.duration_s == 88.75 * 3600
    in_seconds = load_trace(path, time_unit="s")
    assert levels(in_seconds) == [(0.0, 0), (0.25, 9), (0.5, 2)]


def test_gcp_format_sorts_and_keeps_last_row_of_equal_timestamps(tmp_path: Path) -> None:
    text = (
        "2021-12-10, 13:07:45, 80\n"
        "2021-12-10, 13:08:45, 80\n"
        "2021-12-10, 13:08:45, 70\n"  # same moment: this later row wins
        "2021-12-10, 13:07:50, 75\n"  # goes backwards: sorted into place
        "2021-12-10, 13:09:45, 70\n"
    )
    trace = load_trace(write(tmp_path, "gcp.txt", text))
    assert levels(trace) == [(0.0, 80), (5.0, 75), (60.0, 70)]
    assert trace.initial_nodes == 80
    assert trace.duration_s == 120.0


def test_format_override(tmp_path: Path) -> None:
    path = write(tmp_path, "t.csv", "0,add,a\n")
    with pytest.raises(UserError, match=r"t\.csv:1: malformed aws trace line"):
        load_trace(path, format="aws")


@pytest.mark.parametrize(
    ("text", "line", "expected"),
    [
        ("0,add,a\n5,explode,a\n", 2, "DELTA_MS,add|remove,NODE"),
        ("0,0\n10,x\n", 2, "x,y"),
        ("2021-12-10, 13:07:45, 80\n2021-12-10, 25:99:00, 3\n", 2, "YYYY-MM-DD, HH:MM:SS, COUNT"),
        ("hello world\n", 1, "cannot tell the trace format"),
    ],
)
def test_malformed_line_names_file_line_and_form(
    tmp_path: Path, text: str, line: int, expected: str
) -> None:
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(UserError) as error:
        load_trace(path)
    message = str(error.value)
    assert f"bad.csv:{line}:" in message
    assert expected in message
    assert "\n" not in message


def test_missing_empty_and_inconsistent_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        load_trace(tmp_path / "nope.csv")
    with pytest.raises(UserError, match="empty"):
        load_trace(write(tmp_path, "empty.csv", "\n\n"))
    with pytest.raises(UserError, match="not live"):
        load_trace(write(tmp_path, "bad.csv", "0,remove,a\n"))


def test_count_drops_remove_deterministically_chosen_nodes() -> None:
    steps = [(0.0, 6), (10.0, 3), (20.0, 5)]
    first = trace_from_levels(steps, 30.0, removal_seed=1)
    assert first == trace_from_levels(steps, 30.0, removal_seed=1)
    assert levels(first) == [(0.0, 6), (10.0, 3), (20.0, 5)]
    removed = {e.node for e in first.events if e.kind == "remove"}
    assert len(removed) == 3 and removed <= {f"node{i}" for i in range(1, 7)}
    added_later = [e.node for e in first.events if e.kind == "add" and e.t_s == 20.0]
    assert added_later == ["node7", "node8"]
    others = {
        frozenset(
            e.node
            for e in trace_from_levels(steps, 30.0, removal_seed=s).events
            if e.kind == "remove"
        )
        for s in range(20)
    }
    assert len(others) > 1  # the seed matters: not always oldest or newest first


def test_scale_trace_keeps_every_drop() -> None:
    trace = trace_from_levels([(0.0, 10), (5.0, 9), (6.0, 10), (7.0, 5), (8.0, 0)], 9.0)
    scaled = scale_trace(trace, 4)
    # 10 -> 4; 9 -> round(3.6) = 4 but a drop must preempt, so 3; 10 -> 4; 5 -> 2; 0 -> 0.
    assert levels(scaled) == [(0.0, 4), (5.0, 3), (6.0, 4), (7.0, 2), (8.0, 0)]
    assert scaled.peak_nodes == 4
    assert scale_trace(trace, 10) is trace
    assert scale_trace(trace, 50) is trace


def test_resize_trace_scales_up() -> None:
    trace = trace_from_levels([(0.0, 2), (5.0, 1), (6.0, 2)], 9.0)
    assert levels(resize_trace(trace, 4)) == [(0.0, 4), (5.0, 2), (6.0, 4)]


def test_synthetic_trace_is_deterministic_and_replaces_nodes() -> None:
    trace = synthetic_trace(16, 0.5, 6 * 3600.0, seed=3, replace_after_s=60.0)
    assert trace == synthetic_trace(16, 0.5, 6 * 3600.0, seed=3, replace_after_s=60.0)
    assert trace != synthetic_trace(16, 0.5, 6 * 3600.0, seed=4, replace_after_s=60.0)
    assert trace.initial_nodes == 16
    assert trace.num_removals > 0
    add_times = sorted(e.t_s for e in trace.events if e.kind == "add" and e.t_s > 0)
    replacements = sorted(
        e.t_s + 60.0 for e in trace.events if e.kind == "remove" and e.t_s + 60.0 < trace.duration_s
    )
    assert add_times == replacements
    quiet = synthetic_trace(8, 0.0, 3600.0, seed=0, replace_after_s=0.0)
    assert [e.kind for e in quiet.events] == ["add"] * 8


def test_recorded_traces_parse() -> None:
    p3 = load_trace(TRACES / "p3-trace.csv")
    assert (len(p3.events), p3.num_removals, p3.peak_nodes) == (344, 167, 32)
    g4dn = load_trace(TRACES / "g4dn-trace.csv")
    assert (len(g4dn.events), g4dn.num_removals, g4dn.peak_nodes) == (153, 74, 24)
    p2 = load_trace(TRACES / "aws-spot-instances-p2-xlarge-2020-11-20-to-2020-11-23.csv")
    assert p2.peak_nodes == 16 and round(p2.duration_s / 3600, 1) == 88.7
    gcp = load_trace(TRACES / "v100x1-east1c.txt")
    assert gcp.peak_nodes == 80 and gcp.initial_nodes == 80
