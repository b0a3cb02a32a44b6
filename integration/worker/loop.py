"""The one training step loop: every entry point trains through :func:`run_steps`.

- ``deepspeed launch/train.py`` (``spotline.worker.launched.run_worker``): :func:`train_engine` with
  the Spotline engine's bookkeeping and a tracker hook (and the evaluations due), no
  recovery;
- ``spotline train`` (``spotline.worker.elastic.ElasticWorker``): :func:`train_engine` plus the
  elastic worker's hooks (progress and stop checks at each boundary, rebalancing,
  losses to the store, evaluations, checkpoints), once per generation from its resume step;
- the stock-DeepSpeed baseline (``spotline.launch.bench.stock_worker``): :func:`run_steps`
  over DeepSpeed's own ``train_batch``, with :class:`StepLog` only, so that its step times
  are taken by the same clock as Spotline's.

A hook sees each step boundary (:meth:`StepHooks.before_step`, which may end the loop there)
and each finished step (:meth:`StepHooks.after_step`), in the order the hooks are given.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from spotline.pipeline.redundancy import RedundantPipelineEngine
from spotline.wire.protocol import ReplicaMismatch


@dataclass(frozen=True)
class StepDone:
    """Optimizer step ``step`` (0-based) ran: its mean loss over logical workers, the
    seconds the step function took (``time.perf_counter``) and when it returned
    (``time.time``: comparable across the processes of a host)."""

    step: int
    loss: float
    seconds: float
    ended_at: float


@dataclass(frozen=True)
class LoopEnd:
    """How :func:`run_steps` ended: ``stopped_at`` is the boundary a hook stopped it at (that
    step was not run), None when every step ran; ``wall_s`` the loop's seconds."""

    stopped_at: int | None
    wall_s: float


class StepHooks:
    """What an entry point adds around each step; these defaults add nothing."""

    def before_step(self, step: int) -> bool:
        """Called at the boundary before ``step``: True ends the loop there (not run)."""
        return False

    def after_step(self, done: StepDone) -> None:
        """Called once ``done.step`` has run (and been applied)."""


def run_steps(
    train_step: Callable[[int], float],
    *,
    start: int,
    stop: int,
    hooks: Sequence[StepHooks] = (),
) -> LoopEnd:
    """Run steps ``start .. stop - 1`` through ``train_step`` (step -> loss), with ``hooks``."""
    t0 = time.perf_counter()
    for step in range(start, stop):
        # any() stops at the first hook that ends the loop: later hooks see no boundary.
        if any(hook.before_step(step) for hook in hooks):
            return LoopEnd(step, time.perf_counter() - t0)
        t_step = time.perf_counter()
        loss = train_step(step)
        done = StepDone(step, loss, time.perf_counter() - t_step, time.time())
        for hook in hooks:
            hook.after_step(done)
    return LoopEnd(None, time.perf_counter() - t0)


@dataclass
class StepLog(StepHooks):
    """Each step's loss, seconds and end time, by step (across generations for an elastic
    worker)."""

    losses: dict[int, float] = field(default_factory=dict)
    step_times: dict[int, float] = field(default_factory=dict)
    step_ends: dict[int, float] = field(default_factory=dict)

    def after_step(self, done: StepDone) -> None:
        self.losses[done.step] = done.loss
        self.step_times[done.step] = done.seconds
        self.step_ends[done.step] = done.ended_at


@dataclass
class EngineLog(StepLog):
    """:class:`StepLog` plus what the Spotline engine adds: each step's learning rate and the
    replica checks (``redundancy.verify_replicas``)."""

    learning_rates: dict[int, float] = field(default_factory=dict)
    # fp16: each step's loss scale, and the steps the job's overflow skipped.
    loss_scales: dict[int, float] = field(default_factory=dict)
    skipped_steps: set[int] = field(default_factory=set)
    replica_checks: int = 0
    replica_mismatches: list[ReplicaMismatch] = field(default_factory=list)


class _RecordEngineStep(StepHooks):
    def __init__(self, engine: RedundantPipelineEngine, log: EngineLog) -> None:
        self.engine = engine
        self.log = log

    def after_step(self, done: StepDone) -> None:
        self.log.after_step(done)
        stepped = self.engine.stepped_with
        position = stepped.state.schedule_position(done.step)
        self.log.learning_rates[done.step] = float(self.engine.step_schedule.at(position)["lr"])
        self.log.loss_scales[done.step] = stepped.scale
        if stepped.skipped:
            self.log.skipped_steps.add(done.step)


