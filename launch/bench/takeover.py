"""``spotline bench takeover``: an in-memory takeover's time against the state it moves.

``spotline train`` on 2 stages x 2 pipelines with lazy redundancy; worker 1 (stage 1 of the
first pipeline) is SIGKILLed in the forward pass of step ``--kill-at``. Its stage is taken
over from the replica its predecessor holds (no checkpoint read); the time is the run's own
recovery figure, from the kill to the next committed step. The state that stage carries
(parameters and optimizer state, counted from the tensors of its replica) is what grows
along the ladder.
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
    if not 1 <= kill_at < settings.steps:
        raise UserError(
            f"--kill-at {kill_at}: kill in a step after the first and before the last "
            f"(1..{settings.steps - 1}); raise --steps or lower --kill-at"
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
    seconds = [e["recovery_s"] for r in runs for e in r["recovery_events"]]
    if not seconds or not all(e["in_memory"] for r in runs for e in r["recovery_events"]):
        raise UserError(
            "a takeover did not recover in memory; see the runs' logs under " + str(work)
        )
    # The lost stage's state as its replica holder (worker 0) counts it.
    holder = runs[0]["model_state_bytes_per_rank"][0]
    state = holder["replica_parameters"] + holder["replica_optimizer"]
    return {
        "bench": "takeover",
        "model": cfg.spotline.model.name,
        "steps": settings.steps,
        "repeats": settings.repeats,
        "kill_at": kill_at,
        "recovery_s": spread(seconds),
        "recovery_s_runs": seconds,
        "lost_stage_state_bytes": state,
        "step_time_s": spread([r["step_time_s"] for r in runs]),
        "param_sha256": sorted({r["param_sha256"] for r in runs}),
        "machine": machine_info(),
    }


def format_takeover(report: dict[str, Any]) -> str:
    return (
        f"takeover: {report['model']}, 2 stages x 2 pipelines, worker {VICTIM_WORKER} SIGKILLed "
        f"in step {report['kill_at']}, {report['repeats']} runs: kill to next committed step "
        f"{format_spread(report['recovery_s'], '.2f')} s (median (min-max)); the lost stage's "
        f"state {report['lost_stage_state_bytes'] / 2**20:.1f} MiB (parameters and optimizer, "
        f"held by its predecessor); step {format_spread(report['step_time_s'], '.3f')} s"
    )
