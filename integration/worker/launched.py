"""The worker of ``deepspeed launch/train.py``: one process, one DeepSpeed pipeline engine, a
fixed membership and no recovery.

:func:`run_worker` trains through the step loop every entry point uses,
``spotline.worker.loop.train_engine``: the same loop ``spotline train``'s workers run
(``ElasticWorker`` in ``spotline.worker.elastic``), without their hooks (no coordinator, no store,
no stop checks, rebalancing or checkpoints). Both paths share the inputs
(``spotline.data.inputs.prepare_inputs``: model config, corpus and eval set), the evaluations
(``spotline.worker.validator.Evaluator``), the process settings, the global sampler and the
engine (``spotline.worker.engine_builder``), and the export
(``spotline.worker.export.export_final_model``: the exported model, its tokenizer and its
hash). It writes what ``spotline train`` writes besides: each rank's output in ``logs/``
(rank ``r`` as worker :func:`worker_id` ``r``) and, from rank 0, ``timeline.csv``/
``timeline.png`` (``spotline.reports.timeline.Timeline``) and ``summary.json``'s placement
keys.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spotline.atomic_files import write_json_atomic
from spotline.config import RunConfig
from spotline.data import corpus as sl_data
from spotline.data.inputs import Inputs, prepare_inputs
from spotline.models import layers as models
from spotline.pipeline.engine import Batch
from spotline.pipeline.redundancy import RedundantPipelineEngine
from spotline.plan.grid import Layout, pipeline_name
from spotline.plan.logical import Assignment, assign_logical_workers
from spotline.plan.sampler import GlobalSampler
from spotline.reports.tee import tee_output
from spotline.reports.timeline import THROUGHPUT_EVERY_S, Timeline, summarize_recoveries
from spotline.reports.tracking import SUMMARY_NAME, Tracker, eval_fields
from spotline.run_dir import LOGS_DIR
from spotline.runtime import init_distributed, peak_rss_mib
from spotline.wire.protocol import EvalResult
from spotline.worker.engine_builder import build_worker_engine, global_sampler, prepare_process
from spotline.worker.export import export_final_model
from spotline.worker.loop import EngineLog, StepDone, StepHooks, train_engine
from spotline.worker.loop import replica_mismatches as _replica_mismatches
from spotline.worker.validator import Evaluator


@dataclass(frozen=True)
class WorkerIdentity:
    rank: int
    world_size: int


def worker_id(rank: int) -> str:
    """Rank ``rank``'s worker id: ``spotline train``'s ids (``w0``, ``w1``, ...), which name
    its log (``logs/w0.log``) and its slot in the timeline and ``logical_placements``."""
    return f"w{rank}"


def fixed_layout(num_stages: int, num_pipelines: int) -> Layout:
    """The one placement of a run without recovery: every rank runs the slot DeepSpeed's
    topology gives it (rank = stage * pipelines + pipeline), one logical stage each."""
    return Layout(
        num_stages=num_stages,
        num_pipelines=num_pipelines,
        groups=tuple((s,) for s in range(num_stages)),
        slots=tuple(
            tuple(worker_id(s * num_pipelines + p) for s in range(num_stages))
            for p in range(num_pipelines)
        ),
    )


@dataclass
class Worker:
    """One rank's live training state: what :func:`run_worker` or a test drives."""

    cfg: RunConfig
    ident: WorkerIdentity
    inputs: Inputs
    sampler: GlobalSampler
    engine: RedundantPipelineEngine
    setup_s: float
    layout: Layout  # where each rank runs (fixed: this path never re-places)
    assignment: Assignment  # each physical pipeline's logical workers, by pipeline_name

    @property
    def hf_config(self) -> Any:
        return self.inputs.hf_config

    @property
    def corpus(self) -> sl_data.PackedCorpus:
        """The rows trained on."""
        return self.inputs.corpus

    def get_batch(self, step: int, logical_worker: int, micro_batch: int) -> Batch:
        return self.corpus.batch(self.sampler.indices(step, logical_worker, micro_batch))

    def train_step(self, step: int) -> float:
        """Run optimizer step ``step`` (0-based); returns the mean loss over logical workers."""
        return self.engine.train_step(seed=self.cfg.spotline.training.seed, step=step)

    def replica_mismatches(self) -> list[int] | None:
        """Stages whose replica differs from the owner's state (gathered on every rank).

        ``None`` when redundancy is off. Compares digests of parameters and optimizer state.
        """
        return _replica_mismatches(self.engine)


