"""What faults a local run receives, as data: step-pinned injections and timed trace replays.

Two ways to disturb a local run, both decided before it starts so a run is reproducible:

Injections (:class:`Injection`, :func:`parse_injection`)
    ``--inject SIGNAL:STEP:WORKER[:PHASE]`` sends ``SIGKILL`` (``kill``) or ``SIGTERM``
    (``term``, a preemption notice with a grace period) to local worker ``WORKER`` during
    step ``STEP`` (counted from 1, as the progress lines count: ``kill:10:...`` hits the
    step whose line reads "step 10/N"), or stops it (``stop``: SIGSTOP, a worker that
    hangs, alive and silent, which the coordinator finds by its missed heartbeat and
    kills; the worker stops itself, at the boundary as in a phase); with ``PHASE``
    (forward, backward, send, recv, optimizer, committed: just after the step's commit
    point, before its update) in the middle of that phase of the step, without it at the
    step boundary (before the step's first instruction). ``--inject add:STEP`` starts one new local worker that trains from
    step ``STEP`` on. :class:`Injection` holds the step 0-based (``STEP - 1``, the index the
    engine and the coordinator count with), so the coordinator and the engine ask
    :func:`injections_at` which injections fire where they stand with their own index.
Timed events (:class:`TimedEvent`, :func:`trace_events`, :func:`random_preemptions`)
    A preemption trace (:mod:`spotline.plan.traces`) replayed in wall-clock time against at
    most ``max_workers`` local workers: "at ``at_s`` seconds, remove (or add) ``count``
    local workers". Which workers a removal hits is the coordinator's choice, not this
    module's: the trace names cloud nodes, not local ranks.

The replay rules, all in :func:`replay_trace`:

- A trace whose peak exceeds ``max_workers`` is scaled down with
  :func:`spotline.plan.traces.scale_trace`, which keeps every drop as at least one removal
  and every rise as at least one arrival.
- The start of the replay is the trace's first event time (traces often begin with hours of
  nothing, e.g. an availability log at level 0). The live count once every event of that
  instant is applied is the **initial** number of local workers: the starting state, not an
  event. Wall time 0 is that instant.
- Trace time maps to wall time as ``at_s = (t_s - t_first) / time_scale``: ``time_scale``
  is trace seconds per wall second (60 replays an hour of trace in a minute).
- Events of one trace instant merge into at most two :class:`TimedEvent`: the removals first,
  then the arrivals, so the local worker count never exceeds ``max_workers`` even for a
  replacement that arrives in the same millisecond as the preemption it replaces.
- A run that outlasts its trace replays it again (:func:`trace_cycle`): at the end of each
  cycle the count returns to the initial one (one removal or arrival event), then the
  trace's events repeat shifted by its duration. Real traces often end with few nodes; a
  replay that stopped there would fail runs that merely train slower than the machine the
  time scale was chosen on.
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from spotline.errors import UserError
from spotline.plan.traces import Trace, scale_trace, synthetic_trace

Signal = Literal["kill", "term", "stop", "add"]
Removal = Literal["kill", "term"]
Phase = Literal["forward", "backward", "send", "recv", "optimizer", "committed"]
TimedKind = Literal["remove", "add"]

PHASES: tuple[Phase, ...] = get_args(Phase)
REMOVALS: tuple[Removal, ...] = ("kill", "term")
INJECT_FORM = "SIGNAL:STEP:WORKER[:PHASE] with SIGNAL kill, term or stop, or add:STEP"
"""The expected form of ``--inject``, quoted by every parse error."""

_INTEGER_RE = re.compile(r"^[0-9]+$")
STEP_COUNT = "steps count from 1, as the progress lines do ('step 1/N' is the first)"
"""Why a STEP of 0 is refused, quoted by the ``--inject`` and ``--rescale`` errors."""


@dataclass(frozen=True)
class Injection:
    """One fault pinned to a step: ``signal`` (kill, term, stop) sent to local ``worker`` in
    step ``step`` (in ``phase``, or at the step's start when ``phase`` is None), or one
    worker added (``add``: ``worker`` and ``phase`` are None) that trains from ``step`` on.

    ``step`` is 0-based, the index the engine counts with; the flag's STEP (counted from 1,
    as the progress lines count) is ``step + 1`` (:attr:`number`). Made by
    :func:`parse_injection`; matched by :func:`injections_at`.
    """

    signal: Signal
    step: int
    worker: int | None
    phase: Phase | None = None

    def __post_init__(self) -> None:
        if self.signal not in ("kill", "term", "stop", "add"):
            raise ValueError(
                f"injection signal must be kill, term, stop or add, got {self.signal!r}"
            )
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"injection step must be an integer >= 0, got {self.step!r}")
        if self.signal == "add":
            if self.worker is not None or self.phase is not None:
                raise ValueError("an add injection names no worker and no phase")
        else:
            if isinstance(self.worker, bool) or not isinstance(self.worker, int):
                raise ValueError(
                    f"a {self.signal} injection needs a worker index, got {self.worker!r}"
                )
            if self.worker < 0:
                raise ValueError(f"injection worker must be >= 0, got {self.worker}")
            if self.phase is not None and self.phase not in PHASES:
                raise ValueError(f"injection phase must be one of {PHASES}, got {self.phase!r}")

    @property
    def number(self) -> int:
        """The step as ``--inject`` and the progress lines count it (from 1)."""
        return self.step + 1

    def __str__(self) -> str:
        """The ``--inject`` text that parses back to this injection."""
        if self.signal == "add":
            return f"add:{self.number}"
        text = f"{self.signal}:{self.number}:{self.worker}"
        return text if self.phase is None else f"{text}:{self.phase}"


def _bad_injection(text: str, why: str) -> UserError:
    return UserError(f"--inject {text!r}: {why}; expected {INJECT_FORM}")


def _parse_index(text: str, field_text: str, name: str) -> int:
    # Only plain decimal digits: int() would also take "+3", " 3", "3_0" and "٣".
    if not _INTEGER_RE.match(field_text):
        raise _bad_injection(text, f"{name} must be a non-negative integer")
    return int(field_text)


def _parse_step(text: str, field_text: str) -> int:
    """The 0-based index of the flag's STEP (counted from 1: 0 is refused)."""
    if not _INTEGER_RE.match(field_text):
        raise _bad_injection(text, "STEP must be a positive integer")
    number = int(field_text)
    if number == 0:
        raise _bad_injection(text, f"there is no step 0: {STEP_COUNT}")
    return number - 1


