"""``spotline bench redundancy``: redundancy ``off``, ``lazy`` and ``eager`` side by side.

``spotline train`` with each mode for each case (stages x micro-batches, one pipeline by
default, one process per stage), interleaved rounds, plus what the pure schedule says about
the eager mode: the fraction of redundant forwards its bubbles can hide, and the steps it
adds. With ``--pipelines P`` (2 or more), every case runs ``P`` data-parallel pipelines and
adds the mode ``lazy-sharded`` (lazy with ``spotline.redundancy.replica: "sharded"``: each
replica holder keeps 1/P of its successor's state). With ``--alternate SECONDS`` a round's
modes run at once and take turns on the host (:mod:`spotline.launch.bench.alternate`), and
a mode's step time is the median of the steps that ran inside its turns. With
``--profile`` every run also times its schedule's instructions
(:mod:`spotline.pipeline.instruction_profile`), and the report gives, per rank and instruction, each
mode's CPU per step against off's, paired by round: where a mode's extra work lands (CPU
time stands still while a job is stopped, so this holds for alternated rounds too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotline.errors import UserError
from spotline.launch.bench.alternate import (
    alternation_overrides,
    check_alternation,
    run_alternated_rounds,
)
from spotline.launch.bench.instruction_timeline import (
    format_paired_cpu,
    paired_cpu,
    profile_env,
    profiled_launcher,
    with_cpu_profile,
)
from spotline.launch.bench.jobs import (
    BenchSettings,
    format_spread,
    machine_info,
    median_per_rank,
    medians,
    resolve_base_config,
    round_ratios,
    run_rounds,
    run_spotline_train,
    spread,
    write_config,
)
from spotline.plan.redundancy_mode import REDUNDANCY_MODES
from spotline.wire.protocol import ModelStateBytes

SHARDED = "lazy-sharded"
"""The bench's mode for lazy redundancy with sharded replicas (2 pipelines or more)."""

# The ``spotline train`` flags of each mode.
MODE_FLAGS: dict[str, tuple[str, ...]] = {
    **{mode: ("--redundancy", mode) for mode in REDUNDANCY_MODES},
    SHARDED: ("--redundancy", "lazy", "--replica", "sharded"),
}


