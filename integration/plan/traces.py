"""Spot-instance preemption traces: parse three recorded formats into one normalised form.

A :class:`Trace` is the list of node arrivals and preemptions over time; the runtime's trace
replayer (launch/) and the cluster simulator (``spotline.sim``) both consume it, so every
format decision lives here once.

Formats read by :func:`load_trace` (detected from the first non-blank line, or forced with
``format=``):

``events``
    ``DELTA_MS,add|remove,NODE`` one event a line, no header. ``DELTA_MS`` is milliseconds
    since the start of the trace (absolute, not a gap). Node names are kept.
``aws``
    ``x,y`` availability step function (CRLF line endings are fine): ``x`` time since the
    start, ``y`` the number of running spot instances; a change is normally written as two
    rows with the same ``x`` (old level, then new level). Units of ``x``: **hours when the
    largest x is below 200, seconds otherwise** (:data:`AWS_HOURS_BELOW`; 200 h is more than
    8 days, and a recording in seconds that ends before 200 s would be a 3-minute log, which
    no availability recording is). ``time_unit=`` overrides the rule.
``gcp``
    ``YYYY-MM-DD, HH:MM:SS, COUNT``: the number of running preemptible VMs at that moment.
    Timestamps repeat and go backwards: rows are sorted by timestamp and, for equal
    timestamps, the **last row in file order wins**. Time 0 is the earliest timestamp.

Count-based formats (``aws``, ``gcp``) name no nodes, so :func:`trace_from_levels` invents
them: a rise of k adds k fresh nodes named ``node1``, ``node2``, ... in arrival order; a drop
of k removes k of the live nodes chosen by a seeded pseudo-random draw
(``random.Random(removal_seed).sample`` over the live nodes in arrival order). The draw is
deterministic for a given seed; it is deliberately not "oldest first" or "newest first",
because the simulator places workers in arrival order, and a removal order that lines up
with the placement order would turn every multi-node drop into adjacent-stage losses (an
artefact of the replayer, not a property of the cloud).
"""

from __future__ import annotations

import heapq
import math
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

from spotline.errors import UserError

EventKind = Literal["add", "remove"]
TraceFormat = Literal["events", "aws", "gcp"]
TimeUnit = Literal["auto", "s", "h"]

TRACE_FORMATS: tuple[TraceFormat, ...] = ("events", "aws", "gcp")
AWS_HOURS_BELOW = 200.0
"""An ``aws`` trace whose largest x is below this is read in hours, otherwise in seconds."""

_EXPECTED: dict[TraceFormat, str] = {
    "events": "`DELTA_MS,add|remove,NODE` (e.g. `0,add,node1`)",
    "aws": "`x,y` with x a time and y a count of instances (e.g. `21529,4`)",
    "gcp": "`YYYY-MM-DD, HH:MM:SS, COUNT` (e.g. `2021-12-10, 13:07:45, 80`)",
}
_GCP_RE = re.compile(r"^\s*(\d{4}-\d{2}-\d{2})\s*,\s*(\d{1,2}:\d{2}:\d{2})\s*,\s*(\d+)\s*$")
_EVENTS_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*,\s*(add|remove)\s*,\s*([^,\s]+)\s*$")
_AWS_RE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*,\s*(\d+(?:\.0*)?)\s*$")


@dataclass(frozen=True)
class TraceEvent:
    """One change of membership: node ``node`` arrived (``add``) or was preempted (``remove``)
    at ``t_s`` seconds after the start of the trace."""

    t_s: float
    kind: EventKind
    node: str


