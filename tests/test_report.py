"""The run's timeline: CSV, plot and recovery numbers (spotline.reports.timeline)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from spotline.reports.timeline import CSV_COLUMNS, Timeline, summarize_recoveries

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TWO_BY_TWO = {"w0": "p0:s0", "w1": "p0:s1", "w2": "p1:s0", "w3": "p1:s1"}


def hand_made_timeline() -> Timeline:
    timeline = Timeline()
    timeline.record(0.0, "start", 0, 4, TWO_BY_TWO, None)
    timeline.record(1.0, "step", 1, 4, TWO_BY_TWO, 64.0)
    # Episode 1: w1 killed at 2.0, noticed at 2.25, w0 takes over s1 at 3.5 (1.5 s).
    timeline.record(2.0, "preempted", 1, 3, TWO_BY_TWO, None, "kill w1")
    timeline.record(2.25, "detected", 1, 3, TWO_BY_TWO, None)
    doubled = {"w0": "p0:s0+s1", "w2": "p1:s0", "w3": "p1:s1"}
    timeline.record(3.5, "recovered", 1, 3, doubled, None, "failover")
    timeline.record(4.0, "step", 2, 3, doubled, 40.5)
    # Episode 2: two workers lost at once (one episode), recovered 4 s after the first.
    timeline.record(5.0, "preempted", 2, 2, doubled, None, "kill w2")
    timeline.record(5.0, "preempted", 2, 1, doubled, None, "kill w3")
    timeline.record(5.5, "detected", 2, 1, doubled, None)
    timeline.record(9.0, "recovered", 2, 1, {"w0": "p0:s0+s1"}, None, "pipeline 1 dissolved")
    timeline.record(9.5, "arrived", 2, 2, {"w0": "p0:s0+s1", "w4": "standby"}, None)
    # Episode 3: a loss noticed only by a broken connection, recovered 0.5 s later.
    timeline.record(10.0, "detected", 2, 1, {"w0": "p0:s0+s1"}, None)
    timeline.record(10.5, "recovered", 2, 1, {"w0": "p0:s0+s1"}, None)
    timeline.record(11.0, "step", 3, 1, {"w0": "p0:s0+s1"}, 20.0)
    return timeline


def test_csv_holds_every_row(tmp_path: Path) -> None:
    timeline = hand_made_timeline()
    path = tmp_path / "timeline.csv"
    timeline.write_csv(path)
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == 1 + len(timeline.rows) == 15
    assert rows[2] == [
        "1.0",
        "step",
        "1",
        "4",
        "w0=p0:s0;w1=p0:s1;w2=p1:s0;w3=p1:s1",
        "64.0",
        "",
        "",
    ]
    assert rows[3] == [
        "2.0",
        "preempted",
        "1",
        "3",
        "w0=p0:s0;w1=p0:s1;w2=p1:s0;w3=p1:s1",
        "",
        "kill w1",
        "",
    ]
    assert rows[5][4] == "w0=p0:s0+s1;w2=p1:s0;w3=p1:s1"
    assert rows[6][5] == "40.5"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_csv_of_an_empty_timeline_is_a_header(tmp_path: Path) -> None:
    path = tmp_path / "timeline.csv"
    Timeline().write_csv(path)
    assert path.read_text() == ",".join(CSV_COLUMNS) + "\n"


def test_summarize_recoveries_on_a_hand_made_timeline() -> None:
    summary = summarize_recoveries(hand_made_timeline().rows)
    assert summary == {
        "num_failures": 6,
        "num_recoveries": 3,
        "num_unrecovered": 0,
        "recovery_s": [1.5, 4.0, 0.5],
        "median_recovery_s": 1.5,
        "max_recovery_s": 4.0,
        "total_recovery_s": 6.0,
        "detection_s": [0.25, 0.5],
        "median_detection_s": 0.375,
    }


def test_summarize_recoveries_without_recoveries_and_with_an_open_episode() -> None:
    empty = summarize_recoveries([])
    assert empty["num_recoveries"] == 0 and empty["median_recovery_s"] is None
    assert empty["max_recovery_s"] is None and empty["total_recovery_s"] == 0.0
    timeline = Timeline()
    # Nothing to pair with (a failed step that lost no process): a recovery without a time.
    timeline.record(0.0, "recovered", 0, 2, {}, None)
    timeline.record(1.0, "preempted", 0, 1, {}, None)
    summary = summarize_recoveries(timeline.rows)
    assert summary["num_failures"] == 1
    assert summary["num_recoveries"] == 1 and summary["recovery_s"] == []
    assert summary["num_unrecovered"] == 1


def test_every_recovered_row_is_a_recovery_as_the_run_counts_them() -> None:
    """num_recoveries is the run's ``recoveries``: one per ``recovered`` row, a hung worker's
    (its ``heartbeat-missed`` row opens the episode: timed) and a checkpoint fallback's
    alike. It counted closed episodes only: a hang's recovery was missing from it."""
    timeline = Timeline()
    timeline.record(1.0, "heartbeat-missed", 1, 3, {}, None, "worker:w3")
    timeline.record(1.5, "recovered", 1, 3, {}, None)
    timeline.record(2.0, "preempted", 2, 3, {}, None)
    timeline.record(2.5, "checkpoint-fallback", 2, 3, {}, None)
    timeline.record(3.0, "recovered", 2, 3, {}, None)
    summary = summarize_recoveries(timeline.rows)
    assert summary["num_recoveries"] == 2 and summary["recovery_s"] == [0.5, 1.0]
    assert summary["num_failures"] == 2


