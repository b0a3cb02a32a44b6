"""``spotline bench takeover``: an in-memory takeover's time against the state it moves.

``spotline train`` on 2 stages x 2 pipelines with lazy redundancy; worker 1 (stage 1 of the
first pipeline) is SIGKILLed in the forward pass of step ``--kill-at``. Its stage is taken
over from the replica its predecessor holds (no checkpoint read). The run's own recovery
figure runs from the coordinator noticing the loss to the next committed step; it is split
with what the workers measured as they set the new generation up
(:class:`spotline.wire.protocol.GenerationSetup`, the slowest member of each phase):

- ``redo``: the interrupted step, run again on the new layout (its step time);
- ``takeover``: the rest: the loss noticed and planned, the survivors' old generation torn
  down, then the gloo group, the engine and the state;
- ``state``: within the takeover, the state loaded: the lost stage from memory, each
  replica received from its successor (the bytes that moved are counted).

The state the lost stage carries (parameters and optimizer state, counted from the tensors
of its replica) is what grows along the ladder; the target is a takeover of at most 1 s on
top of its state time.
"""

from __future__ import annotations

from typing import Any

from spotline.errors import UserError
from spotline.launch.bench.jobs import (
    BenchSettings,
    format_spread,
    machine_info,
    progress,
    resolve_base_config,
    run_spotline_train,
    spread,
    write_config,
)

VICTIM_WORKER = 1  # stage 1 of pipeline 0: its replica lives on stage 0's worker


def bench_takeover(settings: BenchSettings, kill_at: int) -> dict[str, Any]:
    # Steps count from 1, as --inject and the progress lines count them.
    if not 2 <= kill_at < settings.steps:
        raise UserError(
            f"--kill-at {kill_at}: kill in a step after the first and before the last "
            f"(2..{settings.steps - 1}, counted from 1); raise --steps or lower --kill-at"
        )
    cfg = resolve_base_config(
        settings,
        {
            "spotline.topology.workers": 4,
            "spotline.topology.stages": 2,
            "spotline.redundancy.mode": "lazy",
        },
    )
    work = settings.output / "takeover"
    config = write_config(cfg, work / "config.json")
    flags = ["--inject", f"kill:{kill_at}:{VICTIM_WORKER}:forward"]
    runs = []
    for round_idx in range(settings.repeats):
        progress(f"takeover round {round_idx + 1}/{settings.repeats}")
        runs.append(run_spotline_train(config, work / f"r{round_idx}", flags))
    if not all(
        len(r["recovery_events"]) == 1 and r["recovery_events"][0]["in_memory"] for r in runs
    ):
        raise UserError(
            "a run did not recover exactly once, in memory; see the runs' logs under " + str(work)
        )
    phases = [takeover_phases(r) for r in runs]
    # The lost stage's state as its replica holder (worker 0) counts it.
    holder = runs[0]["model_state_bytes_per_rank"][0]
    state = holder["replica_parameters"] + holder["replica_optimizer"]
    return {
        "bench": "takeover",
        "model": cfg.spotline.model.name,
        "steps": settings.steps,
        "repeats": settings.repeats,
        "kill_at": kill_at,
        **{key: spread([p[key] for p in phases]) for key in PHASES},
        "rounds": phases,
        "lost_stage_state_bytes": state,
        "step_time_s": spread([r["step_time_s"] for r in runs]),
        "param_sha256": sorted({r["param_sha256"] for r in runs}),
        "machine": machine_info(),
    }


PHASES = ("recovery_s", "redo_s", "takeover_s", "join_s", "build_s", "state_s", "over_state_s")


def takeover_phases(summary: dict[str, Any]) -> dict[str, float]:
    """One run's recovery split into its phases (seconds; see the module's text).

    ``over_state_s``: the takeover less its state time, what the 1 s target bounds."""
    event = summary["recovery_events"][0]
    generation, resume = event["generation"], event["resume_step"]
    setups = [
        g
        for entries in summary["generation_setups"].values()
        for g in entries
        if g["generation"] == generation
    ]
    assert setups, f"no member reported setting generation {generation} up"
    redo = summary["step_times_s"][resume]
    assert redo is not None, f"step {resume} has no measured time"
    takeover = event["recovery_s"] - redo
    state = max(g["state_s"] for g in setups)
    return {
        "recovery_s": event["recovery_s"],
        "redo_s": redo,
        "takeover_s": takeover,
        "join_s": max(g["join_s"] for g in setups),
        "build_s": max(g["build_s"] for g in setups),
        "state_s": state,
        "over_state_s": takeover - state,
        "state_bytes": float(sum(g["state_bytes"] for g in setups)),
    }


def format_takeover(report: dict[str, Any]) -> str:
    def s(key: str) -> str:
        return format_spread(report[key], ".2f")

    return (
        f"takeover: {report['model']}, 2 stages x 2 pipelines, worker {VICTIM_WORKER} SIGKILLed "
        f"in step {report['kill_at']}, {report['repeats']} runs, median (min-max) s: noticed "
        f"to next committed step {s('recovery_s')} = redo of the step {s('redo_s')} + takeover "
        f"{s('takeover_s')}; the takeover's slowest member: group {s('join_s')}, engine "
        f"{s('build_s')}, state {s('state_s')}; takeover over its state time "
        f"{s('over_state_s')} (target <= 1 s); the lost stage's state "
        f"{report['lost_stage_state_bytes'] / 2**20:.1f} MiB (parameters and optimizer, held "
        f"by its predecessor); step {format_spread(report['step_time_s'], '.3f')} s"
    )
