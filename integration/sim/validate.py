"""The simulator against reality: predict the goodput of a local trace replay.

A local replay (``spotline train --trace T --time-scale X --max-workers M``) plays trace T,
scaled to at most M nodes by :func:`spotline.plan.traces.scale_trace`, X times faster than
it was recorded, from the moment its first workers have started. :func:`predict_replay`
replays the same scaled trace through :func:`spotline.sim.simulator.simulate` in wall seconds
(trace times divided by X) with a calibration measured on the same machine by ``spotline
calibrate``, and the ``spotline-rigid`` policy, which is what the runtime executed when the
validation replay in tests/data/replay-validation was recorded (data parallelism fixed,
stages folded onto fewer workers after a loss; the runtime now plans in the elastic mode,
the ``spotline`` policy).

The local run trains a fixed number of steps in ``train_wall_s`` seconds from its first
step; the prediction is the samples the simulator commits over the same training window,
divided by its length. The replay's first workers are ready when its clock starts; later
arrivals take one of the ``recovery.warm_workers`` processes started ahead (ready once it
has started) or start cold (``node_ready_s``), as the local launcher does.

:func:`predict_cluster_replay` does the same for ``spotline bench cluster-replay``, the
trace played machine by machine on a namespace cluster (each node a machine of one slot,
killed whole, arrivals booted cold), with the runtime's own policy (``spotline``) and a
calibration whose step times and ``node_ready_s`` were measured on that cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spotline.plan.traces import Trace, TraceEvent, scale_trace
from spotline.sim.calibration import Calibration
from spotline.sim.membership import membership_batches
from spotline.sim.results import PolicyResult
from spotline.sim.sim_config import PolicyName, SimConfig
from spotline.sim.simulator import simulate


@dataclass(frozen=True)
class ReplayPrediction:
    """The simulator's view of a local replay: its goodput and the run it simulated."""

    goodput_samples_per_s: float
    window_s: float
    result: PolicyResult


def wall_clock_trace(trace: Trace, *, max_workers: int, time_scale: float) -> Trace:
    """``trace`` as a local replay plays it: scaled to ``max_workers`` nodes, its first
    instant at 0 and every time divided by ``time_scale``."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    scaled = scale_trace(trace, max_workers)
    start = scaled.events[0].t_s if scaled.events else 0.0
    return Trace(
        tuple(TraceEvent((e.t_s - start) / time_scale, e.kind, e.node) for e in scaled.events),
        (scaled.duration_s - start) / time_scale,
        f"{scaled.source} at {time_scale:g}x",
    )


def predict_replay(
    trace: Trace,
    calibration: Calibration,
    *,
    model: str,
    num_workers: int,
    max_workers: int,
    time_scale: float,
    train_wall_s: float,
    checkpoint_interval_steps: int,
    warm_workers: int,
) -> ReplayPrediction:
    """The goodput the simulator predicts for a local replay that trained for
    ``train_wall_s`` seconds on ``num_workers`` configured workers (``stages x pipelines``)."""
    wall = wall_clock_trace(trace, max_workers=max_workers, time_scale=time_scale)
    # The local clock starts with the first step; the simulator's first start pays a
    # rendezvous before it. Simulate that much longer and count the same training window.
    horizon = calibration.fatal_rendezvous_s + train_wall_s
    result = _simulate_window(
        wall,
        horizon,
        calibration,
        model=model,
        num_workers=num_workers,
        checkpoint_interval_steps=checkpoint_interval_steps,
        policy="spotline-rigid",
        warm_workers=warm_workers,
    )
    return ReplayPrediction(result.committed_samples / train_wall_s, train_wall_s, result)


def predict_cluster_replay(
    trace: Trace,
    calibration: Calibration,
    *,
    model: str,
    num_workers: int,
    machines: int,
    time_scale: float,
    window_s: float,
    checkpoint_interval_steps: int,
) -> ReplayPrediction:
    """The goodput the simulator predicts for ``spotline bench cluster-replay``: ``trace``
    scaled to ``machines`` one-slot machines and played ``time_scale`` times faster, machine
    by machine (each trace node is one machine, its removal kills the machine whole, an
    arrival boots a new one that is ready ``node_ready_s`` later: no warm pool), over the
    ``window_s`` seconds from when the first instant's machines had all joined to the last
    step's commit. The policy is the runtime's (``spotline``: elastic, exposure
    checkpoints); ``num_workers`` is the job's ``--workers`` (its logical topology)."""
    wall = wall_clock_trace(trace, max_workers=machines, time_scale=time_scale)
    result = _simulate_window(
        wall,
        window_s,
        calibration,
        model=model,
        num_workers=num_workers,
        checkpoint_interval_steps=checkpoint_interval_steps,
        policy="spotline",
        warm_workers=0,
    )
    return ReplayPrediction(result.committed_samples / window_s, window_s, result)


def _simulate_window(
    wall: Trace,
    horizon_s: float,
    calibration: Calibration,
    *,
    model: str,
    num_workers: int,
    checkpoint_interval_steps: int,
    policy: PolicyName,
    warm_workers: int,
) -> PolicyResult:
    """``policy`` on the wall-clock trace ``wall`` cut at ``horizon_s``, its first instant's
    nodes ready at once."""
    model_cal = calibration.model(model)
    events = tuple(e for e in wall.events if e.t_s <= horizon_s)
    window = Trace(events, horizon_s, wall.source)
    step_s = model_cal.step_time_s(num_workers // model_cal.num_stages, False)
    config = SimConfig(
        calibration,
        model_cal,
        num_workers,
        spotline_checkpoint_interval_s=max(1e-3, checkpoint_interval_steps * step_s),
    )
    batches = membership_batches(
        window, calibration.node_ready_s, warm_pool=warm_workers, initial_ready=True
    )
    return simulate(window, policy, config, batches=batches)


def replay_record(summary: dict[str, Any], resolved_config: dict[str, Any]) -> dict[str, Any]:
    """What a prediction needs of a finished local replay (its ``summary.json`` and
    ``config.resolved.json``), with the measured goodput, as tests/data keeps it."""
    spotline = resolved_config["spotline"]
    recovery = spotline["recovery"]
    if not recovery.get("trace"):
        raise ValueError("the run replayed no trace (recovery.trace is empty)")
    return {
        "trace": recovery["trace"].replace("\\", "/").rsplit("/", 1)[-1],
        "time_scale": recovery["time_scale"],
        "trace_clock": recovery["trace_clock"],
        "max_workers": recovery["max_workers"] or summary["workers"],
        "warm_workers": recovery["warm_workers"],
        "workers": summary["workers"],
        "stages": summary["stages"],
        "steps": summary["steps"],
        "checkpoint_interval_steps": summary["checkpoint_interval_steps"],
        "train_wall_s": summary["train_wall_s"],
        "goodput_samples_per_s": summary["goodput_samples_per_s"],
        "preemptions": summary["preemptions"],
        "recoveries": summary["recoveries"],
        "checkpoint_fallbacks": summary["checkpoint_fallbacks"],
        "steps_redone": summary["steps_redone"],
        "param_sha256": summary["param_sha256"],
    }