@dataclass(frozen=True)
class RedundancyCase:
    """One shape of the redundancy benchmark: ``num_pipelines`` pipelines (``--pipelines``,
    1 by default) of ``num_stages`` stages.

    One process per stage and pipeline, ``num_micro_batches`` per step and pipeline.
    Written ``<stages>x<micro-batches>`` (``2x4``) on the command line and in the report.
    """

    num_stages: int
    num_micro_batches: int
    num_pipelines: int = 1
    # The modes asked for (``--modes``); None: every mode the case can run.
    selected: tuple[str, ...] | None = None

    @property
    def num_workers(self) -> int:
        return self.num_stages * self.num_pipelines

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes benched, in a fixed order: sharded replicas only where there are shards
        to make, and off always (every ratio is over it)."""
        every = (*REDUNDANCY_MODES, SHARDED) if self.num_pipelines > 1 else REDUNDANCY_MODES
        if self.selected is None:
            return every
        return tuple(m for m in every if m == "off" or m in self.selected)

    @property
    def name(self) -> str:
        return f"{self.num_stages}x{self.num_micro_batches}"


# 2 stages with 2 and 4 micro-batches, and 4 stages on 4 processes: more processes than a
# 2-core machine has cores, where the bubbles are no longer idle CPU time.
DEFAULT_CASES = (RedundancyCase(2, 2), RedundancyCase(2, 4), RedundancyCase(4, 4))


BENCH_MODES = (*REDUNDANCY_MODES, SHARDED)
"""Every mode ``--modes`` can name."""


def parse_modes(text: str | None, pipelines: int) -> tuple[str, ...] | None:
    """``"lazy,lazy-sharded"`` -> the modes to bench beside off (None: all); raises UserError
    naming an unknown mode, or sharded replicas on one pipeline (nothing to shard over)."""
    if text is None:
        return None
    modes = tuple(m.strip().lower() for m in text.split(",") if m.strip())
    for mode in modes:
        if mode not in BENCH_MODES:
            raise UserError(f"--modes: unknown mode {mode!r}; use some of {', '.join(BENCH_MODES)}")
    if not modes:
        raise UserError(f"--modes {text!r} names no mode; use some of {', '.join(BENCH_MODES)}")
    if SHARDED in modes and pipelines < 2:
        raise UserError(
            f"--modes {SHARDED} needs --pipelines 2 or more (a replica is sharded over pipelines)"
        )
    return modes


def parse_cases(
    text: str, pipelines: int = 1, modes: str | None = None
) -> tuple[RedundancyCase, ...]:
    """``"2x2,4x4"`` -> the cases (of ``pipelines`` pipelines each, benching ``modes``: a
    ``--modes`` text, None for all); raises UserError naming the bad entry."""
    if pipelines < 1:
        raise UserError(f"--pipelines {pipelines}: use at least 1 pipeline")
    selected = parse_modes(modes, pipelines)
    cases = []
    for part in text.split(","):
        fields = part.strip().lower().split("x")
        if len(fields) != 2 or not all(f.isdigit() for f in fields):
            raise UserError(
                f"--cases entry {part.strip()!r} is not <stages>x<micro-batches>; use e.g. --cases 2x2,4x4"
            )
        num_stages, num_micro_batches = int(fields[0]), int(fields[1])
        if num_stages < 2 or num_micro_batches < 1:
            raise UserError(
                f"--cases entry {part.strip()!r}: redundancy needs >= 2 stages and >= 1 micro-batch"
            )
        cases.append(RedundancyCase(num_stages, num_micro_batches, pipelines, selected))
    if len(set(cases)) != len(cases):
        raise UserError(f"--cases {text!r} names a case twice; list each case once")
    return tuple(cases)


def schedule_facts(case: RedundancyCase) -> dict[str, Any]:
    """What the pure schedule says about a case: eager's hidden fraction, extra steps per mode."""
    from spotline.plan import schedule

    base = schedule.train_schedule(case.num_stages, case.num_micro_batches)
    by_mode: dict[str, schedule.Schedule] = {
        mode: schedule.add_redundancy(base, mode) for mode in REDUNDANCY_MODES
    }
    if SHARDED in case.modes:
        by_mode[SHARDED] = schedule.add_redundancy(base, "lazy", replay=False)
    return {
        "hidden_fraction": schedule.hidden_fraction(by_mode["eager"]),
        "num_extra_steps": {mode: schedule.num_extra_steps(s) for mode, s in by_mode.items()},
        "num_schedule_steps": {mode: s.num_steps for mode, s in by_mode.items()},
        "eager_grid": schedule.format_grid(by_mode["eager"]),
    }


REDUNDANCY_KEYS = ("step_time_s", "samples_per_s", "wall_s", "process_s")


def _per_step_median(runs: Sequence[dict[str, Any]], key: str) -> list[float] | None:
    """Median over runs of a per-rank total divided by the steps; None if a run lacks it."""
    if not all(key in r for r in runs):
        return None
    # The engine's counters add up over the whole run.
    return median_per_rank([[v / r["steps"] for v in r[key]] for r in runs])


def _state_ratio(run: dict[str, Any], off: dict[str, Any]) -> float | None:
    """The largest rank's model-state bytes against off's (None: not reported).

    Counted from tensors, so the same in every round: the first round's figure is exact.
    """
    if "model_state_bytes_per_rank" not in run or "model_state_bytes_per_rank" not in off:
        return None

    def largest(r: dict[str, Any]) -> int:
        return max(int(sum(ranks.values())) for ranks in r["model_state_bytes_per_rank"])

    return largest(run) / largest(off)


