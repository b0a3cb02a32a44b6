"""The instruction profiles of bench runs: read, paired by round, and laid on a timeline.

A run with ``SPOTLINE_INSTRUCTION_PROFILE`` set leaves one profile per rank
(:mod:`spotline.pipeline.instruction_profile`). This module turns them into the benches' figures:

- the CPU of each instruction per step, the schedule thread's and the other threads', and
  one variant's against a baseline's, paired round by round (:func:`paired_cpu`). CPU time
  stands still while a job is stopped, so this holds for rounds that take turns;
- the cores' idle time by what the waiting ranks were in (:func:`idle_account`), from the
  ranks' timelines, over the windows in which the run had the host to itself (its turns),
  and one variant's against a baseline's, paired round by round (:func:`paired_idle`).

Used by ``spotline bench profile`` (one run of each), and by ``spotline bench redundancy``
and ``spotline bench foundation`` with ``--profile`` (every run of every round).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from spotline.launch.bench.alternate import Launcher, spotline_launcher
from spotline.launch.bench.jobs import RunFailed, median, spread, worker_id_order
from spotline.pipeline.instruction_profile import (
    PROFILE_ENV,
    TIMELINE_PARTS,
    WHOLE_STEP,
    InstructionProfile,
    InstructionSpan,
)


def read_profiles(folder: Path) -> list[InstructionProfile]:
    """The profiles a run wrote into ``folder``, in rank order (one file per worker id)."""
    return [
        InstructionProfile.from_json(json.loads(p.read_text()))
        for p in sorted(folder.glob("*.json"), key=lambda p: worker_id_order(p.stem))
    ]


# The CPU of one instruction in one step: the schedule thread's and the other threads'.
CpuSplit = tuple[float, float]


def cpu_split_per_step(profile: InstructionProfile) -> dict[str, CpuSplit]:
    """CPU seconds per step by instruction (``WHOLE_STEP``: the step), split into the
    schedule thread's and the rest of the process's (gloo's and the sender's threads)."""
    process, thread = profile.cpu_per_step(), profile.thread_cpu_per_step()
    assert set(thread) == set(process), "a profile without the schedule thread's CPU"
    return {name: (thread[name], process[name] - thread[name]) for name in process}


def paired_cpu(
    rounds: Sequence[tuple[Sequence[Mapping[str, CpuSplit]], Sequence[Mapping[str, CpuSplit]]]],
) -> list[dict[str, dict[str, Any]]]:
    """Per rank and instruction, a variant's CPU per step against a baseline's, paired by
    round: ``rounds`` holds, per round, (variant, baseline), each a per-rank list of
    :func:`cpu_split_per_step`. For each: both sides' medians over rounds (schedule thread,
    other threads) and the spread of the per-round differences, variant minus baseline. An
    instruction one side never ran counts 0 there (lazy's ``ReplicaStep`` against off)."""
    assert rounds and len({len(r) for pair in rounds for r in pair}) == 1, "ranks differ"
    ranks = len(rounds[0][0])
    out: list[dict[str, dict[str, Any]]] = []
    for rank in range(ranks):
        names = sorted({n for pair in rounds for side in pair for n in side[rank]})
        per_name: dict[str, dict[str, Any]] = {}
        for name in names:
            variant = [pair[0][rank].get(name, (0.0, 0.0)) for pair in rounds]
            base = [pair[1][rank].get(name, (0.0, 0.0)) for pair in rounds]
            per_name[name] = {
                "variant_s": [median([v[i] for v in variant]) for i in (0, 1)],
                "baseline_s": [median([b[i] for b in base]) for i in (0, 1)],
                "difference_s": [
                    spread([v[i] - b[i] for v, b in zip(variant, base, strict=True)])
                    for i in (0, 1)
                ],
            }
        out.append(per_name)
    return out


def ms_difference(spread_s: Mapping[str, float]) -> str:
    """``+1.5 (-0.2..+3.0)``: a paired difference's :func:`spread` in ms, signed."""
    low, mid, high = (spread_s[k] * 1000 for k in ("min", "median", "max"))
    return f"{mid:+.1f} ({low:+.1f}..{high:+.1f})"


def format_paired_cpu(
    paired: Sequence[Mapping[str, Mapping[str, Any]]], variant: str, baseline: str
) -> str:
    """A Markdown table of :func:`paired_cpu`: ms of CPU per step, schedule thread / other
    threads, each instruction whose difference's median is at least 0.05 ms either way,
    and the whole step (last)."""

    def ms(pair: Sequence[float]) -> str:
        return f"{pair[0] * 1000:.1f} / {pair[1] * 1000:.1f}"

    rows = [
        f"| rank | instruction | {baseline} | {variant} | {variant} - {baseline}, schedule thread "
        "| other threads |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for rank, per_name in enumerate(paired):
        shown = [
            n
            for n, f in per_name.items()
            if n != WHOLE_STEP and max(abs(d["median"]) for d in f["difference_s"]) >= 5e-5
        ]
        for name in [*shown, WHOLE_STEP] if WHOLE_STEP in per_name else shown:
            f = per_name[name]
            label = "the whole step" if name == WHOLE_STEP else name
            rows.append(
                f"| {rank} | {label} | {ms(f['baseline_s'])} | {ms(f['variant_s'])} "
                f"| {ms_difference(f['difference_s'][0])} | {ms_difference(f['difference_s'][1])} |"
            )
    return "\n".join(rows)


# The instructions during which a rank computes (takes a core). In any other (a send, a
# receive, a collective, the commit barrier and the loss's exchange inside OptimizerStep) or
# between two instructions, it waits.
COMPUTING = frozenset(
    {
        "ForwardPass",
        "BackwardPass",
        "LoadMicroBatch",
        "BeginLogicalWorker",
        "KeepLogicalGradients",
        "OptimizerStep",
        "ReplicaStep",
        "ReplicaLoad",
        "StashOutput",
        "StashInputGrad",
    }
)
PART_NAMES = frozenset(TIMELINE_PARTS.values())
BETWEEN = "(between instructions)"
SLICE_S = 0.001


@dataclass(frozen=True)
class IdleAccount:
    """Where the cores stood idle over a window of the ranks' timelines: the window's
    seconds, the optimizer steps the ranks ended inside it (the mean over ranks), and the
    idle core seconds by what the waiting ranks were in."""

    window_s: float
    steps: float
    idle_s: dict[str, float]

    def per_step(self) -> dict[str, float]:
        return {name: s / max(self.steps, 1e-9) for name, s in self.idle_s.items()}


Window = tuple[float, float]
"""A span of the host's clock (Unix time, start and end)."""


def within(windows: Sequence[Window] | None, start: float, end: float) -> bool:
    """Whether ``start``..``end`` lies inside one of ``windows`` (None: no windows, anywhere
    counts)."""
    return windows is None or any(a <= start and end <= b for a, b in windows)


def idle_account(
    timelines: Sequence[Sequence[InstructionSpan]],
    cores: int,
    windows: Sequence[Window] | None = None,
) -> IdleAccount:
    """The cores' idle time over the window every rank's timeline covers (from the latest
    first event to the earliest last), a SLICE_S at a time: ``cores`` less the ranks in a
    COMPUTING instruction, at least 0, shared equally among the other ranks' waits. A part
    of an instruction (the commit barrier inside OptimizerStep) stands for its instruction
    where it runs. With ``windows`` (a job's turns), only the slices wholly inside one count,
    and only the optimizer steps that end inside one: while a job is stopped its ranks stand
    in whatever they were in, and that is no wait of theirs."""
    assert timelines and all(timelines), "a rank without a timeline"
    start = max(t[0].start for t in timelines)
    end = min(t[-1].end for t in timelines)
    slices = max(0, int((end - start) / SLICE_S))
    if windows is None:
        counted = [True] * slices
    else:
        counted = [False] * slices
        for w_start, w_end in windows:
            first = max(0, math.ceil((w_start - start) / SLICE_S))
            last = min(slices, math.floor((w_end - start) / SLICE_S))
            counted[first:last] = [True] * max(0, last - first)
    states: list[list[str]] = []
    for timeline in timelines:
        state = [BETWEEN] * slices
        # Instructions first, then their parts over them (a part lies inside its instruction).
        for event in sorted(timeline, key=lambda e: e.name in PART_NAMES):
            first = max(0, int((event.start - start) / SLICE_S))
            last = min(slices, int((event.end - start) / SLICE_S) + 1)
            if first < last:
                state[first:last] = [event.name] * (last - first)
        states.append(state)
    idle: dict[str, float] = {}
    for k in range(slices):
        if not counted[k]:
            continue
        waiting = [s[k] for s in states if s[k] not in COMPUTING]
        free = cores - (len(states) - len(waiting))
        if free > 0 and waiting:
            for name in waiting:
                idle[name] = idle.get(name, 0.0) + free * SLICE_S / len(waiting)

    steps = sum(
        sum(
            1
            for e in t
            if e.name == "OptimizerStep" and start <= e.end <= end and within(windows, e.end, e.end)
        )
        for t in timelines
    ) / len(timelines)
    return IdleAccount(sum(counted) * SLICE_S, steps, idle)


ALL_WAITS = "all"
""":func:`paired_idle`'s row for the idle time of every wait together."""


def paired_idle(
    rounds: Sequence[tuple[Mapping[str, float], Mapping[str, float]]],
) -> dict[str, dict[str, Any]]:
    """Per wait, a variant's idle core seconds per step against a baseline's, paired by
    round: ``rounds`` holds, per round, (variant, baseline), each an
    :meth:`IdleAccount.per_step`. For each wait, and for ALL_WAITS: both sides' medians over
    rounds and the spread of the per-round differences, variant minus baseline. A wait one
    side never stood in counts 0 there."""
    assert rounds, "no rounds to pair"
    names = sorted({n for pair in rounds for side in pair for n in side})
    totals = [(sum(v.values()), sum(b.values())) for v, b in rounds]
    out: dict[str, dict[str, Any]] = {}
    for name, pairs in [
        *((n, [(v.get(n, 0.0), b.get(n, 0.0)) for v, b in rounds]) for n in names),
        (ALL_WAITS, totals),
    ]:
        out[name] = {
            "variant_s": median([v for v, _ in pairs]),
            "baseline_s": median([b for _, b in pairs]),
            "difference_s": spread([v - b for v, b in pairs]),
        }
    return out


def format_paired_idle(paired: Mapping[str, Mapping[str, Any]], variant: str, baseline: str) -> str:
    """A Markdown table of :func:`paired_idle`: ms of idle core time a step, every wait whose
    median on either side is at least 0.05 ms, the largest first, then ALL_WAITS."""

    waits = sorted(
        (
            n
            for n, f in paired.items()
            if n != ALL_WAITS and max(f["variant_s"], f["baseline_s"]) >= 5e-5
        ),
        key=lambda n: -max(paired[n]["variant_s"], paired[n]["baseline_s"]),
    )
    rows = [
        f"| waiting in | {baseline} | {variant} | {variant} - {baseline}, median (min..max) |",
        "|---|---:|---:|---:|",
    ]
    for name in [*waits, ALL_WAITS]:
        f = paired[name]
        rows.append(
            f"| {name} | {f['baseline_s'] * 1000:.1f} | {f['variant_s'] * 1000:.1f} "
            f"| {ms_difference(f['difference_s'])} |"
        )
    return "\n".join(rows)


REDUCTION = "ReduceGrads"
"""The instruction in which a stage's data-parallel ranks meet each step."""


def reduction_skew(
    profiles: Sequence[InstructionProfile], windows: Sequence[Window] | None = None
) -> list[float]:
    """How far apart a stage's data-parallel ranks reach the step's gradient reduction:
    per stage (ranks grouped by :attr:`InstructionProfile.stage`) and step, the seconds
    from the first rank's REDUCTION start to the last's. With ``windows`` (a job's turns),
    only the steps in which every rank's reduction lies inside one window (a pause between
    two arrivals is no skew of theirs). The peers wait for the last one: a skew is time
    the earlier ones spend in the collective instead of computing."""
    by_stage: dict[int, list[InstructionProfile]] = {}
    for profile in profiles:
        assert profile.stage is not None, "a profile without its stage"
        by_stage.setdefault(profile.stage, []).append(profile)
    skews: list[float] = []
    for _, peers in sorted(by_stage.items()):
        if len(peers) < 2:
            continue  # one pipeline: no peers to wait for
        starts: list[dict[int, InstructionSpan]] = [
            {e.step: e for e in p.events if e.name == REDUCTION} for p in peers
        ]
        for step in sorted(set.intersection(*(set(s) for s in starts))):
            events = [s[step] for s in starts]
            first, last = min(e.start for e in events), max(e.end for e in events)
            if not within(windows, first, last):
                continue
            skews.append(max(e.start for e in events) - min(e.start for e in events))
    return skews


def format_idle(idle: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The rows of the idle account (:func:`idle_account`, per step) of each variant: ms of
    idle core time a step by wait, the largest first, and their sum."""
    variants = list(idle)
    names = sorted(
        {n for x in idle.values() for n in x},
        key=lambda n: -max(x.get(n, 0.0) for x in idle.values()),
    )
    rows = [
        "idle core time a step (ms) by what the waiting ranks were in (the ranks' timelines):",
        "",
        "| waiting in | " + " | ".join(variants) + " |",
        "|---|" + "---:|" * len(variants),
    ]
    for name in names:
        cells = (f"{idle[x].get(name, 0.0) * 1000:.1f}" for x in variants)
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    totals = (f"{sum(idle[x].values()) * 1000:.1f}" for x in variants)
    rows.append("| all | " + " | ".join(totals) + " |")
    return rows


PROFILES = "instructions"
"""The folder, in a run's directory, its instruction profiles go to (``--profile``)."""


def profile_env(run_dir: Path, profile: bool) -> dict[str, str]:
    """The environment that makes a run profile its instructions into ``run_dir``."""
    return {PROFILE_ENV: str((run_dir / PROFILES).resolve())} if profile else {}


def with_cpu_profile(summary: dict[str, Any], run_dir: Path, profile: bool) -> dict[str, Any]:
    """``summary`` with ``cpu_per_step_per_rank``: each rank's :func:`cpu_split_per_step`
    (``--profile``); unchanged without."""
    if profile:
        profiles = read_profiles(run_dir / PROFILES)
        if len(profiles) != len(summary["peak_rss_mib_per_rank"]):
            raise RunFailed(
                f"--profile: {run_dir} holds {len(profiles)} instruction profile(s) for "
                f"{len(summary['peak_rss_mib_per_rank'])} ranks (a rank was replaced?)",
                1,
            )
        summary["cpu_per_step_per_rank"] = [cpu_split_per_step(p) for p in profiles]
    return summary


def turn_windows(summary: Mapping[str, Any]) -> list[Window] | None:
    """A run's turns (``summary["turns"]``) as windows; None for a run that took none."""
    turns = summary.get("turns")
    return None if turns is None else [(float(a), float(b)) for a, b in turns]


def with_idle_account(
    summary: dict[str, Any], profiles: Sequence[InstructionProfile], cores: int
) -> dict[str, Any]:
    """``summary`` with ``idle_by_wait_s_per_step``: the idle account of its run's
    ``profiles``, over the run's turns where it took turns."""
    account = idle_account([p.events for p in profiles], cores, turn_windows(summary))
    summary["idle_by_wait_s_per_step"] = account.per_step()
    summary["idle_window_s"] = account.window_s
    return summary


def profiled_launcher(config: Path, flags: Sequence[str], profile: bool) -> Launcher:
    """A mode's ``spotline train`` job, to take turns with the others; with ``profile``, its
    instructions profiled (``cpu_per_step_per_rank``)."""
    base = spotline_launcher(config, flags, lambda run_dir: profile_env(run_dir, profile))
    return replace(
        base,
        finish=lambda proc, run_dir: with_cpu_profile(base.finish(proc, run_dir), run_dir, profile),
    )
