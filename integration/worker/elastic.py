"""A worker that survives the loss of its peers: generations, in-memory state, takeover.

A worker lives through *generations*. Each generation is one torch.distributed process
group over the members the coordinator chose (``spotline.plan.layout``), one DeepSpeed
engine built for that layout, and a run of training steps. A generation ends when a peer
fails (gloo reports a dead peer as an exception within a fraction of a second), when the
coordinator asks every member to stop at a step boundary (an arrival, a departure) or when
training is done. Then the worker:

1. copies what it holds out of the engine into plain tensors: its own logical stages and
   its replica's, each with its optimizer state, the number of steps applied, and the
   final gradients of the step in progress if it got past the commit barrier;
2. drops every reference to the engine and destroys the process group, so that peers
   blocked on it see closed connections at once instead of waiting for a timeout;
3. reports its holdings to the coordinator's store and waits for the next plan;
4. rolls forward the step if the plan says it was committed, joins the next generation's
   process group, builds the engine for the new layout and loads its stages, receiving
   any it does not hold from the member the plan names (in memory, never from disk), then
   rebuilds replicas by a ring transfer from their owners;
5. resumes at the committed step, in the step loop every entry point runs
   (``spotline.worker.loop.train_engine``) with this worker's hooks: progress and stop checks,
   rebalancing, losses to the store, evaluations (first the one due at the resume step, if
   a loss cut it short), checkpoints. The sampler, the dropout seeds and every reduction
   are functions of the logical topology, so the result is bitwise what an undisturbed run
   gives (and what ``deepspeed launch/train.py`` gives).

:class:`ElasticWorker` conducts; each part is a module of its own, none of which knows it:

- ``spotline.worker.holdings``: what it holds (pack, assemble, roll forward);
- ``spotline.worker.state_transfer``: who sends which stage, shard or replica to whom;
- ``spotline.worker.liveness``: heartbeat, abort watch, coordinator lost, SIGTERM;
- ``spotline.worker.worker_checkpoints``: checkpoints, and the restore after a fatal loss;
- ``spotline.worker.generation``: the process group and the hooks on the step loop;
- ``spotline.worker.engine_builder``: the engine (the same as the launcher's worker's);
- ``spotline.worker.export``: the final model and its hash.

The process entry point is ``launch/elastic_worker.py``.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from spotline.config import RunConfig
from spotline.data.inputs import prepare_inputs
from spotline.errors import one_line
from spotline.exact.reduction import NonFiniteGradient
from spotline.models import layers as models
from spotline.pipeline.group_setup import connected_new_groups
from spotline.pipeline.instruction_profile import InstructionProfile, profile_dir, write_profile
from spotline.pipeline.redundancy import RedundantPipelineEngine
from spotline.plan.chaos import parse_injections
from spotline.plan.grid import Layout
from spotline.wire.auth import AuthStore, ForgedValue
from spotline.wire.protocol import (
    FINAL_HASH_KEY,
    GenerationSetup,
    Outcome,
    PlanMessage,
    entry_key,
    joined_key,
    plan_key,
    ready_key,
    report_key,
)
from spotline.wire.stores import connect_store, parse_store_arg
from spotline.worker.engine_builder import build_worker_engine, global_sampler, prepare_process
from spotline.worker.export import export_final_model
from spotline.worker.generation import (
    GenerationHooks,
    LogicalWorkers,
    TrainingRecord,
    evaluate_if_missing,
    join_process_group,
    leave_process_group,
    store_evaluator,
)
from spotline.worker.holdings import (
    Holdings,
    OptimizerRecipe,
    extract_holdings,
    roll_forward_holdings,
)
from spotline.worker.liveness import CoordinatorLost, Liveness, worker_token
from spotline.worker.loop import slow_machine, train_engine
from spotline.worker.state_transfer import load_generation_state
from spotline.worker.validator import Evaluator
from spotline.worker.worker_checkpoints import WorkerCheckpoints


class ElasticWorker:
    """One preemptible worker process, driven by plans from the coordinator's store."""

    def __init__(self, cfg: RunConfig, worker_id: str, store_addr: str, output: Path) -> None:
        self.cfg = cfg
        self.wid = worker_id
        self.index = int(worker_id.lstrip("w"))
        sl = cfg.spotline
        spec = parse_store_arg(store_addr)
        timeout = timedelta(seconds=max(60.0, sl.recovery.heartbeat_timeout_s * 4))
        # Every value is sealed with the job token its agent handed it (spotline.wire.auth):
        # what someone without the token writes is never acted on.
        token = worker_token()
        self.raw_store = connect_store(spec, timeout=timeout)
        self.store = AuthStore(self.raw_store, token)
        self.output = output
        self.liveness = Liveness(
            self.wid,
            spec,
            self.store,
            # A client is one thread's: each of the liveness threads connects its own.
            lambda: AuthStore(connect_store(spec, timeout=timedelta(seconds=30)), token),
            self._note,
            heartbeat_timeout_s=sl.recovery.heartbeat_timeout_s,
            term_grace_s=sl.recovery.term_grace_s,
        )
        self.holdings = Holdings()
        # How to apply a held step outside an engine (the last engine's optimizer).
        self.recipe: OptimizerRecipe | None = None
        self.injections = parse_injections(sl.recovery.inject)
        self.record = TrainingRecord()
        self.workers = LogicalWorkers(cfg.num_logical_workers)
        self.checkpoints = WorkerCheckpoints(
            cfg.checkpoint_root(output),
            sl.checkpoints.keep,
            self.wid,
            self._note,
            logical_workers=cfg.num_logical_workers,
            seed=sl.training.seed,
            interval=sl.checkpoints.interval_steps,
        )
        # Seconds by schedule instruction, over every engine of this worker (only when
        # SPOTLINE_INSTRUCTION_PROFILE names a folder: spotline bench profile).
        self.instruction_profile = InstructionProfile() if profile_dir() else None
        self.error: str | None = None
        self._engine: RedundantPipelineEngine | None = None  # the generation's, while it runs
        # The evaluations (spotline.evaluation), once the data is loaded; None: none asked.
        self.evaluator: Evaluator | None = None

    # -- main loop --------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.liveness.on_term)
        prepare_process(self.cfg)
        inputs = prepare_inputs(self.cfg)
        self.hf_config, self.corpus = inputs.hf_config, inputs.corpus
        if inputs.eval_set is not None:
            self.evaluator = store_evaluator(
                self.cfg, inputs.eval_set, self.hf_config, self.output, self.store
            )
        self.logical = models.logical_parts(self.hf_config, self.cfg.num_stages)
        self.sampler = global_sampler(self.cfg, len(self.corpus))
        self.liveness.start_heartbeat()
        self.store.set(joined_key(self.wid), "1")
        generation = int(self._wait_value(entry_key(self.wid)).decode())
        while True:
            plan = PlanMessage.decode(self._wait_value(plan_key(generation)))
            if plan.action == "finish":
                break
            outcome: Outcome = "standby"
            # The coordinator decides the interval (given, or Young/Daly for the baseline, or
            # shorter from an exposed plan's first committed step: spotline.plan.exposure).
            self.checkpoints.follow(plan.checkpoint_interval, plan.checkpoint_from)
            if plan.action == "restore":
                assert plan.checkpoint_step is not None  # PlanMessage's invariant
                self.holdings = self.checkpoints.restore(plan.checkpoint_step)
            if plan.layout is not None and self.wid in plan.layout.members:
                outcome = self._run_generation(generation, plan, plan.layout)
            self._report(generation, outcome, plan.layout)
            if self.liveness.leaving:
                break
            generation += 1
        self.liveness.stop_heartbeat()
        self.checkpoints.close()
        self.checkpoints.publish_errors(self.store)  # the coordinator reads them once we exit
        return 0

    def _wait_value(self, key: str) -> bytes:
        """Wait for a key as long as it takes (a standby may wait for minutes)."""
        while True:
            try:
                self.store.wait([key], timedelta(seconds=30))
                return self.store.get(key)
            except dist.DistStoreError:
                continue
            except ForgedValue:
                time.sleep(0.05)  # not the coordinator's: wait for its own value

    def _report(self, generation: int, outcome: Outcome, layout: Layout | None) -> None:
        self.checkpoints.publish_errors(self.store)
        member = layout is not None and self.wid in layout.members
        previous = layout.slot_of(self.wid) if layout is not None and member else None
        outcome = "leaving" if self.liveness.leaving else outcome
        holdings = self.holdings.report()
        report = self.record.report(self.wid, outcome, holdings, previous, self.workers, self.error)
        self.store.set(report_key(generation, self.wid), report.encode())

    def _note(self, text: str) -> None:
        try:
            print(f"[spotline {self.wid} {time.time():.2f}] {text}", flush=True)
        except OSError:  # the log is on a full disk: the store still carries what matters
            pass

    # -- one generation ---------------------------------------------------------------
    def _run_generation(self, generation: int, plan: PlanMessage, layout: Layout) -> Outcome:
        resume = plan.resume_step
        roll_forward_holdings(self.holdings, resume, self.recipe)
        rank = layout.rank_of(self.wid)
        world = len(layout.members)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        t0 = time.perf_counter()
        # Watched from here on: a peer lost while the group, the engine or the state transfer
        # is being set up must unblock this process as it would mid-step.
        aborted = self.liveness.enter_generation(generation, layout.members)
        collective = timedelta(seconds=self.cfg.spotline.recovery.collective_timeout_s)
        outcome: Outcome = "failed"
        self.error = None
        try:
            # Held for the generation (see join_process_group).
            self._generation_store = join_process_group(
                self.raw_store, generation, rank, world, aborted, collective
            )
            joined = time.perf_counter()
            # Every group's pairs connected at its creation: see spotline.pipeline.group_setup.
            with connected_new_groups(collective):
                engine = self._engine = build_worker_engine(
                    self.cfg,
                    self.hf_config,
                    self.logical,
                    layout,
                    self.corpus,
                    self.sampler,
                    profile=self.instruction_profile,
                )
            built = time.perf_counter()
            assert plan.logical is not None  # a plan with a layout assigns logical workers
            self.workers.place(engine, plan.logical)
            self.recipe = OptimizerRecipe.of(engine)
            state_bytes = load_generation_state(
                engine, plan, layout, self.wid, self.holdings, self.logical
            )
            self.holdings = Holdings()  # the engine holds it all now
            loaded = time.perf_counter()
            self.record.setups.append(
                GenerationSetup(
                    generation,
                    join_s=joined - t0,
                    build_s=built - joined,
                    state_s=loaded - built,
                    state_bytes=state_bytes,
                )
            )
            self.store.set(ready_key(generation, self.wid), repr(loaded - t0))
            outcome = self._train(engine, generation, resume)
        except NonFiniteGradient as exc:
            # Every rank raises it (the exact reduction's flags are all-reduced) before the
            # step is applied: nothing to recover, the job must stop and say why.
            step = int(self._engine.rng_step) if self._engine is not None else -1
            self.error = f"step {step}: {exc}"
            outcome = "non-finite"
        except (RuntimeError, dist.DistBackendError, ConnectionError, TimeoutError) as exc:
            # A store error (not a gloo one) may mean the coordinator is gone, not a peer.
            store_error = isinstance(exc, (dist.DistNetworkError, dist.DistStoreError))
            if store_error and self.liveness.coordinator_lost():
                raise CoordinatorLost from None
            # A peer died or left mid-step; what this process holds survives in memory.
            self.error = one_line(exc)
            self._note(f"generation {generation}: {self.error}")
            outcome = "failed"
            self.liveness.abort_generation(generation)
        except Exception as exc:
            # Not a lost peer (a full disk at the export, a bug): the job must stop with this
            # error, not recover from it. The traceback goes to this worker's log.
            self.error = one_line(exc)
            self._note(f"generation {generation}: error:\n{traceback.format_exc()}")
            outcome = "error"
            self.liveness.abort_generation(generation)
        # Outside the except block: the traceback (and the engine it references) is gone.
        self.liveness.leave_generation(generation)
        self._teardown()
        return outcome

    def _train(self, engine: RedundantPipelineEngine, generation: int, resume: int) -> Outcome:
        """The shared loop (``spotline.worker.loop``) plus this worker's hooks, from ``resume``."""
        sl = self.cfg.spotline
        hooks = GenerationHooks(
            engine,
            generation,
            resume,
            wid=self.wid,
            index=self.index,
            store=self.store,
            logical=self.logical,
            rebalance_every=sl.elasticity.rebalance_every,
            injections=self.injections,
            workers=self.workers,
            record=self.record,
            evaluator=self.evaluator,
            checkpoints=self.checkpoints,
        )
        engine.phase_hook = hooks.inject
        engine.on_logical_worker_done = self.workers.measure
        factor = sl.elasticity.slow_factor
        if self.index == sl.elasticity.slow_worker and factor > 1:
            engine.on_logical_worker_done = slow_machine(factor, self.workers.measure)
        self.workers.restart()
        evaluate_if_missing(self.store, self.evaluator, engine, resume)
        # The commit barrier stays gloo's: if a peer fails while others wait in it, the
        # abort watch (or the heartbeat thread) sees the abort and shuts this process's
        # connections.
        end = train_engine(
            engine,
            seed=sl.training.seed,
            start=resume,
            stop=sl.training.steps,
            log=self.record.log,
            verify_replicas=sl.redundancy.verify_replicas,
            hooks=[hooks],
        )
        if end.stopped_at is not None:
            self.checkpoints.at_stop(engine, self.logical, generation, end.stopped_at, self.store)
            self._save_holdings(engine)
            return "boundary"
        self._save_holdings(engine)
        # Rank 0 of the last generation gathers the parameters, hashes and exports them.
        digest = export_final_model(engine, self.hf_config, self.output, self.cfg)
        if digest is not None:
            self.store.set(FINAL_HASH_KEY, digest)
        dist.barrier()
        return "done"

    def _save_holdings(self, engine: RedundantPipelineEngine) -> None:
        self.holdings = extract_holdings(engine, self.logical)
        self.recipe = OptimizerRecipe.of(engine)

    def _teardown(self) -> None:
        """Copy state out (if the engine still exists), then release every group reference."""
        engine = self._engine
        if engine is not None:
            self.record.add_engine(engine)
            if self.instruction_profile is not None:
                write_profile(self.instruction_profile, self.wid)
            if not self.holdings.stages:
                self._save_holdings(engine)
            self._engine = None
            del engine
        leave_process_group()
