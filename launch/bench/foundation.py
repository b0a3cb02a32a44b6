"""``spotline bench foundation``: Spotline's engine against DeepSpeed's stock ``PipelineEngine``.

``spotline train`` against the same model, batches and steps trained by DeepSpeed's stock
``PipelineEngine`` (the rank worker :mod:`spotline.launch.bench.stock_worker`), on 4 workers:
2 stages x 2 pipelines by default, 4 stages x 1 pipeline with ``--stages 4``; interleaved
rounds; medians and the ratios Spotline / stock. With ``--alternate SECONDS`` a round's three
jobs run at once and take turns on the host (:mod:`spotline.launch.bench.alternate`; the
stock ranks under one root, :mod:`spotline.launch.bench.rank_group`), and a step time is the
median of the steps inside the job's turns.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spotline.launch.bench.alternate import (
    Launcher,
    alternation_overrides,
    check_alternation,
    log_ready,
    run_alternated_rounds,
)
from spotline.launch.bench.instruction_timeline import (
    PROFILES,
    format_paired_cpu,
    format_paired_idle,
    paired_cpu,
    paired_idle,
    profile_env,
    profiled_launcher,
    read_profiles,
    reduction_skew,
    turn_windows,
    with_cpu_profile,
    with_idle_account,
)
from spotline.launch.bench.jobs import (
    BenchSettings,
    format_median_interval,
    format_spread,
    machine_info,
    median_per_rank,
    medians,
    resolve_base_config,
    round_ratios,
    run_rank_module,
    run_rounds,
    run_spotline_train,
    spread,
    write_config,
)
from spotline.launch.bench.rank_group import finish_rank_group, start_rank_group
from spotline.reports.timeline import counted

STOCK_MODULE = "spotline.launch.bench.stock_worker"


def run_stock(
    config: Path, num_workers: int, run_dir: Path, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``num_workers`` ranks of ``spotline.launch.bench.stock_worker``; returns rank 0's JSON."""
    return run_rank_module(
        STOCK_MODULE,
        ["--config", str(config)],
        num_workers,
        run_dir,
        "stock DeepSpeed",
        extra_env,
    )


# spotline: the default (lazy redundancy); spotline-off: the engine alone, redundancy off
# (what the stock engine does, with Spotline's commit point, exact reduction and seeding).
FOUNDATION_VARIANTS = ("spotline", "spotline-off", "stock")
VARIANT_FLAGS = {"spotline": [], "spotline-off": ["--redundancy", "off"]}
# Four processes whatever the stages (what this machine's cores can time fairly): the
# topologies --stages chooses between.
FOUNDATION_WORKERS = 4
FOUNDATION_STAGES = (2, 4)


def topology_overrides(stages: int) -> dict[str, int]:
    """The config overrides of ``--stages``: FOUNDATION_WORKERS workers in ``stages`` stages."""
    assert stages in FOUNDATION_STAGES, stages  # argparse's choices
    return {"spotline.topology.workers": FOUNDATION_WORKERS, "spotline.topology.stages": stages}


FOUNDATION_KEYS = ("samples_per_s", "step_time_s", "wall_s", "setup_s", "final_loss", "process_s")


def stock_launcher(config: Path, num_workers: int, profile: bool = False) -> Launcher:
    """The stock baseline's ranks under one root, to take turns with ``spotline train`` jobs:
    ready once rank 0 printed its first step; with ``profile``, its instructions profiled."""
    return Launcher(
        start=lambda run_dir: start_rank_group(
            STOCK_MODULE,
            ["--config", str(config)],
            num_workers,
            run_dir,
            profile_env(run_dir, profile),
        ),
        ready=lambda run_dir: log_ready(run_dir / "logs" / "worker-0.log"),
        finish=lambda proc, run_dir: with_cpu_profile(
            finish_rank_group(proc, run_dir, "stock DeepSpeed"), run_dir, profile
        ),
    )


# The variants --profile pairs with the stock run of their round.
PROFILED_AGAINST_STOCK = ("spotline-off", "spotline")


