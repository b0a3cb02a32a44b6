"""``spotline bench profile``: where a step's time goes, instruction by instruction.

The foundation's three engines (Spotline with lazy redundancy, Spotline with redundancy off,
stock DeepSpeed ``PipelineEngine``) on the same model and topology, one run each with
``SPOTLINE_INSTRUCTION_PROFILE`` set (:mod:`spotline.instruction_profile`): every rank times
every schedule instruction it executes, on the wall clock and in CPU time. The table gives
milliseconds per step by instruction, wall / CPU, the mean over ranks (the first step of each
rank left out); what a step spends outside the schedule (the loop, the loss, the store) is
the measured step less the instructions' sum. A wall time above its CPU time is waiting.
Below it: the CPU of one step summed over the ranks (with more processes than cores, the
step's floor) and the cores' idle time (cores x step - that CPU).

The second table says which waits leave cores idle, from the ranks' timelines (each
instruction's start and end on the host's clock, :class:`spotline.instruction_profile.Event`):
a millisecond at a time, the cores not taken by a computing rank are idle, and that idle time
is shared among what the other ranks were waiting in. A wait that overlaps another rank's
work costs nothing; one during which too few ranks compute is what makes a step longer than
its CPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotline.instruction_profile import (
    PROFILE_ENV,
    TIMELINE_PARTS,
    WHOLE_STEP,
    Event,
    InstructionProfile,
)
from spotline.launch.bench.foundation import (
    FOUNDATION_VARIANTS,
    VARIANT_FLAGS,
    run_stock,
    topology_overrides,
)
from spotline.launch.bench.jobs import (
    BenchSettings,
    machine_info,
    median,
    progress,
    resolve_base_config,
    run_spotline_train,
    spread,
    worker_id_order,
    write_config,
)

PROFILE_VARIANTS = FOUNDATION_VARIANTS


def read_profiles(folder: Path) -> list[InstructionProfile]:
    """The profiles a run wrote into ``folder``, in rank order (one file per worker id)."""
    import json

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


def format_paired_cpu(
    paired: Sequence[Mapping[str, Mapping[str, Any]]], variant: str, baseline: str
) -> str:
    """A Markdown table of :func:`paired_cpu`: ms of CPU per step, schedule thread / other
    threads, each instruction whose difference's median is at least 0.05 ms either way,
    and the whole step (last)."""

    def ms(pair: Sequence[float]) -> str:
        return f"{pair[0] * 1000:.1f} / {pair[1] * 1000:.1f}"

    def diff(s: Mapping[str, float]) -> str:
        return f"{s['median'] * 1000:+.1f} ({s['min'] * 1000:+.1f}..{s['max'] * 1000:+.1f})"

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
                f"| {diff(f['difference_s'][0])} | {diff(f['difference_s'][1])} |"
            )
    return "\n".join(rows)


def mean_per_step(profiles: list[InstructionProfile], *, cpu: bool = False) -> dict[str, float]:
    """Seconds per step by instruction, the mean over ranks (every rank runs every step);
    CPU seconds with ``cpu``."""
    names = sorted({n for p in profiles for n in p.seconds})

    def of(p: InstructionProfile) -> dict[str, float]:
        return p.cpu_per_step() if cpu else p.per_step()

    return {n: sum(of(p).get(n, 0.0) for p in profiles) / len(profiles) for n in names}


def summarize(profiles: list[InstructionProfile]) -> dict[str, Any]:
    """The report's figures of one variant's ranks: per instruction (wall and CPU, the mean
    over ranks), the whole step, what lies outside the schedule, the CPU of a step summed
    over the ranks."""
    wall, cpu = mean_per_step(profiles), mean_per_step(profiles, cpu=True)
    step_wall, step_cpu = wall.pop(WHOLE_STEP, 0.0), cpu.pop(WHOLE_STEP, 0.0)
    return {
        "instructions_s_per_step": wall,
        "instructions_cpu_s_per_step": cpu,
        "step_s": step_wall,
        "outside_s_per_step": step_wall - sum(wall.values()),
        "outside_cpu_s_per_step": step_cpu - sum(cpu.values()),
        "step_cpu_s_all_ranks": step_cpu * len(profiles),
    }


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


def idle_account(timelines: Sequence[Sequence[Event]], cores: int) -> IdleAccount:
    """The cores' idle time over the window every rank's timeline covers (from the latest
    first event to the earliest last), a SLICE_S at a time: ``cores`` less the ranks in a
    COMPUTING instruction, at least 0, shared equally among the other ranks' waits. A part
    of an instruction (the commit barrier inside OptimizerStep) stands for its instruction
    where it runs."""
    assert timelines and all(timelines), "a rank without a timeline"
    start = max(t[0].start for t in timelines)
    end = min(t[-1].end for t in timelines)
    slices = max(0, int((end - start) / SLICE_S))
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
        waiting = [s[k] for s in states if s[k] not in COMPUTING]
        free = cores - (len(states) - len(waiting))
        if free > 0 and waiting:
            for name in waiting:
                idle[name] = idle.get(name, 0.0) + free * SLICE_S / len(waiting)
    steps = sum(
        sum(1 for e in t if e.name == "OptimizerStep" and start <= e.end <= end) for t in timelines
    ) / len(timelines)
    return IdleAccount(slices * SLICE_S, steps, idle)


def bench_profile(settings: BenchSettings, stages: int = 2) -> dict[str, Any]:
    cfg = resolve_base_config(settings, topology_overrides(stages))
    work = settings.output / "profile"
    config = write_config(cfg, work / "config.json")
    variants: dict[str, Any] = {}
    for variant in PROFILE_VARIANTS:
        progress(f"profile {variant}")
        folder = work / f"{variant}-instructions"
        env = {PROFILE_ENV: str(folder.resolve())}
        run_dir = work / variant
        if variant in VARIANT_FLAGS:
            result = run_spotline_train(config, run_dir, VARIANT_FLAGS[variant], env)
        else:
            result = run_stock(config, cfg.num_workers, run_dir, env)
        profiles = read_profiles(folder)
        idle = idle_account([p.events for p in profiles], os.cpu_count() or 1)
        variants[variant] = {
            "step_time_s": result["step_time_s"],
            **summarize(profiles),
            "idle_by_wait_s_per_step": idle.per_step(),
            "timeline_window_s": idle.window_s,
        }
    return {
        "bench": "profile",
        "model": cfg.spotline.model.name,
        "workers": cfg.num_workers,
        "stages": cfg.num_stages,
        "steps": settings.steps,
        "statistic": "seconds per step by schedule instruction (wall and CPU), mean over ranks, "
        "each rank's first step left out; one run each",
        "cores": os.cpu_count(),
        "variants": variants,
        "machine": machine_info(),
    }


def format_profile(report: dict[str, Any]) -> str:
    v = report["variants"]
    names = sorted(
        {n for x in v.values() for n in x["instructions_s_per_step"]},
        key=lambda n: -max(x["instructions_s_per_step"].get(n, 0.0) for x in v.values()),
    )

    def cell(wall: float | None, cpu: float | None) -> str:
        if wall is None:
            return "-"
        return f"{wall * 1000:.1f} / {(cpu or 0.0) * 1000:.1f}"

    def row(label: str, cells: Iterable[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.1f}"

    rows = [
        f"### profile: {report['model']}, {report['workers']} workers ({report['stages']} stages), "
        f"{report['steps']} steps; ms per step, wall / CPU, mean over ranks, first step left out",
        "",
        row("instruction", PROFILE_VARIANTS),
        "|---|" + "---:|" * len(PROFILE_VARIANTS),
    ]
    for name in names:
        cells = (
            cell(
                v[x]["instructions_s_per_step"].get(name),
                v[x].get("instructions_cpu_s_per_step", {}).get(name),
            )
            for x in PROFILE_VARIANTS
        )
        rows.append(row(name, cells))
    outside = (
        cell(v[x]["outside_s_per_step"], v[x].get("outside_cpu_s_per_step"))
        for x in PROFILE_VARIANTS
    )
    rows.append(row("outside the schedule", outside))
    steps = [v[x].get("step_s", 0.0) for x in PROFILE_VARIANTS]
    cpus = [v[x].get("step_cpu_s_all_ranks", 0.0) for x in PROFILE_VARIANTS]
    rows.append(row("step (measured ranks' mean)", map(ms, steps)))
    rows.append(row("step CPU, all ranks", map(ms, cpus)))
    cores = report.get("cores")
    if cores:
        idle = (ms(cores * step - cpu) for step, cpu in zip(steps, cpus, strict=True))
        rows.append(row(f"idle core time ({cores} cores x step - CPU)", idle))
    rows.append(row("step (the run's median)", (ms(v[x]["step_time_s"]) for x in PROFILE_VARIANTS)))
    if all("idle_by_wait_s_per_step" in v[x] for x in PROFILE_VARIANTS):
        rows += ["", *format_idle({x: v[x]["idle_by_wait_s_per_step"] for x in PROFILE_VARIANTS})]
    return "\n".join(rows)


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