def setup_worker(cfg: RunConfig, *, logs: Path | None = None) -> Worker:
    """Everything before the first step: process settings, process group, model, engine, data.

    ``logs``: from the moment every rank has joined the process group, this rank's output
    is copied into ``logs/<worker_id>.log`` as well (``spotline.reports.tee``)."""
    import os

    ident = WorkerIdentity(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    prepare_process(cfg)
    inputs = prepare_inputs(cfg)
    # Fewer logical workers than pipelines is refused by spotline.config.validate.
    assert cfg.num_logical_workers >= cfg.num_physical_pipelines
    if ident.world_size != cfg.num_workers:
        from spotline.errors import UserError

        raise UserError(
            f"{ident.world_size} processes were started but the config asks for "
            f"{cfg.num_workers} workers; pass --workers {ident.world_size} or start {cfg.num_workers}"
        )
    init_distributed()
    if logs is not None:
        # Only once every rank is here: each has checked that the output directory holds no
        # earlier run (launch/worker.py), a check that a log already written there would fail.
        dist.barrier()
        tee_output(logs / f"{worker_id(ident.rank)}.log")
    t_setup = time.perf_counter()
    sampler = global_sampler(cfg, len(inputs.corpus))
    layout = fixed_layout(cfg.num_stages, cfg.num_physical_pipelines)
    # The engine spotline train's workers build for a layout, for this fixed one: each
    # physical stage one logical stage.
    engine = build_worker_engine(
        cfg,
        inputs.hf_config,
        models.logical_parts(inputs.hf_config, cfg.num_stages),
        layout,
        inputs.corpus,
        sampler,
    )
    assert layout.slot_of(worker_id(ident.rank)) == (
        engine.grid.data_parallel_id,
        engine.grid.get_stage_id(),
    ), "DeepSpeed's topology places ranks as fixed_layout says"
    # Static placement (this launcher never rescales): logical workers spread evenly.
    assignment = assign_logical_workers(
        cfg.num_logical_workers, {pipeline_name(p): 1.0 for p in range(cfg.num_physical_pipelines)}
    )
    worker = Worker(
        cfg=cfg,
        ident=ident,
        inputs=inputs,
        sampler=sampler,
        engine=engine,
        setup_s=time.perf_counter() - t_setup,
        layout=layout,
        assignment=assignment,
    )
    engine.set_logical_workers(
        cfg.num_logical_workers, assignment[pipeline_name(engine.grid.data_parallel_id)]
    )
    return worker


class _TrackSteps(StepHooks):
    """The launcher path's hook: each step to the tracker (wandb, the progress line), and
    the evaluations due after it."""

    def __init__(
        self,
        tracker: Tracker,
        log: EngineLog,
        engine: RedundantPipelineEngine,
        evaluator: Evaluator | None,
    ) -> None:
        self.tracker = tracker
        self.log = log
        self.engine = engine
        self.evaluator = evaluator

    def after_step(self, done: StepDone) -> None:
        lr = self.log.learning_rates[done.step]
        self.tracker.log_step(done.step, {"loss": done.loss, "lr": lr, "step_time_s": done.seconds})
        if self.evaluator is not None and self.evaluator.due(done.step + 1):
            self.evaluator.run(self.engine, done.step + 1)


class _RecordTimeline(StepHooks):
    """The run's timeline (``spotline.reports.timeline.Timeline``: the rows ``spotline train``'s
    coordinator records, on a clock from ``t0``), which rank 0 writes: a ``start`` row, a
    ``throughput`` row of samples/s every ``THROUGHPUT_EVERY_S`` and at the last step, and
    an ``eval`` row per evaluation (rank 0's alone reports them). Every row has the one
    placement: this path never re-places."""

    def __init__(self, layout: Layout, *, t0: float, samples_per_step: int, last: int) -> None:
        self.timeline = Timeline()
        self.placement = {w: layout.describe(w) for w in layout.members}
        self.t0 = t0
        self.samples_per_step = samples_per_step
        self.last = last  # the step count at which the run ends: its rate row always shows
        self.mark = (0.0, 0)  # (time, steps done) of the last rate row, or of the start

    def _record(
        self,
        event: str,
        step: int,
        rate: float | None,
        detail: str,
        eval_loss: float | None = None,
    ) -> None:
        now = time.monotonic() - self.t0
        live = len(self.placement)
        self.timeline.record(
            now, event, step, live, self.placement, rate, detail, eval_loss=eval_loss
        )

    def start(self, step: int) -> None:
        # spotline.launch.control.metrics.RunMetrics.event's detail for the same event.
        self._record("start", step, None, f"workers:{len(self.placement)};step:{step}")
        self.mark = (time.monotonic() - self.t0, step)

    def after_step(self, done: StepDone) -> None:
        now = time.monotonic() - self.t0
        since, steps_then = self.mark
        reached = done.step + 1
        if now - since < THROUGHPUT_EVERY_S and reached < self.last:
            return
        samples = (reached - steps_then) * self.samples_per_step
        self._record("throughput", reached, samples / max(now - since, 1e-9), "")
        self.mark = (now, reached)

    def evaluated(self, result: EvalResult) -> None:
        self._record(
            "eval", result.step, None, f"perplexity:{result.perplexity!r}", eval_loss=result.loss
        )


def run_worker(cfg: RunConfig, output_dir: Path) -> dict[str, Any] | None:
    """Train ``cfg`` in this process (one rank of the job); rank 0 returns the summary.

    Writes what a run writes into ``output_dir``: this rank's log in ``logs/``; on rank 0
    the summary, the timeline and the model (collectively, with every rank)."""
    t0 = time.monotonic()
    worker = setup_worker(cfg, logs=output_dir / LOGS_DIR)
    sl = cfg.spotline
    engine = worker.engine
    is_reporter = worker.ident.rank == 0
    if is_reporter:
        # Every rank loaded the same data; one says what it has to say about it.
        for note in worker.inputs.data.notes():
            print(f"spotline: {note}", file=sys.stderr, flush=True)
    tracker = Tracker(
        sl.tracking,
        enabled=is_reporter,
        output_dir=output_dir,
        total_steps=sl.training.steps,
        run_config=cfg.to_json(),
    )
    log = EngineLog()
    # Rank 0's evaluations so far (it alone reports them and decides the best).
    evaluations: dict[int, EvalResult] = {}
    timeline = _RecordTimeline(
        worker.layout, t0=t0, samples_per_step=cfg.samples_per_step, last=sl.training.steps
    )

    def report(result: EvalResult) -> None:
        evaluations[result.step] = result
        tracker.log_eval(result)
        timeline.evaluated(result)

    evaluator = None
    if worker.inputs.eval_set is not None:
        evaluator = Evaluator(
            cfg,
            worker.inputs.eval_set,
            worker.hf_config,
            output_dir,
            earlier=lambda: {step: r.loss for step, r in evaluations.items()},
            report=report,
        )
    timeline.start(0)
    end = train_engine(
        engine,
        seed=sl.training.seed,
        start=0,
        stop=sl.training.steps,
        log=log,
        verify_replicas=sl.redundancy.verify_replicas,
        # The timeline's rate row first: a step's throughput leaves its evaluation out.
        hooks=[timeline, _TrackSteps(tracker, log, engine, evaluator)],
    )
    assert end.stopped_at is None  # no hook here stops the loop
    losses = list(log.losses.values())
    step_times = list(log.step_times.values())

    digest = export_final_model(engine, worker.hf_config, output_dir, cfg)
    per_rank = torch.tensor(
        [peak_rss_mib(), engine.redundant_s, engine.replica_sync_s, engine.sends_in_backward],
        dtype=torch.float64,
    )
    gathered = [torch.zeros_like(per_rank) for _ in range(worker.ident.world_size)]
    dist.all_gather(gathered, per_rank)
    state = torch.tensor(list(engine.model_state.to_json().values()), dtype=torch.int64)
    states = [torch.zeros_like(state) for _ in range(worker.ident.world_size)]
    dist.all_gather(states, state)
    summary: dict[str, Any] | None = None
    if is_reporter:
        assert digest is not None
        samples = sl.training.steps * cfg.samples_per_step
        summary = {
            "steps": sl.training.steps,
            "losses": losses,
            "learning_rates": list(log.learning_rates.values()),
            "loss_scales": list(log.loss_scales.values()),
            "skipped_steps": sorted(log.skipped_steps),
            "final_loss": losses[-1],
            "samples_per_s": samples / end.wall_s,
            "wall_s": end.wall_s,
            "setup_s": worker.setup_s,
            "step_time_s": sorted(step_times)[len(step_times) // 2],
            "step_times_s": step_times,
            "step_ended_at_s": list(log.step_ends.values()),
            "workers": cfg.num_workers,
            "stages": cfg.num_stages,
            "pipelines": cfg.num_physical_pipelines,
            "logical_workers": cfg.num_logical_workers,
            # spotline train's keys: the one placement (generation 0) and no moves (only
            # spotline train's workers move logical workers, as they measure their speeds).
            "logical_placements": [worker.layout.logical_placement(0, worker.assignment)],
            "logical_rebalances": [],
            "micro_batch_size": cfg.micro_batch_size,
            "micro_batches": cfg.num_micro_batches,
            "model": sl.model.name,
            "seed": sl.training.seed,
            "deterministic": sl.determinism.enabled,
            "bitwise_reproducible": not cfg.bitwise_caveats,
            "bitwise_caveats": cfg.bitwise_caveats,
            "redundancy": engine.redundancy,
            "param_sha256": digest,
            "peak_rss_mib_per_rank": [float(g[0]) for g in gathered],
            "redundant_compute_s_per_rank": [float(g[1]) for g in gathered],
            "replica_sync_s_per_rank": [float(g[2]) for g in gathered],
            "replica_sends_in_backward_per_rank": [int(g[3]) for g in gathered],
            "model_state_bytes_per_rank": [
                dict(zip(engine.model_state.to_json(), (int(v) for v in g), strict=True))
                for g in states
            ],
            "replica_checks": log.replica_checks,
            "replica_mismatches": [m.to_json() for m in log.replica_mismatches],
            "preemptions": 0,
            "hung_workers": 0,
            "recoveries": 0,
            "checkpoint_fallbacks": 0,
            "steps_redone": 0,
            "recovery_events": [],
            # spotline train's recovery figures, from the same timeline rows (all zero here).
            "recovery_summary": summarize_recoveries(timeline.timeline.rows),
            "data": worker.inputs.summary(),
            **eval_fields(evaluations),
        }
        timeline.timeline.write(
            output_dir, png=sl.tracking.timeline_png, title=f"spotline: {sl.model.name}"
        )
        write_json_atomic(output_dir / SUMMARY_NAME, summary)
    tracker.finish(summary)
    dist.barrier()
    # Before the interpreter exits: gloo's threads must not be left to static destruction.
    dist.destroy_process_group()
    return summary