def test_record_validates() -> None:
    timeline = Timeline()
    with pytest.raises(ValueError, match="t_s"):
        timeline.record(-1.0, "step", 0, 1, {}, None)
    with pytest.raises(ValueError, match="event"):
        timeline.record(0.0, "", 0, 1, {}, None)
    with pytest.raises(ValueError, match="placement"):
        timeline.record(0.0, "step", 0, 1, {"w0": "p0;s0"}, None)
    with pytest.raises(ValueError, match="samples_per_s"):
        timeline.record(0.0, "step", 0, 1, {}, float("nan"))
    assert timeline.rows == []


def assert_png(path: Path) -> None:
    """The figure was also written, as a PNG (what it shows is asserted on the figure)."""
    assert path.read_bytes().startswith(PNG_MAGIC)


def panels(figure: Figure) -> tuple[Axes, Axes, Axes]:
    """The three panels, top to bottom, with their axis labels checked."""
    live, place, rate = figure.axes
    assert [ax.get_ylabel() for ax in figure.axes] == ["live workers", "placement", "samples/s"]
    assert rate.get_xlabel() == "time since start (s)"
    return live, place, rate


def points(artist: Line2D) -> list[tuple[float, float]]:
    return [
        (float(x), float(y)) for x, y in zip(artist.get_xdata(), artist.get_ydata(), strict=True)
    ]