def profile_against_stock(
    results: dict[str, list[dict[str, Any]]], work: Path, cores: int
) -> dict[str, Any]:
    """``--profile``'s figures: for each of PROFILED_AGAINST_STOCK, its CPU by rank and
    instruction (:func:`paired_cpu`) and the cores' idle time by wait (:func:`paired_idle`,
    over each job's turns where they took turns), against the stock run of the same round;
    and each variant's :func:`reduction_skew`. Each run's idle account is added to its
    result (``idle_by_wait_s_per_step``)."""
    skews: dict[str, list[float]] = {}
    for variant, runs in results.items():
        for round_idx, run in enumerate(runs):
            profiles = read_profiles(work / f"{variant}-r{round_idx}" / PROFILES)
            with_idle_account(run, profiles, cores)
            skews.setdefault(variant, []).extend(reduction_skew(profiles, turn_windows(run)))
    stock = results["stock"]
    paired = {
        variant: {
            "cpu_per_rank": paired_cpu(
                [
                    (run["cpu_per_step_per_rank"], base["cpu_per_step_per_rank"])
                    for run, base in zip(results[variant], stock, strict=True)
                ]
            ),
            "idle_by_wait": paired_idle(
                [
                    (run["idle_by_wait_s_per_step"], base["idle_by_wait_s_per_step"])
                    for run, base in zip(results[variant], stock, strict=True)
                ]
            ),
        }
        for variant in PROFILED_AGAINST_STOCK
    }
    return {
        "against_stock": paired,
        # Per variant, over every step of every round: how far apart a stage's data-parallel
        # ranks reached the gradient reduction (seconds).
        "reduction_skew_s": {variant: skew_summary(s) for variant, s in skews.items()},
    }


def skew_summary(skews: Sequence[float]) -> dict[str, float]:
    """The median, 90th percentile and count of :func:`reduction_skew`'s figures (0 each
    without any: one pipeline)."""
    if not skews:
        return {"median": 0.0, "p90": 0.0, "count": 0}
    p90 = statistics.quantiles(skews, n=10)[-1] if len(skews) > 1 else skews[0]
    return {"median": statistics.median(skews), "p90": p90, "count": len(skews)}


def bench_foundation(
    settings: BenchSettings,
    stages: int = 2,
    alternate_s: float | None = None,
    profile: bool = False,
) -> dict[str, Any]:
    """Spotline's engine vs DeepSpeed's stock engine on 4 workers in ``stages`` stages; with
    ``alternate_s``, a round's jobs at once, taking turns of that many seconds; with
    ``profile``, each Spotline variant's CPU and idle cores against stock's, by round."""
    from spotline.launch.bench.stock_worker import TIED_NOTE

    if alternate_s is not None:
        check_alternation(alternate_s, len(FOUNDATION_VARIANTS), "variants")
    cfg = resolve_base_config(settings, topology_overrides(stages))
    if alternate_s is not None:
        from spotline.config import with_overrides

        cfg = with_overrides(
            cfg,
            alternation_overrides(
                alternate_s, len(FOUNDATION_VARIANTS), cfg.spotline.recovery.heartbeat_timeout_s
            ),
        )
    work = settings.output / "foundation"
    config = write_config(cfg, work / "config.json")
    info_before = machine_info()

    def run_one(variant: str, round_idx: int) -> dict[str, Any]:
        run_dir = work / f"{variant}-r{round_idx}"
        env = profile_env(run_dir, profile)
        if variant in VARIANT_FLAGS:
            result = run_spotline_train(config, run_dir, VARIANT_FLAGS[variant], env)
        else:
            result = run_stock(config, cfg.num_workers, run_dir, env)
        return with_cpu_profile(result, run_dir, profile)

    if alternate_s is None:
        results = run_rounds(FOUNDATION_VARIANTS, settings.repeats, run_one, "foundation")
    else:
        launchers = {
            variant: profiled_launcher(config, VARIANT_FLAGS[variant], profile)
            if variant in VARIANT_FLAGS
            else stock_launcher(config, cfg.num_workers, profile)
            for variant in FOUNDATION_VARIANTS
        }
        results = run_alternated_rounds(
            launchers, settings.repeats, work, alternate_s, "foundation", cfg.samples_per_step
        )
    cores = os.cpu_count() or 1
    profiled = profile_against_stock(results, work, cores) if profile else None
    variants: dict[str, Any] = {}
    kept = (
        *FOUNDATION_KEYS,
        "peak_rss_mib_per_rank",
        "steps_in_turns",
        "turns",
        "cpu_per_step_per_rank",
        "idle_by_wait_s_per_step",
        "idle_window_s",
    )
    for variant, runs in results.items():
        variants[variant] = {
            **medians(runs, FOUNDATION_KEYS),
            "peak_rss_mib_per_rank": median_per_rank([r["peak_rss_mib_per_rank"] for r in runs]),
            "runs": [{k: r[k] for k in kept if k in r} for r in runs],
        }
    spot, stock = variants["spotline"], variants["stock"]
    ratios: dict[str, Any] = {
        "off_step_time_s": variants["spotline-off"]["step_time_s"] / stock["step_time_s"],
        "samples_per_s": spot["samples_per_s"] / stock["samples_per_s"],
        "step_time_s": spot["step_time_s"] / stock["step_time_s"],
        "peak_rss_mib_max_rank": max(spot["peak_rss_mib_per_rank"])
        / max(stock["peak_rss_mib_per_rank"]),
        "peak_rss_mib_per_rank": [
            a / b
            for a, b in zip(
                spot["peak_rss_mib_per_rank"], stock["peak_rss_mib_per_rank"], strict=True
            )
        ],
    }
    return {
        "bench": "foundation",
        # Round by round (spotline / stock of a pair of runs back to back): min, median, max.
        "spread": {
            "step_time_s": spread(round_ratios(results, "spotline", "stock")),
            "off_step_time_s": spread(round_ratios(results, "spotline-off", "stock")),
            "samples_per_s": spread(round_ratios(results, "spotline", "stock", "samples_per_s")),
        },
        "model": cfg.spotline.model.name,
        "workers": cfg.num_workers,
        "stages": cfg.num_stages,
        "pipelines": cfg.num_logical_workers,
        "micro_batches": cfg.num_micro_batches,
        "micro_batch_size": cfg.micro_batch_size,
        "steps": settings.steps,
        "repeats": settings.repeats,
        "alternate_s": alternate_s,
        "order": (
            "interleaved: spotline, spotline-off, stock per round"
            if alternate_s is None
            else f"each round's jobs at once, in turns of {alternate_s:g} s: "
            + ", ".join(FOUNDATION_VARIANTS)
        ),
        "statistic": "median over rounds (per rank for memory); ratios are spotline / stock",
        "variants": variants,
        "ratio_spotline_over_stock": ratios,
        "note": TIED_NOTE,
        # --profile: CPU seconds per step by rank and instruction, and idle core seconds
        # per step by wait, each Spotline variant against the stock run of its round.
        "profile_against_stock": profiled,
        "cores": cores,
        "machine": {"before": info_before, "after": machine_info()},
    }


