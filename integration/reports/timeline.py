"""The run's timeline: what happened when, as a CSV, a three-panel plot and recovery numbers.

The coordinator calls :meth:`Timeline.record` at every event of a run; the run's output then
holds ``timeline.csv`` (:meth:`Timeline.write_csv`), ``timeline.png``
(:meth:`Timeline.plot_png`) and the recovery figures of :func:`summarize_recoveries` in its
summary.

Event names the report understands (others are kept and shown as they are):

``preempted``
    a worker was lost or told to leave (a kill, a SIGTERM notice); marked on the plot.
``detected``
    the survivors noticed a loss (a broken connection, a missed heartbeat).
``recovered``
    training continues on the new placement (after a failover or a checkpoint restore).
``arrived``
    a worker joined; marked on the plot.
``step``
    a step was committed; ``samples_per_s`` is its committed throughput.
``eval``
    an evaluation was reported; ``eval_loss`` is its loss (plotted in a fourth panel when
    the run has any).

Every row carries the *whole* placement at its time (worker id -> what it runs, e.g.
``"p0:s0+s1"``): a worker's span on the plot runs from a row until the next row in which
its placement differs or it is absent.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import statistics
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotline.atomic_files import write_bytes_atomic
from spotline.run_dir import TIMELINE_CSV, TIMELINE_PNG

if TYPE_CHECKING:  # matplotlib is imported only when a plot is drawn
    from matplotlib.figure import Figure

PREEMPTION_EVENTS = frozenset({"preempted"})
# A worker killed because it hung: its heartbeat missed, or silent long after its peers
# reported. A loss as a preemption is (it opens a recovery), but not a preemption.
HUNG_EVENTS = frozenset({"heartbeat-missed", "unresponsive"})
FAILURE_EVENTS = frozenset({"preempted", "detected"}) | HUNG_EVENTS
RECOVERY_EVENTS = frozenset({"recovered"})
ARRIVAL_EVENTS = frozenset({"arrived"})
CSV_COLUMNS = (
    "t_s",
    "event",
    "step",
    "live_workers",
    "placement",
    "samples_per_s",
    "detail",
    "eval_loss",
)
# How often a ``throughput`` row is recorded while the run trains (its samples/s since the
# previous one): often enough to show a slowdown, few enough rows for a long run.
THROUGHPUT_EVERY_S = 1.0


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural unless one: "1 pipeline", "4 stages"."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


@dataclass(frozen=True)
class TimelineRow:
    """One recorded event: at ``t_s`` seconds since the run started, ``event`` happened at
    step ``step`` with ``live_workers`` workers placed as ``placement`` (worker id -> stages,
    sorted by worker id), committing ``samples_per_s`` (None when the row reports none);
    ``eval_loss``: the loss of the evaluation the row reports (None: it reports none)."""

    t_s: float
    event: str
    step: int
    live_workers: int
    placement: tuple[tuple[str, str], ...]
    samples_per_s: float | None
    detail: str = ""
    eval_loss: float | None = None

    def placement_text(self) -> str:
        """The placement as one CSV field: ``worker=stages`` pairs joined by ``;``."""
        return ";".join(f"{worker}={stages}" for worker, stages in self.placement)


def _check_text(name: str, value: str) -> None:
    # The placement field uses '=' and ';' as separators; a newline would break the CSV row
    # for readers that do not handle quoted newlines.
    if any(separator in value for separator in ("=", ";", "\n", "\r")):
        raise ValueError(f"{name} {value!r} must not contain '=', ';' or a newline")


class Timeline:
    """Rows of a run's events in the order recorded. Pairs with :func:`summarize_recoveries`,
    which reads :attr:`rows`."""

    def __init__(self) -> None:
        self.rows: list[TimelineRow] = []

    def record(
        self,
        t_s: float,
        event: str,
        step: int,
        live_workers: int,
        placement: Mapping[str, str],
        samples_per_s: float | None,
        detail: str = "",
        *,
        eval_loss: float | None = None,
    ) -> TimelineRow:
        """Append one row (see :class:`TimelineRow`) and return it. ValueError on a
        negative or non-finite time or count, or an empty event name."""
        if not math.isfinite(t_s) or t_s < 0:
            raise ValueError(f"t_s must be finite and >= 0, got {t_s}")
        if not event or event != event.strip() or "\n" in event:
            raise ValueError(
                f"event must be a non-empty name without surrounding spaces, got {event!r}"
            )
        if step < 0 or live_workers < 0:
            raise ValueError(f"step and live_workers must be >= 0, got {step} and {live_workers}")
        if samples_per_s is not None and (not math.isfinite(samples_per_s) or samples_per_s < 0):
            raise ValueError(f"samples_per_s must be finite and >= 0, got {samples_per_s}")
        for worker, stages in placement.items():
            _check_text("worker id", worker)
            _check_text("placement", stages)
        row = TimelineRow(
            t_s=float(t_s),
            event=event,
            step=step,
            live_workers=live_workers,
            placement=tuple(sorted(placement.items())),
            samples_per_s=None if samples_per_s is None else float(samples_per_s),
            detail=detail,
            eval_loss=None if eval_loss is None else float(eval_loss),
        )
        self.rows.append(row)
        return row

    def write_csv(self, path: Path) -> None:
        """Write the rows to ``path`` (columns :data:`CSV_COLUMNS`, a header line, an empty
        ``samples_per_s`` for None), atomically: a reader sees the old file or the new one."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for row in self.rows:
            writer.writerow(
                [
                    repr(row.t_s),
                    row.event,
                    row.step,
                    row.live_workers,
                    row.placement_text(),
                    "" if row.samples_per_s is None else repr(row.samples_per_s),
                    row.detail,
                    "" if row.eval_loss is None else repr(row.eval_loss),
                ]
            )
        write_bytes_atomic(Path(path), buffer.getvalue().encode("utf-8"))

    def write(self, output: Path, *, png: bool, title: str) -> None:
        """The run's files in ``output``: ``timeline.csv`` and, with ``png``
        (``spotline.tracking.timeline_png``), ``timeline.png`` titled ``title``; what every
        entry point writes at a run's end."""
        self.write_csv(output / TIMELINE_CSV)
        if not png:
            return
        try:
            self.plot_png(output / TIMELINE_PNG, title)
        except Exception as exc:  # a plot is a convenience; never fail a finished run on it
            print(f"spotline: timeline plot skipped: {exc}", file=sys.stderr)

    def plot_png(self, path: Path, title: str) -> Figure:
        """Draw the timeline into ``path`` (PNG, atomically): live workers over time with
        preemptions and arrivals marked, each worker's placement spans, committed
        throughput, and, when the run evaluated, the eval loss, on one shared time axis.
        Uses matplotlib's Agg canvas (no display, no global pyplot state). Returns the
        figure drawn (its three or four axes, top to bottom), so that a caller or a test
        can read what it shows."""
        figure = _plot(self.rows, title)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=100)
        write_bytes_atomic(Path(path), buffer.getvalue())
        return figure


