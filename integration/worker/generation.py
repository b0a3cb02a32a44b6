"""One generation of an elastic worker: its process group, and what it adds to the step loop.

- :func:`join_process_group` / :func:`leave_process_group`: the generation's gloo group over
  the job's store (``pg/<g>``), and DeepSpeed's view of it; every reference dropped at the end.
- :class:`LogicalWorkers`: which logical workers (EasyScale) this rank's pipeline runs, the
  speed it measures, and the moves within a generation (``spotline.plan.logical.rebalanced``).
- :class:`GenerationHooks`: the worker's hooks on the shared loop (``spotline.worker.loop``):
  its progress and the stop check at each boundary, rebalancing, losses and rates to the
  store, evaluations, checkpoints, and the ``--inject`` faults timed at a phase.
- :class:`TrainingRecord`: what every generation adds to the worker's report;
- the evaluations' store side: the earlier results, the one a loss cut short.

The engine itself is ``spotline.worker.engine_builder``'s, its state
``spotline.worker.state_transfer``'s.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spotline.config import RunConfig
from spotline.data.inputs import EvalSet
from spotline.pipeline.group_setup import init_generation_group
from spotline.pipeline.redundancy import RedundantPipelineEngine
from spotline.plan import logical as logical_placement
from spotline.plan.chaos import Injection
from spotline.plan.evaluation import eval_steps
from spotline.plan.grid import pipeline_name
from spotline.plan.layout import Holding
from spotline.runtime import peak_rss_mib
from spotline.wire.auth import AuthStore
from spotline.wire.gloo_waits import hold_groups_past_abort
from spotline.wire.protocol import (
    EvalResult,
    GenerationSetup,
    ModelStateBytes,
    Outcome,
    Rebalance,
    Report,
    WorkerStats,
    eval_key,
    loss_key,
    loss_scale_key,
    lr_key,
    process_group_prefix,
    progress_key,
    skipped_key,
    stop_key,
)
from spotline.wire.stores import AbortableStore
from spotline.worker.loop import EngineLog, StepDone, StepHooks
from spotline.worker.validator import Evaluator
from spotline.worker.worker_checkpoints import WorkerCheckpoints

# -- the process group ------------------------------------------------------------------


def join_process_group(
    raw_store: dist.Store,
    generation: int,
    rank: int,
    world: int,
    aborted: threading.Event,
    collective: timedelta,
) -> AbortableStore:
    """The generation's gloo group (``pg/<g>`` in the store), and DeepSpeed's view of it.
    Returns its rendezvous store, which the caller keeps for the generation: a Python store
    that only C++ references loses its methods (pybind's trampoline)."""
    # Abortable: a member lost before it wrote its rendezvous address must not hold the
    # others in a store wait for the whole timeout (see AbortableStore).
    store = AbortableStore(raw_store, aborted, collective)
    init_generation_group(
        # gloo's rendezvous reads and writes the store itself (its keys are not sealed).
        dist.PrefixStore(process_group_prefix(generation), store),
        rank,
        world,
        collective=collective,
        # A wait on gloo ends once the generation is aborted (spotline.wire.gloo_waits).
        aborted=aborted,
    )
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    return store


def leave_process_group() -> None:
    """Release every reference to the generation's groups (DeepSpeed's included) and
    destroy them, so that peers blocked on them see closed connections at once."""
    from deepspeed.runtime.pipe import p2p

    # Groups an abandoned collective still holds a thread of are destroyed by its waiter,
    # once the collective has timed out (spotline.wire.gloo_waits), not here.
    hold_groups_past_abort()
    p2p._groups = None
    p2p._grid = None
    try:
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()
    except Exception:
        if dist.is_initialized():
            dist.destroy_process_group()
    gc.collect()


# -- logical workers (EasyScale) ----------------------------------------------------------


class LogicalWorkers:
    """The logical workers of this rank's pipeline, and this rank's measured speed."""

    def __init__(self, num_logical_workers: int) -> None:
        self.num_logical_workers = num_logical_workers
        self.assignment: dict[str, tuple[int, ...]] = {}
        self.rebalances: list[Rebalance] = []  # moves within a generation (rank 0)
        # Seconds per logical worker on this rank since the last rebalance, while measuring.
        self.measuring = False
        self.seconds = 0.0
        self.count = 0
        self.last_measured: float | None = None

    def place(
        self,
        engine: RedundantPipelineEngine,
        assignment: Mapping[str, Sequence[int]],
        rebalanced_at: int | None = None,
    ) -> None:
        """Host the logical workers the assignment gives this rank's pipeline. A move made
        within a generation (``rebalanced_at``: the step) is recorded for the summary; the
        coordinator records the placement each generation starts with."""
        pipeline = pipeline_name(int(engine.grid.data_parallel_id))
        engine.set_logical_workers(self.num_logical_workers, tuple(assignment[pipeline]))
        self.assignment = {p: tuple(ws) for p, ws in assignment.items()}
        if rebalanced_at is not None and dist.get_rank() == 0:
            self.rebalances.append(
                Rebalance(rebalanced_at, tuple(self.assignment[p] for p in sorted(self.assignment)))
            )

    def restart(self) -> None:
        """A new generation: nothing measured yet."""
        self.seconds, self.count = 0.0, 0

    def measure(self, worker: int, seconds: float) -> None:
        """``engine.on_logical_worker_done``: this rank's speed, for the next rebalance."""
        if self.measuring:
            self.seconds += seconds
            self.count += 1

    def seconds_per_logical_worker(self) -> float | None:
        """The speed since the last measurement, else the last measured (None: never)."""
        return self.seconds / self.count if self.count else self.last_measured

    def rebalance(self, engine: RedundantPipelineEngine, step: int) -> None:
        """Measure every pipeline's speed and move logical workers if that pays off.

        Collective: every rank gathers every rank's seconds per logical worker since the
        last measurement and computes the same assignment from the same numbers
        (``spotline.plan.logical.rebalanced``), so no one has to announce it; nothing but
        the ids moves (every pipeline holds all the state its stages need)."""
        mine = torch.tensor([self.seconds / max(1, self.count)], dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        self.seconds, self.count = 0.0, 0
        self.last_measured = float(mine)
        proposed = logical_placement.rebalanced(
            self.assignment,
            [float(seconds) for seconds in gathered],
            int(engine.grid.get_data_parallel_world_size()),
        )
        if proposed is not None:
            self.place(engine, proposed, rebalanced_at=step)


# -- what the generations add up to -------------------------------------------------------


@dataclass
class TrainingRecord:
    """A worker's figures over all its generations, for its report (``WorkerStats``)."""

    # Losses, times, rates and replica checks of every step this worker ran.
    log: EngineLog = field(default_factory=EngineLog)
    train_start_t: float = float("inf")
    train_end_t: float = 0.0
    redundant_s: float = 0.0
    replica_sync_s: float = 0.0
    replica_sends_in_backward: int = 0
    model_state: ModelStateBytes = field(default_factory=ModelStateBytes)
    setups: list[GenerationSetup] = field(default_factory=list)

    def step_ran(self, done: StepDone) -> None:
        self.train_start_t = min(self.train_start_t, time.time() - done.seconds)
        self.train_end_t = time.time()

    def add_engine(self, engine: RedundantPipelineEngine) -> None:
        """A generation's engine, before it is dropped: its clocks and its peak state."""
        self.redundant_s += engine.redundant_s
        self.replica_sync_s += engine.replica_sync_s
        self.replica_sends_in_backward += engine.sends_in_backward
        self.model_state = self.model_state.peak(engine.model_state)

    def report(
        self,
        wid: str,
        outcome: Outcome,
        holdings: Sequence[Holding],
        previous_slot: tuple[int, int] | None,
        logical: LogicalWorkers,
        error: str | None,
    ) -> Report:
        """Worker ``wid``'s report at a generation's end: its outcome, what it holds, its
        last slot (None: it was no member), and every figure so far."""
        log = self.log
        return Report(
            worker=wid,
            outcome=outcome,
            holdings=tuple(holdings),
            previous_slot=previous_slot,
            losses=dict(log.losses),
            step_times=dict(log.step_times),
            step_ends=dict(log.step_ends),
            peak_rss_mib=peak_rss_mib(),
            stats=self.stats(logical),
            error=error,
        )

    def stats(self, logical: LogicalWorkers) -> WorkerStats:
        return WorkerStats(
            train_start_t=self.train_start_t if self.train_start_t != float("inf") else None,
            train_end_t=self.train_end_t or None,
            replica_checks=self.log.replica_checks,
            replica_mismatches=tuple(self.log.replica_mismatches),
            redundant_compute_s=self.redundant_s,
            replica_sync_s=self.replica_sync_s,
            replica_sends_in_backward=self.replica_sends_in_backward,
            seconds_per_logical_worker=logical.seconds_per_logical_worker(),
            rebalances=tuple(logical.rebalances),
            model_state=self.model_state,
            setups=tuple(self.setups),
        )


# -- the hooks on the step loop -------------------------------------------------------------


def deliver_injections(
    injections: Sequence[Injection],
    index: int,
    step: int,
    phase: str | None,
    *,
    own_only: bool = False,
) -> None:
    """The ``--inject`` faults worker ``index`` delivers to itself at ``step`` in ``phase``
    (None: the step boundary, where only ``stop`` is its own: the coordinator signals
    phase-less kills and notices, several at once). ``stop`` hangs the whole process,
    heartbeat thread included: a worker alive and silent, until the coordinator's
    heartbeat timeout kills it."""
    numbers = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}
    for inj in injections:
        if own_only and inj.signal != "stop":
            continue
        if (
            inj.signal in numbers
            and inj.phase == phase
            and inj.worker == index
            and inj.step == step
        ):
            os.kill(os.getpid(), numbers[inj.signal])


def should_stop(store: AuthStore, generation: int, step: int) -> bool:
    """Whether the coordinator asked generation ``generation`` to stop at ``step``."""
    key = stop_key(generation)
    if store.check([key]):
        return step >= int(store.get(key).decode())
    return False


def earlier_evaluations(store: AuthStore, cfg: RunConfig) -> dict[int, float]:
    """Every evaluation reported so far, by step (rank 0 asks, to tell the best): the
    store keeps them across generations, and a ``--resume`` puts the stopped run's
    there before the first plan."""
    out: dict[int, float] = {}
    for step in eval_steps(cfg.spotline.evaluation.interval_steps, cfg.spotline.training.steps):
        key = eval_key(step)
        if store.check([key]):
            out[step] = EvalResult.decode(store.get(key)).loss
    return out


def store_evaluator(
    cfg: RunConfig, eval_set: EvalSet, hf_config: Any, output: Path, store: AuthStore
) -> Evaluator:
    """The evaluations of an elastic worker: the earlier ones read from the store, each
    result reported to it (by rank 0, once its best model, if it is one, is saved)."""

    def report(result: EvalResult) -> None:
        store.set(eval_key(result.step), result.encode())

    return Evaluator(
        cfg,
        eval_set,
        hf_config,
        output,
        earlier=lambda: earlier_evaluations(store, cfg),
        report=report,
    )


def evaluate_if_missing(
    store: AuthStore, evaluator: Evaluator | None, engine: RedundantPipelineEngine, resume: int
) -> None:
    """The evaluation due at the step a generation resumes from, unless one was reported (a
    generation evaluates after each step it runs, so only an evaluation cut short by a
    loss, or a run resumed before its first step, is missing). Collective."""
    if evaluator is None or resume == 0 or not evaluator.due(resume):
        return
    missing = torch.tensor([int(not store.check([eval_key(resume)]))])
    # Every member must make the same choice (the evaluation is collective): one that
    # does not see the result makes them all evaluate again (the same numbers).
    dist.all_reduce(missing, op=dist.ReduceOp.MAX)
    if int(missing[0]):
        evaluator.run(engine, resume)


@dataclass
class GenerationHooks(StepHooks):
    """What an elastic worker adds to the shared loop in generation ``generation``, resumed
    at ``resume``: its progress and the stop check at each boundary, rebalancing every
    ``rebalance_every`` steps, losses and rates to the store (rank 0), its clocks,
    evaluations and checkpoints; and the phase-timed fault injections (:meth:`inject`)."""

    engine: RedundantPipelineEngine
    generation: int
    resume: int
    wid: str
    index: int
    store: AuthStore
    logical: Sequence[int]
    rebalance_every: int
    injections: Sequence[Injection]
    workers: LogicalWorkers
    record: TrainingRecord
    evaluator: Evaluator | None
    checkpoints: WorkerCheckpoints
    step: int = field(init=False)

    def __post_init__(self) -> None:
        self.step = self.resume

    def inject(self, phase: str) -> None:
        """``engine.phase_hook``: a kill or SIGTERM injection timed at this step's ``phase``.
        Phase-less injections are the coordinator's (at a step boundary, several at once)."""
        deliver_injections(self.injections, self.index, self.step, phase)

    def before_step(self, step: int) -> bool:
        self.step = step
        self.store.set(progress_key(self.generation, self.wid), str(step))
        deliver_injections(self.injections, self.index, step, None, own_only=True)
        if should_stop(self.store, self.generation, step):
            return True
        every = self.rebalance_every
        if every > 0 and step > self.resume and (step - self.resume) % every == 0:
            self.workers.rebalance(self.engine, step)
        # A generation's first step pays one-off costs (allocations, first collectives):
        # not a measure of speed.
        self.workers.measuring = step > self.resume
        return False

    def after_step(self, done: StepDone) -> None:
        if dist.get_rank() == 0:
            self.store.set(loss_key(done.step), repr(done.loss))
            log = self.record.log
            self.store.set(lr_key(done.step), repr(log.learning_rates[done.step]))
            self.store.set(loss_scale_key(done.step), repr(log.loss_scales[done.step]))
            if done.step in log.skipped_steps:
                self.store.set(skipped_key(done.step), "1")
        self.record.step_ran(done)
        # Before the checkpoint of this boundary: a checkpoint's files imply that every
        # evaluation up to its step is in the store (the coordinator keeps them with it).
        if self.evaluator is not None and self.evaluator.due(done.step + 1):
            self.evaluator.run(self.engine, done.step + 1)
        self.checkpoints.maybe_write(self.engine, self.logical, done.step + 1)
        self.checkpoints.publish_errors(self.store)