def parse_injection(text: str) -> Injection:
    """Parse one ``--inject`` value: ``kill|term|stop:STEP:WORKER[:PHASE]`` or ``add:STEP``,
    STEP counted from 1 (the injection's ``step`` is ``STEP - 1``).

    Surrounding whitespace is ignored; everything else is exact (lower-case names, decimal
    integers). Malformed text raises :class:`spotline.errors.UserError` (a ValueError) with
    one line naming the text and the expected form.
    """
    fields = text.strip().split(":")
    signal_text = fields[0]
    if signal_text == "add":
        if len(fields) != 2:
            raise _bad_injection(text, "add takes only a STEP")
        return Injection("add", _parse_step(text, fields[1]), None, None)
    if signal_text not in (*REMOVALS, "stop"):
        raise _bad_injection(text, f"unknown SIGNAL {signal_text!r}")
    if len(fields) not in (3, 4):
        raise _bad_injection(text, f"{signal_text} takes STEP:WORKER and an optional PHASE")
    step = _parse_step(text, fields[1])
    worker = _parse_index(text, fields[2], "WORKER")
    phase: Phase | None = None
    if len(fields) == 4:
        phase = _phase(text, fields[3])
    kind: Signal = "kill" if signal_text == "kill" else "stop" if signal_text == "stop" else "term"
    return Injection(kind, step, worker, phase)


def _phase(text: str, phase_text: str) -> Phase:
    for phase in PHASES:
        if phase == phase_text:
            return phase
    raise _bad_injection(text, f"PHASE must be one of {', '.join(PHASES)}, got {phase_text!r}")