def test_plot_of_a_run_with_events(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    timeline = hand_made_timeline()
    figure = timeline.plot_png(path, "hand-made run")
    assert_png(path)
    assert figure.get_suptitle() == "hand-made run"
    live, place, rate = panels(figure)
    # Live workers: one step line through every row, held to the end (11 s).
    [line] = live.get_lines()
    assert line.get_drawstyle() == "steps-post"
    assert points(line) == [(r.t_s, r.live_workers) for r in timeline.rows] + [(11.0, 1.0)]
    # Preemptions and arrivals marked where they happened, and named in the legend.
    marks = {c.get_label(): c.get_offsets().tolist() for c in live.collections}
    assert marks == {"preempted": [[2.0, 3.0], [5.0, 2.0], [5.0, 1.0]], "arrived": [[9.5, 2.0]]}
    legend = live.get_legend()
    assert legend is not None
    assert [text.get_text() for text in legend.get_texts()] == ["preempted", "arrived"]
    # Placement: one row of spans per worker in order of first appearance, labelled.
    assert [label.get_text() for label in place.get_yticklabels()] == [
        "w0",
        "w1",
        "w2",
        "w3",
        "w4",
    ]
    assert len(place.collections) == 5
    assert {text.get_text() for text in place.texts} == {
        "p0:s0",
        "p0:s1",
        "p0:s0+s1",
        "p1:s0",
        "p1:s1",
        "standby",
    }
    # Throughput: the three committed steps, on the whole run's time axis.
    [rate_line] = rate.get_lines()
    assert points(rate_line) == [(1.0, 64.0), (4.0, 40.5), (11.0, 20.0)]
    assert tuple(rate.get_xlim()) == (0.0, 11.0)


def test_plot_of_a_run_without_events(tmp_path: Path) -> None:
    path = tmp_path / "empty.png"
    figure = Timeline().plot_png(path, "nothing happened")
    assert_png(path)
    assert figure.get_suptitle() == "nothing happened"
    live, place, rate = panels(figure)
    assert [text.get_text() for text in live.texts] == ["no events recorded"]
    assert [len(ax.get_lines()) for ax in figure.axes] == [0, 0, 0]
    assert live.get_legend() is None and len(place.collections) == len(rate.collections) == 0
    one = Timeline()
    one.record(0.0, "start", 0, 2, {"w0": "p0:s0", "w1": "p0:s1"}, None)
    figure = one.plot_png(tmp_path / "one.png", "one row")
    assert_png(tmp_path / "one.png")
    live, place, rate = panels(figure)
    # Events all at one time still get a visible axis (0 to 1 s).
    assert tuple(rate.get_xlim()) == (0.0, 1.0)
    [line] = live.get_lines()
    assert points(line) == [(0.0, 2.0), (1.0, 2.0)]
    assert [label.get_text() for label in place.get_yticklabels()] == ["w0", "w1"]
    assert rate.get_lines() == [] and live.get_legend() is None


def test_plot_of_a_run_with_many_events(tmp_path: Path) -> None:
    timeline = Timeline()
    placement = {f"w{index:02d}": f"p{index // 4}:s{index % 4}" for index in range(24)}
    for index in range(600):
        t_s = index * 0.5
        if index % 25 == 10:
            victim = sorted(placement)[index % len(placement)]
            placement = {w: s for w, s in placement.items() if w != victim}
            timeline.record(t_s, "preempted", index, len(placement), placement, None)
        elif index % 25 == 20:
            placement = {**placement, f"n{index}": "standby"}
            timeline.record(t_s, "arrived", index, len(placement), placement, None)
        else:
            timeline.record(t_s, "step", index, len(placement), placement, 100.0 + index % 7)
    path = tmp_path / "many.png"
    figure = timeline.plot_png(path, "many events")
    assert_png(path)
    live, place, rate = panels(figure)
    marks = {c.get_label(): len(c.get_offsets()) for c in live.collections}
    assert marks == {"preempted": 24, "arrived": 24}
    # 24 initial workers and 24 arrivals, each a row of the placement panel.
    assert len(place.get_yticklabels()) == 48 == len(place.collections)
    # 552 committed steps: one line, without per-point markers at this density.
    [rate_line] = rate.get_lines()
    assert len(rate_line.get_xdata()) == 552 and rate_line.get_marker() == "None"


def test_a_run_that_evaluated_has_an_eval_loss_series(tmp_path: Path) -> None:
    """Evaluation rows carry their loss: a CSV column, and a fourth panel under the others."""
    timeline = hand_made_timeline()
    timeline.record(4.5, "eval", 2, 3, {"w0": "p0:s0+s1"}, None, "perplexity:20.0", eval_loss=3.0)
    timeline.record(11.5, "eval", 3, 1, {"w0": "p0:s0+s1"}, None, eval_loss=2.5)
    path = tmp_path / "timeline.csv"
    timeline.write_csv(path)
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0][-1] == "eval_loss"
    assert [(row[1], row[-1]) for row in rows[1:] if row[-1]] == [("eval", "3.0"), ("eval", "2.5")]
    figure = timeline.plot_png(tmp_path / "timeline.png", "evaluated")
    assert_png(tmp_path / "timeline.png")
    assert [ax.get_ylabel() for ax in figure.axes] == [
        "live workers",
        "placement",
        "samples/s",
        "eval loss",
    ]
    eval_ax = figure.axes[3]
    assert eval_ax.get_xlabel() == "time since start (s)"
    [line] = eval_ax.get_lines()
    assert points(line) == [(4.5, 3.0), (11.5, 2.5)]
