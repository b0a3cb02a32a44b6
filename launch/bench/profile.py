"""``spotline bench profile``: where a step's time goes, instruction by instruction.

The foundation's three engines (Spotline with lazy redundancy, Spotline with redundancy off,
stock DeepSpeed ``PipelineEngine``) on the same model and topology, one run each with
``SPOTLINE_INSTRUCTION_PROFILE`` set (:mod:`spotline.pipeline.instruction_profile`): every rank times
every schedule instruction it executes, on the wall clock and in CPU time. The table gives
milliseconds per step by instruction, wall / CPU, the mean over ranks (the first step of each
rank left out); what a step spends outside the schedule (the loop, the loss, the store) is
the measured step less the instructions' sum. A wall time above its CPU time is waiting.
Below it: the CPU of one step summed over the ranks (with more processes than cores, the
step's floor) and the cores' idle time (cores x step - that CPU).

The second table says which waits leave cores idle, from the ranks' timelines (each
instruction's start and end on the host's clock, :class:`spotline.pipeline.instruction_profile.InstructionSpan`):
a millisecond at a time, the cores not taken by a computing rank are idle, and that idle time
is shared among what the other ranks were waiting in. A wait that overlaps another rank's
work costs nothing; one during which too few ranks compute is what makes a step longer than
its CPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from spotline.launch.bench.foundation import (
    FOUNDATION_VARIANTS,
    VARIANT_FLAGS,
    run_stock,
    topology_overrides,
)
from spotline.launch.bench.instruction_timeline import format_idle, idle_account, read_profiles
from spotline.launch.bench.jobs import (
    BenchSettings,
    machine_info,
    progress,
    resolve_base_config,
    run_spotline_train,
    write_config,
)
from spotline.pipeline.instruction_profile import PROFILE_ENV, WHOLE_STEP, InstructionProfile

PROFILE_VARIANTS = FOUNDATION_VARIANTS


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