def parse_injections(texts: Iterable[str]) -> tuple[Injection, ...]:
    """Parse every ``--inject`` value of a command line, sorted by step (stable).

    Two kill/term injections of the same worker at the same step and phase are a UserError
    (the second could never fire). Several ``add`` at one step add that many workers.
    """
    injections = [parse_injection(text) for text in texts]
    seen: set[tuple[int, int | None, Phase | None]] = set()
    for injection in injections:
        if injection.signal == "add":
            continue
        key = (injection.step, injection.worker, injection.phase)
        if key in seen:
            raise UserError(
                f"--inject {str(injection)!r}: worker {injection.worker} already receives a "
                f"signal at step {injection.number}; give each worker one fault per step and phase"
            )
        seen.add(key)
    return tuple(sorted(injections, key=lambda injection: injection.step))


def check_injections(injections: Iterable[Injection], *, num_workers: int, num_steps: int) -> None:
    """UserError unless every injection fits the run: its STEP at most ``num_steps`` and
    (for kill/term) worker < ``num_workers``, the number of local workers at the start.
    Pairs with the CLI, which knows both only after reading the config."""
    for injection in injections:
        if injection.step >= num_steps:
            raise UserError(
                f"--inject {str(injection)!r}: step {injection.number} is past the run's last "
                f"step {num_steps}; use a step from 1 to {num_steps}"
            )
        if injection.worker is not None and injection.worker >= num_workers:
            raise UserError(
                f"--inject {str(injection)!r}: worker {injection.worker} does not exist; the run "
                f"starts {num_workers} workers (0 to {num_workers - 1})"
            )


def injections_at(
    injections: Iterable[Injection],
    step: int,
    phase: Phase | None,
    worker: int | None,
) -> list[Injection]:
    """The injections that fire at ``step`` in ``phase`` (None: the step boundary) for
    ``worker`` (None: the ``add`` injections, which belong to no worker). Exact match on all
    three, in the given order. The engine asks with its own worker index and phase; the
    coordinator asks with ``phase=None`` for boundary kills and ``worker=None`` for adds."""
    return [
        injection
        for injection in injections
        if injection.step == step and injection.phase == phase and injection.worker == worker
    ]


def injections_for_step(injections: Iterable[Injection], step: int) -> list[Injection]:
    """Every injection of ``step``, whatever its worker or phase, in the given order."""
    return [injection for injection in injections if injection.step == step]


def signal_number(how: Removal) -> int:
    """The POSIX signal that delivers a removal: SIGKILL for ``kill``, SIGTERM for ``term``."""
    if how == "kill":
        return int(signal.SIGKILL)
    if how == "term":
        return int(signal.SIGTERM)
    raise ValueError(f"removal must be 'kill' or 'term', got {how!r}")