@dataclass(frozen=True)
class Trace:
    """Node arrivals and preemptions in time order, whatever format they came from.

    ``events`` is sorted by time (ties keep the order in which they happened); the nodes live
    at time 0 are the ones added by events at ``t_s == 0``. ``duration_s`` is the end of the
    recording (at least the last event). ``source`` says where the trace came from, for
    reports. Construction checks consistency: an ``add`` of a node that is live, or a
    ``remove`` of a node that is not, is a ValueError. A node may be added again after it was
    removed (a recycled host name is a new arrival).
    """

    events: tuple[TraceEvent, ...]
    duration_s: float
    source: str = ""

    def __post_init__(self) -> None:
        if not math.isfinite(self.duration_s) or self.duration_s < 0:
            raise ValueError(f"trace duration must be finite and >= 0, got {self.duration_s}")
        live: set[str] = set()
        previous_t = 0.0
        for index, event in enumerate(self.events):
            if not math.isfinite(event.t_s) or event.t_s < previous_t:
                raise ValueError(
                    f"trace events must have finite times in increasing order from 0: event "
                    f"{index} at t={event.t_s} follows t={previous_t}"
                )
            previous_t = event.t_s
            if event.kind == "add":
                if event.node in live:
                    raise ValueError(f"trace adds node {event.node!r} at t={event.t_s} twice")
                live.add(event.node)
            elif event.kind == "remove":
                if event.node not in live:
                    raise ValueError(
                        f"trace removes node {event.node!r} at t={event.t_s} but it is not live"
                    )
                live.remove(event.node)
            else:
                raise ValueError(f"trace event kind must be 'add' or 'remove', got {event.kind!r}")
        if self.duration_s < previous_t:
            raise ValueError(
                f"trace duration {self.duration_s} s ends before its last event at {previous_t} s"
            )

    @property
    def initial_nodes(self) -> int:
        """How many nodes are live once the events at time 0 are applied."""
        count = 0
        for event in self.events:
            if event.t_s > 0:
                break
            count += 1 if event.kind == "add" else -1
        return count

    @property
    def peak_nodes(self) -> int:
        """The most nodes live at once (after all events of one time are applied)."""
        return max((count for _, count in live_nodes_over_time(self)), default=0)

    @property
    def num_removals(self) -> int:
        """How many preemptions the trace holds."""
        return sum(1 for event in self.events if event.kind == "remove")


def live_nodes_over_time(trace: Trace) -> tuple[tuple[float, int], ...]:
    """The number of live nodes as a step function: ``((t_s, count), ...)``.

    One point at time 0 and one per later time at which the count changes, each giving the
    count after every event of that time is applied. Pairs with the plots of the simulator.
    """
    points: list[tuple[float, int]] = [(0.0, 0)]
    count = 0
    for event in trace.events:
        count += 1 if event.kind == "add" else -1
        if event.t_s == points[-1][0]:
            points[-1] = (event.t_s, count)
        elif count != points[-1][1]:
            points.append((event.t_s, count))
    return tuple(points)


def trace_from_levels(
    levels: Sequence[tuple[float, int]],
    duration_s: float,
    *,
    source: str = "",
    removal_seed: int = 0,
) -> Trace:
    """Turn a count step function ``[(t_s, count), ...]`` (sorted by time) into events.

    The count before the first point is 0. A rise adds fresh nodes ``node1``, ``node2``, ...;
    a drop of k removes k live nodes drawn with ``random.Random(removal_seed)`` (see the
    module docstring for why not oldest- or newest-first). Deterministic for a given seed.
    """
    rng = random.Random(removal_seed)
    live: list[str] = []  # arrival order, so the draw is reproducible
    events: list[TraceEvent] = []
    next_id = 1
    previous_t = -math.inf
    for t_s, count in levels:
        if t_s < previous_t:
            raise ValueError(f"levels must be sorted by time: {t_s} after {previous_t}")
        if count < 0:
            raise ValueError(f"a node count cannot be negative: {count} at t={t_s}")
        previous_t = t_s
        if count > len(live):
            for _ in range(count - len(live)):
                node = f"node{next_id}"
                next_id += 1
                live.append(node)
                events.append(TraceEvent(t_s, "add", node))
        elif count < len(live):
            gone = set(rng.sample(live, len(live) - count))
            # Removals are listed in arrival order so the event list is reproducible too.
            events.extend(TraceEvent(t_s, "remove", node) for node in live if node in gone)
            live = [node for node in live if node not in gone]
    return Trace(tuple(events), duration_s, source)


def _detect_format(line: str) -> TraceFormat | None:
    if _EVENTS_RE.match(line):
        return "events"
    if _GCP_RE.match(line):
        return "gcp"
    if _AWS_RE.match(line):
        return "aws"
    return None


def _malformed(path: Path, line_number: int, trace_format: TraceFormat, line: str) -> UserError:
    return UserError(
        f"{path}:{line_number}: malformed {trace_format} trace line {line.strip()!r}; "
        f"expected {_EXPECTED[trace_format]}"
    )