def _spans(rows: list[TimelineRow], end_s: float) -> dict[str, list[tuple[float, float, str]]]:
    """Per worker id, in order of first appearance: ``(start_s, end_s, stages)`` for every
    stretch of one placement."""
    spans: dict[str, list[tuple[float, float, str]]] = {}
    open_spans: dict[str, tuple[float, str]] = {}
    for row in rows:
        current = dict(row.placement)
        for worker, (start, stages) in list(open_spans.items()):
            if current.get(worker) != stages:
                spans.setdefault(worker, []).append((start, row.t_s, stages))
                del open_spans[worker]
        for worker, stages in current.items():
            if worker not in open_spans:
                open_spans[worker] = (row.t_s, stages)
                spans.setdefault(worker, [])
    for worker, (start, stages) in open_spans.items():
        spans[worker].append((start, end_s, stages))
    return spans


def _color(stages: str) -> tuple[float, float, float]:
    # A stable color per placement text, the same in every run and every process; light
    # enough (0.45-0.95 per channel) for black text on top.
    digest = hashlib.sha256(stages.encode()).digest()
    return (0.45 + digest[0] / 512, 0.45 + digest[1] / 512, 0.45 + digest[2] / 512)


def _plot(rows: list[TimelineRow], title: str) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = sorted(rows, key=lambda row: row.t_s)  # stable: same-time rows keep their order
    end_s = rows[-1].t_s if rows else 0.0
    # A run whose events all share one time still gets a visible axis.
    right = end_s if end_s > 0 else 1.0
    spans = _spans(rows, end_s)
    workers = list(spans)  # first appearance: initial workers first, arrivals after
    span_height = max(1.5, min(0.3 * len(workers), 8.0))
    evaluated = [row for row in rows if row.eval_loss is not None]
    ratios = [1.5, max(1.0, span_height / 1.5), 1.5] + ([1.5] if evaluated else [])
    figure = Figure(figsize=(11, 3.0 + 2.2 + span_height + (1.5 if evaluated else 0.0)))
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(len(ratios), 1, sharex=True, gridspec_kw={"height_ratios": ratios}))
    live_ax, place_ax, rate_ax = axes[:3]
    figure.suptitle(title)

    if rows:
        times = [row.t_s for row in rows] + [right]
        counts = [row.live_workers for row in rows] + [rows[-1].live_workers]
        live_ax.step(times, counts, where="post", color="black", linewidth=1.2)
        top = max(counts)
        for events, marker, color, label in (
            (PREEMPTION_EVENTS, "v", "tab:red", "preempted"),
            (ARRIVAL_EVENTS, "^", "tab:green", "arrived"),
        ):
            marked = [row for row in rows if row.event in events]
            if marked:
                live_ax.scatter(
                    [row.t_s for row in marked],
                    [row.live_workers for row in marked],
                    marker=marker,
                    color=color,
                    zorder=3,
                    label=label,
                )
        if any(row.event in PREEMPTION_EVENTS | ARRIVAL_EVENTS for row in rows):
            live_ax.legend(loc="lower left", fontsize="small")
        live_ax.set_ylim(-0.2, top + 0.8)
    else:
        live_ax.text(
            0.5, 0.5, "no events recorded", ha="center", va="center", transform=live_ax.transAxes
        )
    live_ax.set_ylabel("live workers")

    label_min_width = right / 40  # narrower spans get no text: it would be unreadable
    font_size = "small" if len(workers) <= 16 else "xx-small"
    for index, worker in enumerate(workers):
        bars = [(start, max(stop - start, right / 2000)) for start, stop, _ in spans[worker]]
        colors = [_color(stages) for _, _, stages in spans[worker]]
        place_ax.broken_barh(bars, (index - 0.4, 0.8), facecolors=colors, edgecolor="white")
        for start, stop, stages in spans[worker]:
            if stop - start >= label_min_width:
                place_ax.text(
                    (start + stop) / 2, index, stages, ha="center", va="center", fontsize=font_size
                )
    place_ax.set_yticks(range(len(workers)))
    place_ax.set_yticklabels(workers, fontsize=font_size)
    # Inverted: the first worker on top, arrivals below in the order they came.
    place_ax.set_ylim(max(len(workers), 1) - 0.4, -0.6)
    place_ax.set_ylabel("placement")

    rated = [row for row in rows if row.samples_per_s is not None]
    if rated:
        rate_ax.plot(
            [row.t_s for row in rated],
            [row.samples_per_s for row in rated],
            marker="." if len(rated) < 200 else None,
            color="tab:blue",
        )
        rate_ax.set_ylim(bottom=0)
    rate_ax.set_ylabel("samples/s")
    if evaluated:
        eval_ax = axes[3]
        eval_ax.plot(
            [row.t_s for row in evaluated],
            [row.eval_loss for row in evaluated],
            marker="o",
            color="tab:purple",
        )
        eval_ax.set_ylabel("eval loss")
    axes[-1].set_xlabel("time since start (s)")
    rate_ax.set_xlim(0, right)
    for ax in axes:
        ax.grid(True, axis="x", alpha=0.3)
    figure.tight_layout()
    return figure