def bench_redundancy(
    settings: BenchSettings,
    cases: Sequence[RedundancyCase],
    alternate_s: float | None = None,
    profile: bool = False,
) -> dict[str, Any]:
    """Redundancy off/lazy/eager (and lazy-sharded with pipelines), interleaved (or, with
    ``alternate_s``, taking turns of that many seconds), for each case; medians and ratios
    to off; with ``profile``, each mode's CPU by instruction against off's."""
    if alternate_s is not None:
        for case in cases:
            check_alternation(alternate_s, len(case.modes))
    report_cases = []
    for case in cases:
        facts = schedule_facts(case)
        print(f"eager schedule, {case.name} (stages x micro-batches), compute actions:")
        print("```")
        print(facts["eager_grid"])
        print("```", flush=True)
        cfg = resolve_base_config(
            settings,
            {
                "spotline.topology.workers": case.num_workers,
                "spotline.topology.stages": case.num_stages,
                "gradient_accumulation_steps": case.num_micro_batches,
            },
        )
        if alternate_s is not None:
            from spotline.config import with_overrides

            cfg = with_overrides(
                cfg,
                alternation_overrides(
                    alternate_s, len(case.modes), cfg.spotline.recovery.heartbeat_timeout_s
                ),
            )
        work = settings.output / "redundancy" / case.name
        config = write_config(cfg, work / "config.json")

        def run_one(
            mode: str, round_idx: int, work: Path = work, config: Path = config
        ) -> dict[str, Any]:
            run_dir = work / f"{mode}-r{round_idx}"
            summary = run_spotline_train(
                config, run_dir, list(MODE_FLAGS[mode]), profile_env(run_dir, profile)
            )
            return with_cpu_profile(summary, run_dir, profile)

        label = f"redundancy {case.name}"
        if alternate_s is None:
            results = run_rounds(case.modes, settings.repeats, run_one, label)
        else:
            launchers = {
                mode: profiled_launcher(config, MODE_FLAGS[mode], profile) for mode in case.modes
            }
            results = run_alternated_rounds(
                launchers, settings.repeats, work, alternate_s, label, cfg.samples_per_step
            )
        modes: dict[str, Any] = {}
        for mode, runs in results.items():
            modes[mode] = {
                **medians(runs, REDUNDANCY_KEYS),
                "peak_rss_mib_per_rank": median_per_rank(
                    [r["peak_rss_mib_per_rank"] for r in runs]
                ),
                "redundant_compute_s_per_step_per_rank": _per_step_median(
                    runs, "redundant_compute_s_per_rank"
                ),
                "replica_sync_s_per_step_per_rank": _per_step_median(
                    runs, "replica_sync_s_per_rank"
                ),
                "num_extra_steps": facts["num_extra_steps"][mode],
                "param_sha256": sorted({r["param_sha256"] for r in runs}),
            }
            if alternate_s is not None:
                # Per round: the steps timed, and the turns (Unix time) they were taken from.
                modes[mode]["steps_in_turns"] = [r["steps_in_turns"] for r in runs]
                modes[mode]["turns"] = [r["turns"] for r in runs]
        off = modes["off"]
        for mode in case.modes:
            m = modes[mode]
            m["step_time_ratio_to_off"] = m["step_time_s"] / off["step_time_s"]
            m["spread_to_off"] = spread(round_ratios(results, mode, "off"))
            m["model_state_bytes_per_rank"] = results[mode][0].get("model_state_bytes_per_rank")
            m["model_state_ratio_to_off_max_rank"] = _state_ratio(
                results[mode][0], results["off"][0]
            )
            m["peak_rss_ratio_to_off_max_rank"] = max(m["peak_rss_mib_per_rank"]) / max(
                off["peak_rss_mib_per_rank"]
            )
            if profile and mode != "off":
                m["cpu_vs_off_per_rank"] = paired_cpu(
                    [
                        (run["cpu_per_step_per_rank"], base["cpu_per_step_per_rank"])
                        for run, base in zip(results[mode], results["off"], strict=True)
                    ]
                )
            m["peak_rss_ratio_to_off_per_rank"] = [
                a / b
                for a, b in zip(
                    m["peak_rss_mib_per_rank"], off["peak_rss_mib_per_rank"], strict=True
                )
            ]
        report_cases.append(
            {
                "case": case.name,
                "stages": case.num_stages,
                "workers": case.num_workers,
                "pipelines": case.num_pipelines,
                "micro_batches": case.num_micro_batches,
                "micro_batch_size": cfg.micro_batch_size,
                "hidden_fraction": facts["hidden_fraction"],
                "num_schedule_steps": facts["num_schedule_steps"],
                "eager_grid": facts["eager_grid"],
                "modes": modes,
            }
        )
    optional = ("redundant_compute_s_per_step_per_rank", "replica_sync_s_per_step_per_rank")
    missing = sorted(
        {f for c in report_cases for m in c["modes"].values() for f in optional if m[f] is None}
    )
    return {
        "bench": "redundancy",
        # Columns the training summaries did not report (shown as n/a).
        "missing_fields": missing,
        "model": cfg.spotline.model.name,
        "steps": settings.steps,
        "repeats": settings.repeats,
        "alternate_s": alternate_s,
        "order": (
            "per case, interleaved: " + ", ".join(cases[0].modes) + " per round"
            if alternate_s is None
            else f"per case, each round's modes at once, in turns of {alternate_s:g} s: "
            + ", ".join(cases[0].modes)
        ),
        "statistic": (
            "median over rounds (per rank for memory and seconds); redundant compute and "
            "replica sync are seconds per step; hidden_fraction is the eager schedule's share "
            "of redundant forwards placed in bubbles (a bound on what can be hidden)"
        ),
        "cases": report_cases,
        "machine": machine_info(),
    }