def _parse_events(path: Path, lines: Iterable[tuple[int, str]]) -> Trace:
    rows: list[TraceEvent] = []
    for line_number, line in lines:
        match = _EVENTS_RE.match(line)
        if match is None:
            raise _malformed(path, line_number, "events", line)
        kind: EventKind = "add" if match.group(2) == "add" else "remove"
        rows.append(TraceEvent(float(match.group(1)) / 1000.0, kind, match.group(3)))
    # The format promises time order; a stable sort tolerates files that break it without
    # reordering events of the same instant.
    rows.sort(key=lambda event: event.t_s)
    duration_s = rows[-1].t_s if rows else 0.0
    try:
        return Trace(tuple(rows), duration_s, str(path))
    except ValueError as error:
        raise UserError(f"{path}: inconsistent events trace: {error}") from None


def _parse_aws(
    path: Path, lines: Iterable[tuple[int, str]], time_unit: TimeUnit, removal_seed: int
) -> Trace:
    points: list[tuple[float, int]] = []
    for line_number, line in lines:
        match = _AWS_RE.match(line)
        if match is None:
            raise _malformed(path, line_number, "aws", line)
        points.append((float(match.group(1)), int(float(match.group(2)))))
    if not points:
        raise UserError(f"{path}: the aws trace holds no rows; expected {_EXPECTED['aws']}")
    # Stable sort: rows of one x keep their file order (old level, then new level).
    points.sort(key=lambda point: point[0])
    largest_x = points[-1][0]
    unit = time_unit
    if unit == "auto":
        unit = "h" if largest_x < AWS_HOURS_BELOW else "s"
    scale = 3600.0 if unit == "h" else 1.0
    start_x = points[0][0]
    levels: list[tuple[float, int]] = []
    for x, count in points:
        t_s = (x - start_x) * scale
        if levels and levels[-1][0] == t_s:
            levels[-1] = (t_s, count)  # the last row of one x is the new level
        else:
            levels.append((t_s, count))
    return trace_from_levels(
        levels, (largest_x - start_x) * scale, source=str(path), removal_seed=removal_seed
    )


def _parse_gcp(path: Path, lines: Iterable[tuple[int, str]], removal_seed: int) -> Trace:
    by_time: dict[datetime, int] = {}
    for line_number, line in lines:
        match = _GCP_RE.match(line)
        if match is None:
            raise _malformed(path, line_number, "gcp", line)
        try:
            moment = datetime.strptime(f"{match.group(1)} {match.group(2)}", "%Y-%m-%d %H:%M:%S")
        except ValueError:
            raise _malformed(path, line_number, "gcp", line) from None
        by_time[moment] = int(match.group(3))  # a later row of the same moment wins
    if not by_time:
        raise UserError(f"{path}: the gcp trace holds no rows; expected {_EXPECTED['gcp']}")
    moments = sorted(by_time)
    start = moments[0]
    levels = [((moment - start).total_seconds(), by_time[moment]) for moment in moments]
    return trace_from_levels(levels, levels[-1][0], source=str(path), removal_seed=removal_seed)


def load_trace(
    path: str | Path,
    *,
    format: TraceFormat | None = None,
    time_unit: TimeUnit = "auto",
    removal_seed: int = 0,
) -> Trace:
    """Read a trace file in any of the three formats (see the module docstring).

    The format is detected from the first non-blank line unless ``format`` is given;
    ``time_unit`` ("auto", "s", "h") applies to ``aws`` traces only; ``removal_seed`` picks
    which nodes a count drop removes in count-based formats. A missing file, an unknown
    format or a malformed line raises :class:`spotline.errors.UserError` naming the file,
    the line number and the expected form.
    """
    path = Path(path)
    if format is not None and format not in TRACE_FORMATS:
        raise UserError(f"unknown trace format {format!r}; use one of {', '.join(TRACE_FORMATS)}")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise UserError(f"trace file {path} does not exist; give the path to a trace") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read trace file {path}: {error}") from None
    # splitlines() handles CRLF and lone CR; blank lines (a trailing newline) are skipped.
    lines = [
        (number, line) for number, line in enumerate(text.splitlines(), start=1) if line.strip()
    ]
    if not lines:
        raise UserError(f"trace file {path} is empty; expected one of the trace formats")
    trace_format = format
    if trace_format is None:
        trace_format = _detect_format(lines[0][1])
        if trace_format is None:
            expected = "; or ".join(_EXPECTED.values())
            raise UserError(
                f"{path}:{lines[0][0]}: cannot tell the trace format from "
                f"{lines[0][1].strip()!r}; expected {expected}"
            )
    if trace_format == "events":
        return _parse_events(path, lines)
    if trace_format == "aws":
        return _parse_aws(path, lines, time_unit, removal_seed)
    return _parse_gcp(path, lines, removal_seed)