def summarize_recoveries(events: Iterable[TimelineRow]) -> dict[str, Any]:
    """Recovery times of a run from its timeline rows (taken in time order).

    An *episode* opens at a failure row (``preempted``, ``detected``, or a hung worker's
    :data:`HUNG_EVENTS`) when none is open (later failure rows before the recovery belong to
    the same episode: a multi-worker loss is one recovery) and closes at the next
    ``recovered`` row. Keys of the result:

    ``num_failures``
        failure rows seen.
    ``num_recoveries``
        ``recovered`` rows: every recovery, in memory or from a checkpoint, as the run's
        ``recoveries`` counts them (one ``recovered`` event each). ``num_unrecovered``
        counts an episode still open at the end (0 or 1).
    ``recovery_s``
        each closed episode's time from its first failure row to its ``recovered`` row (a
        ``recovered`` row with no failure row before it has no time).
    ``median_recovery_s``, ``max_recovery_s``, ``total_recovery_s``
        of ``recovery_s`` (None, None, 0.0 without recoveries).
    ``detection_s``
        per closed episode that holds both: its first ``preempted`` row to its first
        ``detected`` row; ``median_detection_s`` (None without any).

    A ``recovered`` row with no open episode (a failed step that lost no process) counts
    as a recovery but has no time (nothing to pair it with).
    """
    rows = sorted(events, key=lambda row: row.t_s)
    num_failures = 0
    num_recoveries = 0
    recovery_s: list[float] = []
    detection_s: list[float] = []
    opened: float | None = None
    preempted_at: float | None = None
    detected_at: float | None = None
    for row in rows:
        if row.event in FAILURE_EVENTS:
            num_failures += 1
            if opened is None:
                opened = row.t_s
            if row.event == "preempted" and preempted_at is None:
                preempted_at = row.t_s
            if row.event == "detected" and detected_at is None:
                detected_at = row.t_s
        elif row.event in RECOVERY_EVENTS:
            num_recoveries += 1
            if opened is None:
                continue
            recovery_s.append(row.t_s - opened)
            # A detection recorded before the preemption row (a late notice) has no latency.
            if preempted_at is not None and detected_at is not None and detected_at >= preempted_at:
                detection_s.append(detected_at - preempted_at)
            opened = preempted_at = detected_at = None
    return {
        "num_failures": num_failures,
        "num_recoveries": num_recoveries,
        "num_unrecovered": 0 if opened is None else 1,
        "recovery_s": recovery_s,
        "median_recovery_s": statistics.median(recovery_s) if recovery_s else None,
        "max_recovery_s": max(recovery_s) if recovery_s else None,
        "total_recovery_s": sum(recovery_s),
        "detection_s": detection_s,
        "median_detection_s": statistics.median(detection_s) if detection_s else None,
    }