def format_foundation(report: dict[str, Any]) -> str:
    def rss(values: Sequence[float]) -> str:
        return " / ".join(f"{v:.0f}" for v in values)

    v = report["variants"]
    r = report["ratio_spotline_over_stock"]
    rows = [
        "| engine | samples/s | step time (ms, median) | peak RSS per rank (MiB) |",
        "|---|---:|---:|---|",
    ]
    for name, title in (
        ("spotline", "Spotline (spotline train, lazy redundancy)"),
        ("spotline-off", "Spotline, redundancy off"),
        ("stock", "stock DeepSpeed PipelineEngine"),
    ):
        rows.append(
            f"| {title} | {v[name]['samples_per_s']:.1f} | {v[name]['step_time_s'] * 1000:.1f} "
            f"| {rss(v[name]['peak_rss_mib_per_rank'])} |"
        )
    rows.append(
        f"| ratio Spotline / stock | {r['samples_per_s']:.3f} | {r['step_time_s']:.3f} "
        f"| {' / '.join(f'{x:.3f}' for x in r['peak_rss_mib_per_rank'])} |"
    )
    rounds = (
        "interleaved rounds"
        if report.get("alternate_s") is None
        else f"rounds taking turns of {report['alternate_s']:g} s (steps inside the turns)"
    )
    head = (
        f"### foundation: {report['model']}, {report['workers']} workers "
        f"({counted(report['stages'], 'stage')} x {counted(report['pipelines'], 'pipeline')}), "
        f"{report['micro_batches']} micro-batches of {report['micro_batch_size']}, "
        f"{report['steps']} steps, median of {report['repeats']} {rounds}"
    )
    spread_line = (
        "Step time over stock round by round, median (min-max): Spotline "
        f"{format_spread(report['spread']['step_time_s'])}, redundancy off "
        f"{format_spread(report['spread']['off_step_time_s'])}; the median's confidence "
        f"interval: Spotline {format_median_interval(report['spread']['step_time_s'])}, "
        f"redundancy off {format_median_interval(report['spread']['off_step_time_s'])}"
    )
    parts = [head, "", *rows, "", spread_line, "", f"Note: {report['note']}."]
    over = "the whole run" if report.get("alternate_s") is None else "each job's own turns"
    profiled = report.get("profile_against_stock") or {"against_stock": {}}
    if "reduction_skew_s" in profiled:
        skew = profiled["reduction_skew_s"]
        parts += [
            "",
            "How far apart a stage's data-parallel ranks reach the gradient reduction, median / "
            f"90th percentile over the steps of {over} (ms): "
            + ", ".join(
                f"{v} {skew[v]['median'] * 1000:.0f} / {skew[v]['p90'] * 1000:.0f}"
                for v in FOUNDATION_VARIANTS
            ),
        ]
    for variant, paired in profiled["against_stock"].items():
        parts += [
            "",
            f"{variant} against stock, paired by round: idle core time a step (ms) by what "
            f"the waiting ranks were in, over {over} ({report['cores']} cores):",
            "",
            format_paired_idle(paired["idle_by_wait"], variant, "stock"),
            "",
            f"{variant} against stock, paired by round: CPU a step (ms), schedule thread / "
            "other threads:",
            "",
            format_paired_cpu(paired["cpu_per_rank"], variant, "stock"),
        ]
    return "\n".join(parts)