def resize_trace(trace: Trace, num_nodes: int, *, removal_seed: int = 0) -> Trace:
    """Rescale a trace so its peak is ``num_nodes`` (up or down), keeping its preemptions.

    Rule: the live-node count c(t) becomes round_half_up(c(t) * num_nodes / peak), except
    that every drop of the original removes at least one node of the new trace (when any is
    live) and every rise adds at least one (up to ``num_nodes``), so no preemption or
    arrival disappears in the rounding. Nodes are renamed and chosen as in
    :func:`trace_from_levels`. A trace whose peak already is ``num_nodes`` comes back as is.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    peak = trace.peak_nodes
    if peak == num_nodes or peak == 0:
        return trace
    levels: list[tuple[float, int]] = []
    previous_original = 0
    previous_scaled = 0
    for t_s, count in live_nodes_over_time(trace):
        # Integer arithmetic for round-half-up, so the rule has no float edge cases.
        scaled = (2 * count * num_nodes + peak) // (2 * peak)
        if count < previous_original and scaled >= previous_scaled and previous_scaled > 0:
            scaled = previous_scaled - 1
        elif count > previous_original and scaled <= previous_scaled:
            scaled = min(previous_scaled + 1, num_nodes)
        levels.append((t_s, scaled))
        previous_original, previous_scaled = count, scaled
    return trace_from_levels(
        levels,
        trace.duration_s,
        source=f"{trace.source} (scaled to {num_nodes} nodes)",
        removal_seed=removal_seed,
    )


def scale_trace(trace: Trace, max_nodes: int, *, removal_seed: int = 0) -> Trace:
    """Fit a trace under a local cap of ``max_nodes`` nodes.

    A trace whose peak exceeds the cap is scaled down with :func:`resize_trace` (counts scaled
    by max_nodes / peak, round half up, every drop still removes at least one node); a trace
    that already fits comes back unchanged. Pairs with the local launcher, which cannot start
    more workers than it has slots.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    if trace.peak_nodes <= max_nodes:
        return trace
    return resize_trace(trace, max_nodes, removal_seed=removal_seed)


def synthetic_trace(
    num_nodes: int,
    rate_per_node_hour: float,
    duration_s: float,
    seed: int,
    replace_after_s: float,
) -> Trace:
    """Poisson preemptions on a cluster that asks for ``num_nodes`` nodes.

    ``num_nodes`` nodes are added at time 0. Every live node is preempted after an
    exponentially distributed lifetime with rate ``rate_per_node_hour`` per hour (memoryless,
    so each node independently); a replacement node is added ``replace_after_s`` seconds after
    each preemption (when that is before ``duration_s``) and lives by the same law. Nodes are
    named ``node1``, ``node2``, ... in arrival order. Deterministic for a given ``seed``.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    if rate_per_node_hour < 0 or not math.isfinite(rate_per_node_hour):
        raise ValueError(f"rate_per_node_hour must be finite and >= 0, got {rate_per_node_hour}")
    if duration_s < 0 or replace_after_s < 0:
        raise ValueError("duration_s and replace_after_s must be >= 0")
    rng = random.Random(seed)
    rate_per_s = rate_per_node_hour / 3600.0
    events: list[TraceEvent] = []
    # Heap of (time, order, kind, node): order breaks ties so the result is deterministic.
    pending: list[tuple[float, int, EventKind, str]] = []
    order = 0
    next_id = 1

    def arrive(t_s: float) -> None:
        nonlocal order, next_id
        node = f"node{next_id}"
        next_id += 1
        heapq.heappush(pending, (t_s, order, "add", node))
        order += 1

    for _ in range(num_nodes):
        arrive(0.0)
    while pending:
        t_s, _, kind, node = heapq.heappop(pending)
        events.append(TraceEvent(t_s, kind, node))
        if kind == "add":
            if rate_per_s > 0:
                end_s = t_s + rng.expovariate(rate_per_s)
                if end_s < duration_s:
                    heapq.heappush(pending, (end_s, order, "remove", node))
                    order += 1
        elif t_s + replace_after_s < duration_s:
            arrive(t_s + replace_after_s)
    return Trace(
        tuple(events),
        duration_s,
        f"synthetic: {num_nodes} nodes, {rate_per_node_hour}/node-hour, seed {seed}",
    )
