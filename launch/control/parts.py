"""The coordinator's parts, made and wired together: which part is handed what.

:func:`assemble` opens the job's store and makes every part of one job, in the order their
needs give: a part is handed the parts it uses, or their methods as callbacks, and never
the coordinator, so every arrow between them points one way (the planner, for one, gets
:class:`~spotline.launch.control.recovery.LoopHooks`: the admission's wait for joiners,
the losses' poll, the stop's keys). :class:`JobParts` holds them for
:class:`spotline.launch.coordinator.Coordinator`, which conducts them.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from spotline.config import RunConfig
from spotline.launch.control.admission import Admitter
from spotline.launch.control.checkpoints import CheckpointCommits
from spotline.launch.control.faults import FaultDelivery
from spotline.launch.control.job_state import JobState, Progress
from spotline.launch.control.job_takeover import open_job_store
from spotline.launch.control.local_agent import LocalAgent
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.recovery import GenerationPlanner, LoopHooks
from spotline.launch.control.stopping import StopProtocol
from spotline.launch.control.supervisor import Supervisor
from spotline.launch.control.watch import HeartbeatPacer, Losses, StallWatch, Watch
from spotline.run_dir import TOKEN_NAME
from spotline.sim.recovery_policies import RECOVERY_POLICIES, RecoveryPolicy
from spotline.wire.auth import AuthStore, job_token

if TYPE_CHECKING:
    from spotline.wire.stores import StoreSpec


@dataclass(frozen=True)
class JobParts:
    """One job's parts (each module's docstring says what it does)."""

    store: AuthStore  # every value sealed with the job token, and checked against it
    store_spec: StoreSpec  # what workers and agents connect with
    token_path: Path  # the job token's file, which agents are given
    state: JobState
    metrics: RunMetrics
    supervisor: Supervisor
    progress: Progress
    faults: FaultDelivery
    policy: RecoveryPolicy
    checkpoints: CheckpointCommits
    stop: StopProtocol
    admission: Admitter
    planner: GenerationPlanner
    local_agent: LocalAgent
    watch: Watch


def assemble(
    cfg: RunConfig,
    config_path: Path,
    output: Path,
    *,
    env: dict[str, str],
    listen: tuple[str, int] | None,
    token_file: str | None,
) -> JobParts:
    """One job's parts (the arguments are :class:`~spotline.launch.coordinator.
    Coordinator`'s); its store is up when this returns."""
    rec = cfg.spotline.recovery
    cluster = listen is not None
    t0 = time.monotonic()  # the run's clock starts before the store is up (etcd: a moment)
    token = job_token(output, token_file)
    token_path = Path(token_file) if token_file else output / TOKEN_NAME
    raw_store, spec = open_job_store(rec, output, listen)
    forged: set[str] = set()

    def on_forged(key: str) -> None:
        # A value written without the job token is as if never written, and told once. The
        # metrics are made below (they read through this store): they exist by any read.
        if key not in forged:
            forged.add(key)
            metrics.event("forged", key=key)

    store = AuthStore(raw_store, token, on_forged=on_forged)
    state = JobState()
    # The snapshot reads the progress, made below (it needs the supervisor, which needs the
    # metrics); the metrics ask for it only once the run has started.
    metrics = RunMetrics(cfg, store, snapshot=lambda: progress.snapshot(), t0=t0)
    sup = Supervisor(
        store,
        metrics,
        config_path=config_path,
        output=output,
        store_arg=spec.to_arg(),
        env=env,
        on_refused=lambda what: _say_refused(metrics, what),
    )
    progress = Progress(store, sup, metrics, state)
    faults = FaultDelivery(cfg, store, sup, metrics, progress)
    policy = RECOVERY_POLICIES[rec.mode]
    interval = policy.checkpoint_interval(cfg, faults.mtbf_s())
    checkpoints = CheckpointCommits(cfg, store, metrics, output, interval_steps=interval)
    stop = StopProtocol(store, checkpoints, state, steps=cfg.spotline.training.steps)
    stall = StallWatch(
        rec.no_progress_timeout_s,
        rec.trace_clock,
        read=lambda: (progress.max_progress(), metrics.preemptions, sup.next_index),
    )
    timeout_s = rec.heartbeat_timeout_s if cluster else None
    losses = Losses(store, sup, metrics, state, machine_timeout_s=timeout_s)
    admission = Admitter(
        cfg,
        sup,
        metrics,
        state,
        progress,
        faults,
        poll_workers=losses.poll,
        check_stalled=stall.check,
        cluster=cluster,
        # What agents pass to --join: the coordinator's address, or the etcd job.
        join_arg=f"{spec.host}:{spec.port}" if spec.backend == "tcp" else spec.to_arg(),
        token_path=token_path,
    )
    hooks = LoopHooks(
        max_progress=progress.max_progress,
        wait_for_joiners=admission.wait_for_joiners,
        poll_workers=losses.poll,
        stop_keys=stop.stop_keys,
    )
    planner = GenerationPlanner(
        cfg, store, sup, metrics, checkpoints, state, hooks, cluster=cluster
    )
    local_agent = LocalAgent(output)
    watch = Watch(
        store=store,
        supervisor=sup,
        metrics=metrics,
        state=state,
        progress=progress,
        losses=losses,
        heartbeats=HeartbeatPacer(sup, rec.heartbeat_timeout_s),
        stall=stall,
        faults=faults,
        admission=admission,
        stop=stop,
        checkpoints=checkpoints,
        check_agent=local_agent.check,
        collective_timeout_s=rec.collective_timeout_s,
    )
    return JobParts(
        store=store,
        store_spec=spec,
        token_path=token_path,
        state=state,
        metrics=metrics,
        supervisor=sup,
        progress=progress,
        faults=faults,
        policy=policy,
        checkpoints=checkpoints,
        stop=stop,
        admission=admission,
        planner=planner,
        local_agent=local_agent,
        watch=watch,
    )


def _say_refused(metrics: RunMetrics, what: str) -> None:
    """A machine (or a value) refused for want of the job token: an event, and one line."""
    metrics.event("refused", what=what)
    print(f"spotline: refused {what}", file=sys.stderr, flush=True)
