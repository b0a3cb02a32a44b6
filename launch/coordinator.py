"""The coordinator: the on-demand process that owns membership and never trains.

It hosts the job's store (``spotline.wire.stores``: torch's TCPStore, or an etcd key directory),
starts the worker processes and, generation after generation, publishes a plan computed by
``spotline.plan.layout`` from what the live workers report they hold. Workers keep their
state in memory across generations; only a fatal loss (a stage held by no live worker) reads
the last checkpoint. What the coordinator and the workers say to each other, and under which
store keys, is :mod:`spotline.wire.protocol`.

:class:`Coordinator` is the conductor: it runs the generation loop (watch a generation until
its members report, tell how it ended, plan the next one) and answers the CLI. Its parts are
the modules of ``spotline.launch.control`` (its ``__init__`` lists them), made and wired by
:func:`~spotline.launch.control.parts.assemble`; each is handed what it needs, never the
coordinator.

It never trains, and never loads what training needs: no DeepSpeed, no transformers, not
the tensor half of the checkpoints (it reads and commits manifests through
:mod:`spotline.checkpointing.manifest`); torch only for the store.

A worker that exits with an error, or reports one, is not a preemption: the job stops and
says why (``JobError``). A first Ctrl-C (``request_stop``) stops the job at the next step
boundary that has a checkpoint (``Stopped``); the second one is the caller's to handle.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotline.atomic_files import write_json_atomic
from spotline.config import RunConfig
from spotline.launch.control.job_takeover import adopt, adoptable, forget_job, release_store
from spotline.launch.control.local_agent import end_agents
from spotline.launch.control.outcomes import FailureCount, GenerationEnd, classify, take_reports
from spotline.launch.control.parts import assemble
from spotline.launch.control.resume import carry_over
from spotline.launch.control.supervisor import JobError, child_environment
from spotline.plan.layout import WorkerReport
from spotline.run_dir import RECORD_NAME
from spotline.wire.protocol import PlanMessage, entry_key

if TYPE_CHECKING:
    # The processes this coordinator starts, as arrows readers and tools can follow: the
    # workers (``python -m`` launch/elastic_worker.py, forked by each machine's agent) and
    # spotline train's local agent. Never imported when it runs: the worker's module loads
    # torch, DeepSpeed and transformers, which the control plane must not; so they run by
    # name (spotline.launch.control.entry_points, whose names a test ties to these modules).
    from spotline.launch import agent, elastic_worker  # noqa: F401

__all__ = ["Coordinator", "JobError", "Stopped", "child_environment"]


class Stopped(Exception):
    """The job stopped as asked (a Ctrl-C); ``step`` is where a resume starts (None: none
    was committed, a resume starts from step 0)."""

    def __init__(self, step: int | None, stopped_at: int) -> None:
        super().__init__(f"stopped at step {stopped_at}")
        self.step = step
        self.stopped_at = stopped_at


class Coordinator:
    def __init__(
        self,
        cfg: RunConfig,
        config_path: Path,
        output: Path,
        *,
        env: dict[str, str],
        resume_from: int | None = None,
        listen: tuple[str, int] | None = None,
        token_file: str | None = None,
    ) -> None:
        """``listen``: ``spotline coordinator``'s address (the control plane alone: the
        machines' agents join it); None: ``spotline train``'s one machine (a local agent, the
        store on 127.0.0.1). ``token_file``: the job token (None: the one in ``output``, or
        a new one written there). ``resume_from``: the stopped run's committed checkpoint
        the first generation restores (--resume)."""
        self.cfg, self.sl, self.output = cfg, cfg.spotline, output
        self.resume_from = resume_from
        self.cluster = listen is not None
        # The store is up once the parts are: the one reason this process holds torch (the
        # job store is torch.distributed's; summary.json's "coordinator_heavy_modules"
        # lists what it loaded, and a slow test checks it).
        self.parts = parts = assemble(
            cfg, config_path, output, env=env, listen=listen, token_file=token_file
        )
        self.metrics = parts.metrics  # the CLI reads the progress of a part that failed
        self.failures = FailureCount()
        if resume_from is not None:
            root = cfg.checkpoint_root(output)
            carry_over(parts.metrics, parts.store, root, output, resume_from)

    # -- what the CLI asks before the run -------------------------------------------------
    def start_local_agent(self) -> None:
        """``spotline train``'s machine: one agent on this one, through the same code as a
        cluster's (``spotline agent``), with a slot for each starting worker. Started once;
        the CLI starts it early (while it checks the inputs), else :meth:`run` does."""
        p = self.parts
        p.local_agent.start(
            p.store_spec.to_arg(),
            slots=p.faults.initial_workers(),
            env=p.supervisor.env,
            token_file=p.token_path,
        )

    def admit_machines(self) -> None:
        """Answer the machines that registered (the local agent's head start registers while
        the CLI still checks the inputs, and waits for its answer only so long)."""
        self.parts.supervisor.machines.refresh()

    def abandon(self) -> None:
        """The job does not start (its inputs were wrong, or a Ctrl-C came first): the local
        agent, which has started no worker, is stopped."""
        self.parts.local_agent.abandon()

    def request_stop(self) -> None:
        """A first Ctrl-C (called from a signal handler: it only sets a flag)."""
        self.parts.stop.request()

    # -- the run --------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """The job to its end: its summary (Stopped after a Ctrl-C's stop)."""
        p = self.parts
        if self.cluster and adoptable(p.store):
            # An etcd job a predecessor ran: the workers never stopped (control/job_takeover.py).
            steps = self.sl.training.steps
            adopt(p.store, p.supervisor, p.state, p.metrics, p.progress, steps=steps)
            return self._run_generations(time.monotonic())
        # Machines that joined a predecessor that never started training are kept.
        p.supervisor.machines.adopt()
        initial = p.faults.initial_workers()
        if self.cluster:
            p.admission.wait_for_machines(slots=initial)
        else:
            self.start_local_agent()
            p.local_agent.wait_joined(p.supervisor.machines)
        ids = []
        for _ in range(initial):
            wid = p.supervisor.spawn()
            p.planner.include(wid, 0)
            ids.append(wid)
        p.faults.initial_ids = list(ids)
        p.faults.keep_warm()
        p.planner.start(ids, self.resume_from)
        self.metrics.event("start", workers=len(ids), step=p.state.resume_step)
        return self._run_generations(time.monotonic())

    def _run_generations(self, t_start: float) -> dict[str, Any]:
        """Generations until the job is done (or stopped); its summary."""
        p = self.parts
        end = self._run_generation()
        while not end.ends_job:
            end = self._run_generation()
        if end is GenerationEnd.STOPPED:
            stopped_at = self._stop_workers()
            raise Stopped(self.last_committed(), stopped_at)
        t_end = time.monotonic()
        self.metrics.show_progress(done=self.sl.training.steps)
        self.metrics.collect_evaluations()
        # Training time: from the first step to the last commit, recoveries included.
        train_wall_s = t_end - (self.metrics.first_step_t or t_start)
        self._finish_workers(timeout_s=30)
        train_wall_s = self.metrics.train_wall_s(fallback_s=train_wall_s)
        p.checkpoints.poll_errors()  # those of the last steps, told as the workers exited
        p.checkpoints.commit(last=self.sl.training.steps)
        self.metrics.write_timeline(self.output)
        summary = self.metrics.summary(
            wall=t_end - t_start,
            train_wall_s=train_wall_s,
            layout=p.state.layout,
            generations=p.state.generation + 1,
            checkpoint_interval_steps=p.checkpoints.interval_steps,
            exposure_checkpoints=p.checkpoints.exposure_checkpoints(),
            resumed_from_step=self.resume_from,
        )
        release_store(p.store_spec, self.output)
        return summary

    def _run_generation(self) -> GenerationEnd:
        """Watch the generation in flight to its end; plan the next one unless the job ends."""
        p = self.parts
        state, sup, progress = p.state, p.supervisor, p.progress
        g = state.generation
        expected = {w for w in sup.live_ids() if w in state.included}
        if not expected:
            # Everyone in the last plan is gone: wait for new workers, then restore.
            self.metrics.event("waiting-for-workers", live=0)
            joiners = p.admission.wait_for_joiners()
            state.generation = g + 1
            arrived = [WorkerReport(w, machine=sup.machine_of(w)) for w in joiners]
            self._plan_next(arrived, failure=True, reached=progress.max_progress() + 1)
            return GenerationEnd.FAILED
        reports = p.watch.collect_reports(g, expected)
        take_reports(reports, sup, self.metrics, p.checkpoints)
        end = classify(
            {w: r.outcome for w, r in reports.items()},
            state.members(),
            stop_target=p.stop.target,
            progress=progress.max_progress,
        )
        if end.ends_job:
            return end
        # The step in flight when the generation ended (started, maybe not committed).
        reached = progress.max_progress() + 1
        p.checkpoints.commit(last=reached)
        joined = p.admission.joined_waiting()
        live_reports = [
            reports[w].planner_view(sup.machine_of(w))
            if w in reports
            else WorkerReport(w, machine=sup.machine_of(w))
            for w in sup.live_ids()
            if sup[w].fate == "running" and (w in state.included or w in joined)
        ]
        if end is GenerationEnd.FAILED:
            lost_process = self.metrics.pending_failure_t is not None
            self.failures.count(reports, lost_process=lost_process)
        state.generation = g + 1
        self._plan_next(live_reports, failure=end is GenerationEnd.FAILED, reached=reached)
        return end

    def _plan_next(self, reports: list[WorkerReport], *, failure: bool, reached: int) -> None:
        """The next generation: awaited arrivals first, then the recovery policy (a failure)
        or a plan from what everyone holds (an arrival, a departure)."""
        p = self.parts
        reports = p.admission.await_arrivals(reports)
        # A change without a failure is timed from here: everyone has stopped and every
        # awaited arrival has finished starting (its start-up is the cloud's boot time).
        ready_t = self.metrics.now()
        if failure:
            p.policy.recover(p.planner, reports, reached=reached, ready_t=ready_t)
        else:
            p.planner.replan(reports, failure=False, reached=reached, ready_t=ready_t)

    def _finish_workers(self, timeout_s: float) -> None:
        """Publish "finish" and wait for every worker (and agent) to exit."""
        p = self.parts
        after = p.state.generation + 1
        p.planner.publish(after, PlanMessage.finish())
        for w in p.supervisor.live_ids() + p.supervisor.warm_ids():
            if w not in p.state.included:
                # Started but never planned (warm, or arrived at the end): let it read "finish".
                p.store.set(entry_key(w), str(after))
        p.supervisor.wait_all(timeout_s)
        end_agents(p.supervisor.machines, p.local_agent)

    def _stop_workers(self) -> int:
        """After a stop at a boundary: every worker exits, its checkpoint writes done; the
        stop's checkpoint is committed. The step the job stopped at."""
        p = self.parts
        self._finish_workers(timeout_s=60)
        p.checkpoints.poll_errors()
        assert p.stop.target is not None  # stopped: a stop was chosen
        p.checkpoints.commit(last=p.stop.target)
        release_store(p.store_spec, self.output)
        return p.stop.target

    def last_committed(self) -> int | None:
        """The newest checkpoint this job committed (or resumed from): where a resume starts."""
        known = set(self.parts.checkpoints.committed)
        if self.resume_from is not None:
            known.add(self.resume_from)
        return max(known, default=None)

    # -- the end --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker (Ctrl-C or a coordinator error): nothing is left running, and
        nothing for a restarted coordinator to take over."""
        p = self.parts
        forget_job(self.output)
        p.supervisor.shutdown()
        try:
            end_agents(p.supervisor.machines, p.local_agent)
        except RuntimeError:  # the store is gone: the local agent is stopped here
            p.local_agent.abandon()

    def save_record(self, how: str, reached_step: int) -> None:
        """This part ended without finishing (``how``: see RunPart) after ``reached_step``
        steps: its record, which a ``--resume`` continues, in the output directory."""
        record = self.metrics.record(reached_step=reached_step, how=how)
        try:
            write_json_atomic(self.output / RECORD_NAME, record)
        except OSError as exc:  # a full disk must not hide why the part ended
            print(
                f"spotline: warning: the run's record was not saved ({exc}); a --resume "
                "goes on from its checkpoint's record",
                file=sys.stderr,
                flush=True,
            )

    def finished(self) -> None:
        """The run finished (its summary written): the parts' record is in it now."""
        (self.output / RECORD_NAME).unlink(missing_ok=True)

    def log_to_wandb(self, summary: dict[str, Any]) -> None:
        """Per-step losses and the recovery events, to wandb (offline unless configured)."""
        self.metrics.log_to_wandb(summary, self.output)

    def log_stopped_to_wandb(self, step: int) -> None:
        """What a stopped run committed before ``step`` (its checkpoint), to wandb."""
        self.metrics.log_stopped_to_wandb(step, self.output)
