"""``spotline bench profile``: where a step's time goes, instruction by instruction.

The foundation's three engines (Spotline with lazy redundancy, Spotline with redundancy off,
stock DeepSpeed ``PipelineEngine``) on the same model and topology, one run each with
``SPOTLINE_INSTRUCTION_PROFILE`` set (:mod:`spotline.instruction_profile`): every rank times
every schedule instruction it executes. The table gives seconds per step by instruction, the
mean over ranks; what a step spends outside the schedule (the loop, the loss, the store) is
its median step time less the instructions' sum. Waiting shows in the receive instructions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spotline.instruction_profile import PROFILE_ENV, InstructionProfile
from spotline.launch.bench.foundation import (
    FOUNDATION_VARIANTS,
    VARIANT_FLAGS,
    run_stock,
    topology_overrides,
)
from spotline.launch.bench.jobs import (
    BenchSettings,
    machine_info,
    progress,
    resolve_base_config,
    run_spotline_train,
    write_config,
)

PROFILE_VARIANTS = FOUNDATION_VARIANTS


def read_profiles(folder: Path) -> list[InstructionProfile]:
    import json

    return [
        InstructionProfile.from_json(json.loads(p.read_text()))
        for p in sorted(folder.glob("*.json"))
    ]


def mean_per_step(profiles: list[InstructionProfile]) -> dict[str, float]:
    """Seconds per step by instruction, the mean over ranks (every rank runs every step)."""
    names = sorted({n for p in profiles for n in p.seconds})
    return {n: sum(p.per_step().get(n, 0.0) for p in profiles) / len(profiles) for n in names}


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
        per_step = mean_per_step(read_profiles(folder))
        variants[variant] = {
            "step_time_s": result["step_time_s"],
            "instructions_s_per_step": per_step,
            "outside_s_per_step": result["step_time_s"] - sum(per_step.values()),
        }
    return {
        "bench": "profile",
        "model": cfg.spotline.model.name,
        "workers": cfg.num_workers,
        "stages": cfg.num_stages,
        "steps": settings.steps,
        "statistic": "seconds per step by schedule instruction, mean over ranks; one run each",
        "variants": variants,
        "machine": machine_info(),
    }


def format_profile(report: dict[str, Any]) -> str:
    v = report["variants"]
    names = sorted(
        {n for x in v.values() for n in x["instructions_s_per_step"]},
        key=lambda n: -max(x["instructions_s_per_step"].get(n, 0.0) for x in v.values()),
    )
    rows = [
        f"### profile: {report['model']}, {report['workers']} workers ({report['stages']} stages), "
        f"{report['steps']} steps; ms per step, mean over ranks",
        "",
        "| instruction | " + " | ".join(PROFILE_VARIANTS) + " |",
        "|---|" + "---:|" * len(PROFILE_VARIANTS),
    ]
    for name in names:
        cells = []
        for variant in PROFILE_VARIANTS:
            seconds = v[variant]["instructions_s_per_step"].get(name)
            cells.append("-" if seconds is None else f"{seconds * 1000:.1f}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    rows.append(
        "| outside the schedule | "
        + " | ".join(f"{v[x]['outside_s_per_step'] * 1000:.1f}" for x in PROFILE_VARIANTS)
        + " |"
    )
    rows.append(
        "| step (median) | "
        + " | ".join(f"{v[x]['step_time_s'] * 1000:.1f}" for x in PROFILE_VARIANTS)
        + " |"
    )
    return "\n".join(rows)