@dataclass(frozen=True)
class TimedEvent:
    """At ``at_s`` wall seconds after the run started, remove (``how``: kill or term) or add
    (``how`` None) ``count`` local workers. Made by :func:`trace_events` and
    :func:`random_preemptions`; the coordinator picks which workers."""

    at_s: float
    kind: TimedKind
    how: Removal | None
    count: int

    def __post_init__(self) -> None:
        if not math.isfinite(self.at_s) or self.at_s < 0:
            raise ValueError(f"at_s must be finite and >= 0, got {self.at_s}")
        if self.kind == "remove":
            if self.how not in REMOVALS:
                raise ValueError(f"a remove event needs how 'kill' or 'term', got {self.how!r}")
        elif self.kind == "add":
            if self.how is not None:
                raise ValueError(f"an add event has no how, got {self.how!r}")
        else:
            raise ValueError(f"event kind must be 'remove' or 'add', got {self.kind!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"count must be an integer >= 1, got {self.count!r}")


@dataclass(frozen=True)
class TraceReplay:
    """A trace replayed on local workers: start ``initial_workers`` workers (the starting
    state), then apply ``events`` at their wall times; the replay ends at ``duration_s`` wall
    seconds. ``source`` says which trace (and any scaling) it came from."""

    initial_workers: int
    events: tuple[TimedEvent, ...]
    duration_s: float
    source: str

    @property
    def final_workers(self) -> int:
        """The live count after the last event (before any cap the coordinator applies)."""
        count = self.initial_workers
        for event in self.events:
            count += event.count if event.kind == "add" else -event.count
        return count

    def peak_workers(self, max_workers: int) -> int:
        """The most workers ever live when arrivals beyond ``max_workers`` are dropped (as
        the coordinator drops them)."""
        live = peak = min(self.initial_workers, max_workers)
        for event in self.events:
            if event.kind == "add":
                live = min(max_workers, live + event.count)
            else:
                live = max(0, live - event.count)
            peak = max(peak, live)
        return peak


def trace_cycle(replay: TraceReplay, cycle: int) -> tuple[TimedEvent, ...]:
    """The events of the ``cycle``-th repetition of ``replay`` (cycle 0 is ``replay.events``):
    first the event that restores the initial count at ``cycle * duration_s``, then the
    trace's events shifted by that much. ValueError on a negative cycle."""
    if isinstance(cycle, bool) or not isinstance(cycle, int) or cycle < 0:
        raise ValueError(f"cycle must be an integer >= 0, got {cycle!r}")
    if cycle == 0:
        return replay.events
    # A zero-length trace (everything at its first instant) has nothing to repeat.
    assert replay.duration_s > 0, "a trace with a single instant has no events to repeat"
    offset = cycle * replay.duration_s
    wrap: list[TimedEvent] = []
    gap = replay.final_workers - replay.initial_workers
    how: Removal = next((e.how for e in replay.events if e.how is not None), "kill")
    if gap > 0:
        wrap.append(TimedEvent(offset, "remove", how, gap))
    elif gap < 0:
        wrap.append(TimedEvent(offset, "add", None, -gap))
    shifted = [TimedEvent(e.at_s + offset, e.kind, e.how, e.count) for e in replay.events]
    return (*wrap, *shifted)


def _check_time_scale(time_scale: float) -> None:
    if isinstance(time_scale, bool) or not math.isfinite(time_scale) or time_scale <= 0:
        raise ValueError(
            f"time_scale must be finite and > 0 (trace seconds per wall second), got {time_scale}"
        )


def replay_trace(
    trace: Trace, *, max_workers: int, time_scale: float, removal: Removal
) -> TraceReplay:
    """Replay ``trace`` on at most ``max_workers`` local workers (rules in the module
    docstring): the initial worker count, and the later removals (sent as ``removal``) and
    arrivals at wall times. ValueError on a non-positive ``max_workers`` or ``time_scale``,
    an unknown ``removal``, or a trace in which no node is ever live."""
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers must be an integer >= 1, got {max_workers!r}")
    _check_time_scale(time_scale)
    if removal not in REMOVALS:
        raise ValueError(f"removal must be 'kill' or 'term', got {removal!r}")
    scaled = scale_trace(trace, max_workers)
    if not scaled.events:
        raise ValueError(f"trace {trace.source or '(unnamed)'} holds no events; nothing to replay")
    start_t = scaled.events[0].t_s
    initial = 0
    # Per trace instant: (removals, arrivals), in time order.
    instants: list[tuple[float, int, int]] = []
    for event in scaled.events:
        if event.t_s == start_t:
            initial += 1 if event.kind == "add" else -1
            continue
        if not instants or instants[-1][0] != event.t_s:
            instants.append((event.t_s, 0, 0))
        t_s, removals, arrivals = instants[-1]
        if event.kind == "remove":
            instants[-1] = (t_s, removals + 1, arrivals)
        else:
            instants[-1] = (t_s, removals, arrivals + 1)
    if initial < 1:
        # A first instant that only removes cannot happen in a consistent trace, and one
        # whose adds and removes cancel leaves the run nothing to start on.
        raise ValueError(
            f"trace {trace.source or '(unnamed)'} has no live node after its first instant; "
            "a local run needs at least one worker to start"
        )
    events: list[TimedEvent] = []
    for t_s, removals, arrivals in instants:
        at_s = (t_s - start_t) / time_scale
        if removals:
            events.append(TimedEvent(at_s, "remove", removal, removals))
        if arrivals:
            events.append(TimedEvent(at_s, "add", None, arrivals))
    return TraceReplay(
        initial_workers=initial,
        events=tuple(events),
        duration_s=(scaled.duration_s - start_t) / time_scale,
        source=scaled.source,
    )


def median_node_lifetime_s(trace: Trace, *, max_workers: int) -> float:
    """The median time (trace seconds) a node of ``trace`` lives when replayed on at most
    ``max_workers`` local workers (the cap scales the trace as :func:`replay_trace` does).
    A node still live at the end of the recording counts until then, so the figure never
    understates. ValueError on a trace with no node."""
    scaled = scale_trace(trace, max_workers)
    added: dict[str, float] = {}
    lifetimes: list[float] = []
    for event in scaled.events:
        if event.kind == "add":
            added[event.node] = event.t_s
        else:
            lifetimes.append(event.t_s - added.pop(event.node))
    lifetimes += [scaled.duration_s - t_s for t_s in added.values()]
    if not lifetimes:
        raise ValueError(f"trace {trace.source or '(unnamed)'} has no node")
    lifetimes.sort()
    mid = len(lifetimes) // 2
    return lifetimes[mid] if len(lifetimes) % 2 else (lifetimes[mid - 1] + lifetimes[mid]) / 2


def check_node_lifetimes(
    trace: Trace, *, max_workers: int, time_scale: float, startup_s: float, name: str
) -> None:
    """Refuse a wall-clock replay whose nodes live, scaled by ``time_scale``, shorter than a
    worker takes to start (``startup_s``, wall seconds): arrivals would be preempted before
    they could join, and no step would ever commit. UserError naming what to change."""
    median_s = median_node_lifetime_s(trace, max_workers=max_workers)
    wall_s = median_s / time_scale
    if wall_s >= startup_s:
        return
    # A node should live several start-ups: it must also join a generation and train.
    fitting = math.floor(median_s / (4 * startup_s))
    lower = f"--time-scale {fitting} or lower" if fitting >= 1 else "a lower --time-scale"
    raise UserError(
        f"--trace {name} at --time-scale {time_scale:g}: its nodes live a median {wall_s:.2f} s "
        f"on the wall clock, shorter than the {startup_s:.1f} s a worker takes to start here, "
        f"so no step could commit; use --trace-clock steps (start-up is not trace time), or "
        f"{lower}"
    )


def trace_events(
    trace: Trace, *, max_workers: int, time_scale: float, removal: Removal
) -> list[TimedEvent]:
    """The timed events of :func:`replay_trace` (whose ``initial_workers`` is the starting
    state and not among them)."""
    return list(
        replay_trace(trace, max_workers=max_workers, time_scale=time_scale, removal=removal).events
    )


def random_preemptions(
    rate_per_worker_hour: float,
    num_workers: int,
    duration_s: float,
    seed: int,
    time_scale: float,
    replace_after_s: float,
    *,
    removal: Removal = "kill",
) -> list[TimedEvent]:
    """Poisson preemptions of ``num_workers`` local workers, as timed events.

    Every quantity but ``time_scale`` is in trace (cloud) time, as for a recorded trace: each
    worker is preempted after an exponential lifetime of rate ``rate_per_worker_hour`` per
    hour, a replacement arrives ``replace_after_s`` later, the run lasts ``duration_s``. It is
    :func:`spotline.plan.traces.synthetic_trace` replayed with :func:`trace_events` (so wall
    time is trace time / ``time_scale``; all ``num_workers`` are the starting state).
    Deterministic for a given ``seed``. ValueError on negative or non-finite inputs.
    """
    _check_time_scale(time_scale)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")
    for name, value in (
        ("rate_per_worker_hour", rate_per_worker_hour),
        ("duration_s", duration_s),
        ("replace_after_s", replace_after_s),
    ):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    trace = synthetic_trace(num_workers, rate_per_worker_hour, duration_s, seed, replace_after_s)
    return trace_events(trace, max_workers=num_workers, time_scale=time_scale, removal=removal)


def live_workers_over_time(
    initial_workers: int, events: Sequence[TimedEvent]
) -> list[tuple[float, int]]:
    """The local worker count as a step function ``[(at_s, count), ...]``: ``(0.0,
    initial_workers)`` then the count after each event, in event order. For checks and
    plots of a replay."""
    points = [(0.0, initial_workers)]
    count = initial_workers
    for event in events:
        count += event.count if event.kind == "add" else -event.count
        points.append((event.at_s, count))
    return points


# --------------------------------------------------------------------------- rescales

RESCALE_FORM = "STEP:M[,STEP:M...] with increasing steps (counted from 1) and M >= 1 processes"


@dataclass(frozen=True)
class ScaleTo:
    """``--rescale STEP:M``: from step STEP on (counted from 1, as ``--inject add:STEP``) the
    job runs on ``num_workers`` worker processes; the coordinator kills (SIGKILL) or starts
    the difference at the boundary before it. ``step`` is that boundary's 0-based index
    (``STEP - 1``: the steps done before it), the flag's STEP is :attr:`number`."""

    step: int
    num_workers: int

    @property
    def number(self) -> int:
        """The step as ``--rescale`` and the progress lines count it (from 1)."""
        return self.step + 1

    def __str__(self) -> str:
        return f"{self.number}:{self.num_workers}"


def parse_rescales(text: str | None) -> tuple[ScaleTo, ...]:
    """Parse ``--rescale``: comma-separated ``STEP:M``, steps strictly increasing, M >= 1.

    None or empty text: no rescale. Malformed text raises UserError naming the bad part.
    """
    if text is None or not text.strip():
        return ()
    out: list[ScaleTo] = []
    for part in text.split(","):
        fields = part.strip().split(":")
        if len(fields) != 2 or not all(_INTEGER_RE.match(f) for f in fields):
            raise UserError(
                f"--rescale {text!r}: bad part {part.strip()!r}; expected {RESCALE_FORM}"
            )
        if int(fields[0]) == 0:
            raise UserError(f"--rescale {text!r}: there is no step 0: {STEP_COUNT}")
        rescale = ScaleTo(int(fields[0]) - 1, int(fields[1]))
        if rescale.num_workers < 1:
            raise UserError(
                f"--rescale {text!r}: {rescale} leaves no process; expected {RESCALE_FORM}"
            )
        if out and rescale.step <= out[-1].step:
            raise UserError(
                f"--rescale {text!r}: step {rescale.number} does not come after step "
                f"{out[-1].number}; expected {RESCALE_FORM}"
            )
        out.append(rescale)
    return tuple(out)


def check_rescales(
    rescales: Sequence[ScaleTo], *, num_steps: int, num_stages: int, max_workers: int
) -> None:
    """UserError unless every rescale fits the run: a STEP inside it (after step 1, which
    trains on the processes the run starts with), at least ``num_stages`` processes (one
    pipeline), and at most ``max_workers``."""
    for rescale in rescales:
        if not 0 < rescale.step < num_steps:
            raise UserError(
                f"--rescale {rescale}: step {rescale.number} is not inside the run; use a step "
                f"from 2 to {num_steps} (step 1 trains on the processes the run starts with)"
            )
        if rescale.num_workers < num_stages:
            raise UserError(
                f"--rescale {rescale}: {rescale.num_workers} process(es) cannot hold the "
                f"{num_stages} stages of one pipeline; use at least {num_stages}"
            )
        if rescale.num_workers > max_workers:
            raise UserError(
                f"--rescale {rescale}: {rescale.num_workers} processes exceed --max-workers "
                f"{max_workers}; raise --max-workers or rescale to fewer"
            )