def _pipelines(report: dict[str, Any]) -> str:
    # Reports written before --pipelines ran one pipeline.
    count = report["cases"][0].get("pipelines", 1) if report["cases"] else 1
    return "one pipeline" if count == 1 else f"{count} pipelines"


def format_redundancy(report: dict[str, Any]) -> str:
    def per_rank(values: Sequence[float], fmt: str) -> str:
        return " / ".join(format(v, fmt) for v in values)

    rows = [
        "| case (SxM) | mode | step (ms) | vs off, median (min-max) | peak RSS per rank (MiB) "
        "| RSS vs off (max rank) | model state vs off (max rank) "
        "| redundant fwd (ms/step per rank) | replica sync (ms/step per rank) | hidden fraction | extra steps |",
        "|---|---|---:|---:|---|---:|---:|---|---|---:|---:|",
    ]
    # Those two counters are wall-clock totals over a whole run: taking turns, they hold the
    # pauses that fell inside a wait (a receive posted before a stop), so they are not shown.
    paused = report.get("alternate_s") is not None
    for case in report["cases"]:
        for mode, m in case["modes"].items():
            hidden = f"{case['hidden_fraction']:.2f}" if mode == "eager" else "-"
            redundant = m["redundant_compute_s_per_step_per_rank"]
            sync = m["replica_sync_s_per_step_per_rank"]
            ms_redundant = (
                "n/a" if redundant is None else per_rank([v * 1000 for v in redundant], ".1f")
            )
            ms_sync = "n/a" if sync is None else per_rank([v * 1000 for v in sync], ".1f")
            if paused:
                ms_redundant = ms_sync = "paused"
            ratio = m["model_state_ratio_to_off_max_rank"]
            state = "n/a" if ratio is None else f"{ratio:.3f}"
            rows.append(
                f"| {case['case']} ({case['workers']} procs) | {mode} | {m['step_time_s'] * 1000:.1f} "
                f"| {format_spread(m['spread_to_off'])} | {per_rank(m['peak_rss_mib_per_rank'], '.0f')} "
                f"| {m['peak_rss_ratio_to_off_max_rank']:.3f} | {state} | {ms_redundant} "
                f"| {ms_sync} | {hidden} | {m['num_extra_steps']} |"
            )
    kinds = tuple(ModelStateBytes().to_json())
    state_rows = [
        "| case | mode | rank | " + " | ".join(k.replace("_", " ") for k in kinds) + " | total |",
        "|---|---|---:|" + "---:|" * (len(kinds) + 1),
    ]
    for case in report["cases"]:
        for mode, m in case["modes"].items():
            for rank, counts in enumerate(m["model_state_bytes_per_rank"] or []):
                cells = " | ".join(f"{counts[k] / 2**20:.2f}" for k in kinds)
                state_rows.append(
                    f"| {case['case']} | {mode} | {rank} | {cells} "
                    f"| {sum(counts.values()) / 2**20:.2f} |"
                )
    head = (
        f"### redundancy: {report['model']}, {_pipelines(report)}, one process per stage, "
        f"{report['steps']} steps, median of {report['repeats']} "
        + (
            "interleaved rounds"
            if report.get("alternate_s") is None
            else f"rounds taking turns of {report['alternate_s']:g} s (steps inside the turns)"
        )
    )
    lines = [head, "", *rows, "", "Model state per rank, MiB (counted from the tensors):", ""]
    lines += state_rows
    for case in report["cases"]:
        for mode, m in case["modes"].items():
            if "cpu_vs_off_per_rank" in m:
                lines += [
                    "",
                    f"CPU per step by instruction, {case['case']}, {mode} against off, ms: "
                    "the schedule's thread / the process's other threads (median over "
                    "rounds); the paired difference per round, median (min..max):",
                    "",
                    format_paired_cpu(m["cpu_vs_off_per_rank"], mode, "off"),
                ]
    if paused:
        lines += [
            "",
            "paused: wall-clock counters over the whole run, which hold the pauses of taking "
            "turns; `--profile` gives each mode's work in CPU time, which pauses do not move.",
        ]
    if report["missing_fields"]:
        lines += [
            "",
            f"n/a: the training summaries did not report {', '.join(report['missing_fields'])}.",
        ]
    return "\n".join(lines)