@dataclass(frozen=True)
class OwnState:
    """A stage's digest (``RedundantPipelineEngine.own_digest``) after ``version`` steps."""

    version: int
    digest: str

    @classmethod
    def of(cls, engine: RedundantPipelineEngine) -> OwnState:
        return cls(engine.applied_steps, engine.own_digest())


class _VerifyReplicas(StepHooks):
    """Each replica against its owner after every step, at the replica's version: a lazy
    replica's update waits for the next step's bubble, so it is compared with the owner's
    state one step back (kept from the step before), and once more after the run's end has
    applied the last update."""

    def __init__(self, engine: RedundantPipelineEngine, log: EngineLog) -> None:
        self.engine = engine
        self.log = log
        self.earlier = OwnState.of(engine) if engine.replica is not None else None
        self.last_step: int | None = None

    def after_step(self, done: StepDone) -> None:
        self.last_step = done.step
        if self.earlier is None:
            return
        now = OwnState.of(self.engine)
        self.check(done.step, (self.earlier, now))
        self.earlier = now

    def check(self, step: int, owner: Sequence[OwnState] = ()) -> None:
        bad = replica_mismatches(self.engine, owner)
        if bad is not None:
            self.log.replica_checks += 1
            self.log.replica_mismatches.extend(ReplicaMismatch(step, s) for s in bad)


def train_engine(
    engine: RedundantPipelineEngine,
    *,
    seed: int,
    start: int,
    stop: int,
    log: EngineLog,
    verify_replicas: bool,
    hooks: Sequence[StepHooks] = (),
) -> LoopEnd:
    """Train a Spotline engine from step ``start`` to ``stop`` (both entry points call this).

    Each step's loss, time and rate go to ``log`` before ``hooks`` see it; the replicas are
    checked (a collective over each pipeline) after them, when ``verify_replicas``. A loop
    that ends without an error applies the replica's waiting update (lazy redundancy), so
    the engine's state is whole for whatever comes next (a hand-over, a check); a failure
    leaves it waiting, as the recovery expects (a "ready" holding)."""
    every: list[StepHooks] = [_RecordEngineStep(engine, log), *hooks]
    verifier = _VerifyReplicas(engine, log) if verify_replicas else None
    if verifier is not None:
        every.append(verifier)
    end = run_steps(
        lambda step: engine.train_step(seed=seed, step=step), start=start, stop=stop, hooks=every
    )
    flushed = engine.flush_replica_step()
    if verifier is not None and flushed and verifier.last_step is not None:
        verifier.check(verifier.last_step)
    return end


def replica_mismatches(
    engine: RedundantPipelineEngine, owner: Sequence[OwnState] = ()
) -> list[int] | None:
    """Stages whose replica differs from the owner's state at the replica's version
    (gathered on every rank of the pipeline; compares digests of parameters and optimizer
    state). ``owner``: this rank's own states the replicas may be at (default: its current
    one). None when redundancy is off."""
    if engine.replica is None:
        return None
    states = list(owner) or [OwnState.of(engine)]
    mine = (
        engine.stage_id,
        [(x.version, x.digest) for x in states],
        engine.replica.stage,
        engine.replica_applied_steps,
        engine.replica_digest(),
    )
    group = engine.grid.get_pipe_parallel_group()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    owners = {
        (stage, version): digest for stage, kept, _, _, _ in gathered for version, digest in kept
    }
    for _, _, stage, version, _ in gathered:
        assert (stage, version) in owners, f"no digest of stage {stage} at step {version}"
    return sorted(
        stage for _, _, stage, version, digest in gathered if owners[(stage, version)] != digest
    )


def slow_machine(
    factor: float, measure: Callable[[int, float], None]
) -> Callable[[int, float], None]:
    """An ``engine.on_logical_worker_done`` hook for the demo's slow machine: each logical
    worker's share of a step takes ``factor`` times as long (a sleep after it), and
    ``measure`` is told the slowed time. Installed only when a config asks for it
    (``elasticity.slow_worker``)."""

    def hook(worker: int, seconds: float) -> None:
        time.sleep((factor - 1) * seconds)
        measure(worker, seconds * factor)

    return hook
