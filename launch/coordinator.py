"""The coordinator: the on-demand process that owns membership and never trains.

It hosts the job's store (``spotline.stores``: torch's TCPStore, or an etcd key directory),
starts the worker processes and, generation after generation, publishes a plan computed by
``spotline.plan.layout`` from what the live workers report they hold. Workers keep their
state in memory across generations; only a fatal loss (a stage held by no live worker) reads
the last checkpoint. What the coordinator and the workers say to each other, and under which
store keys, is :mod:`spotline.protocol`.

:class:`Coordinator` is the conductor: it owns the generation loop (wait for the members'
reports while delivering faults, admitting arrivals and committing checkpoints; then plan
the next generation) and the stop a Ctrl-C asks for. The work is done by its parts, each in
``spotline.launch.control``: the worker processes (:mod:`~spotline.launch.control.supervisor`),
the faults delivered to them (:mod:`~spotline.launch.control.faults`), the plans and the
recovery policy (:mod:`~spotline.launch.control.recovery`), checkpoint commits
(:mod:`~spotline.launch.control.checkpoints`) and the run's metrics and summary
(:mod:`~spotline.launch.control.metrics`).

It never trains, and never loads what training needs: no DeepSpeed, no transformers, not
the tensor half of the checkpoints (it reads and commits manifests through
:mod:`spotline.checkpoint_manifest`); torch only for the store.

A worker that exits with an error, or reports one, is not a preemption: the job stops and
says why (``JobError``). A first Ctrl-C (``request_stop``) stops the job at the next step
boundary that has a checkpoint (``Stopped``); the second one is the caller's to handle.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from spotline.auth import AuthStore, job_token
from spotline.checkpoint_manifest import read_metadata
from spotline.config import RunConfig
from spotline.launch.control.checkpoints import EVALUATIONS, RECORD, CheckpointCommits
from spotline.launch.control.faults import FaultDelivery
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.recovery import POLICIES, POLL_S, Planner
from spotline.launch.control.supervisor import JobError, Supervisor, child_environment
from spotline.plan.layout import Layout, WorkerReport, initial_layout
from spotline.protocol import (
    JOB_END_KEY,
    EvalResult,
    Plan,
    Report,
    abort_entries,
    entry_key,
    eval_key,
    leaving_key,
    loss_key,
    lr_key,
    plan_key,
    progress_key,
    report_key,
    stop_checkpoint_key,
    stop_key,
)
from spotline.run_dir import ETCD_JOB_NAME, LOGS_DIR, RECORD_NAME, TOKEN_NAME
from spotline.tracking import write_json_atomic

# How often the watch reads the workers' heartbeats (a tenth of the timeout when shorter).
HEARTBEAT_CHECK_S = 0.25
# The longest pause between two turns of a generation's watch while nothing happens.
IDLE_POLL_S = 0.1
# The longest a quiet watch turn (Coordinator._quiet) defers a full one.
FULL_TURN_S = 0.5


class KeyCount(Protocol):
    def num_keys(self) -> int: ...


class QuietTurns:
    """Which watch turns may be quiet: those that find the store's key count as the last
    full turn left it, within FULL_TURN_S of that turn."""

    def __init__(self, store: KeyCount, full_turn_s: float = FULL_TURN_S) -> None:
        self.store = store
        self.full_turn_s = full_turn_s
        self._count = -1  # the key count the last full turn started from
        self._full_t = -float("inf")

    def quiet(self, now: float) -> bool:
        count = self.store.num_keys()
        if count == self._count and now - self._full_t < self.full_turn_s:
            return True
        # Counted before the full turn's reads: a key added during them is seen next turn.
        self._count, self._full_t = count, now
        return False


if TYPE_CHECKING:
    from spotline.stores import StoreSpec

__all__ = [
    "Coordinator",
    "JobError",
    "Stopped",
    "child_environment",
    "no_progress_message",
    "no_workers_message",
]


# The local agent outlives a lost coordinator by this much: its workers find out first
# and say so in their own line (spotline.elastic), then the agent stops what is left.
LOCAL_AGENT_LOST_AFTER_S = 10.0
AGENT_JOIN_WAIT_S = 120.0
AGENT_EXIT_WAIT_S = 30.0


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
        a new one written there)."""
        self.cfg = cfg
        self.sl = cfg.spotline
        self.output = output
        t0 = time.monotonic()
        # The only reason this process holds torch: the job store is torch.distributed's (a
        # TCPStore server; the etcd store subclasses dist.Store). Nothing else the
        # coordinator runs imports torch, DeepSpeed or transformers (summary.json's
        # "coordinator_heavy_modules" lists what it loaded; a slow test checks it).
        from spotline.stores import host_store

        rec = self.sl.recovery
        # A coordinator restarted with the same --output over etcd takes its predecessor's
        # job over (the store outlived it; the workers trained on meanwhile).
        previous = read_job_file(output) if listen is not None and rec.store == "etcd" else None
        self.token = job_token(output, token_file)
        self.token_path = Path(token_file) if token_file else output / TOKEN_NAME
        raw_store, self.store_spec = host_store(
            rec.store,
            etcd_endpoint=rec.etcd_endpoint,
            timeout=timedelta(seconds=60),
            listen=listen or ("127.0.0.1", 0),
            etcd_prefix=previous.prefix if previous is not None else None,
        )
        if self.store_spec.backend == "etcd":
            write_job_file(output, self.store_spec)
        # Every value read is checked against the job token: one written without it is as
        # if never written (and told once, as a "forged" event).
        self.forged: set[str] = set()
        self.store = AuthStore(raw_store, self.token, on_forged=self._forged)
        self.cluster = listen is not None
        self.generation = 0
        # When the last generation's first member reported (the clock of a change without
        # a failure starts there).
        self.generation_end_t: float | None = None
        # The run's clock starts before the store is up (an etcd connection takes a moment).
        self.metrics = RunMetrics(cfg, self.store, snapshot=self._snapshot, t0=t0)
        self.supervisor = Supervisor(
            self.store,
            self.metrics,
            config_path=config_path,
            output=output,
            store_arg=self.store_spec.to_arg(),
            env=env,
            on_refused=self._refused,
        )
        self.faults = FaultDelivery(cfg, self.store, self.supervisor, self.metrics, self)
        self.policy = POLICIES[rec.mode]
        self.checkpoints = CheckpointCommits(
            cfg,
            self.store,
            self.metrics,
            output,
            interval_steps=self.policy.checkpoint_interval(cfg, self.faults.mtbf_s()),
        )
        self.planner = Planner(
            cfg,
            self.store,
            self.supervisor,
            self.metrics,
            self.checkpoints,
            self,
            cluster=self.cluster,
        )
        self.boundary_for_joiners: set[str] = set()
        # The generation whose wait for machines was said (one line a wait, on a cluster).
        self.said_waiting_at: int | None = None
        self.local_agent: subprocess.Popen[bytes] | None = None
        self.last_commit_check = 0.0
        self.last_heartbeat_check = 0.0
        # The members' progress as read once at the start of a watch turn (None: between
        # turns, where every max_progress() reads the store).
        self._turn_progress: int | None = None
        self._last_turn_progress = -1
        self._quiet_turns = QuietTurns(self.store)
        self.failures_without_loss = 0
        # --resume: the stopped run's committed checkpoint the first generation restores.
        self.resume_from = resume_from
        self.stop_requested = False
        self.stop_target: int | None = None
        self.stop_applied: set[int] = set()  # generations told about the stop
        if resume_from is not None:
            metadata = read_metadata(cfg.checkpoint_root(output), resume_from)
            for step, loss in metadata.get("losses", {}).items():
                self.metrics.losses[int(step)] = loss
            for step, lr in metadata.get("learning_rates", {}).items():
                self.metrics.learning_rates[int(step)] = lr
            for raw in metadata.get(EVALUATIONS, {}).values():
                # The stopped run's evaluations: in the summary, and in the store, where rank
                # 0 reads the earlier ones to tell whether a new one is the best.
                result = EvalResult.from_json(raw)
                self.metrics.evaluations[result.step] = result
                self.store.set(eval_key(result.step), result.encode())
            self.metrics.part_from = resume_from  # also for a checkpoint without a record
            record = earlier_record(output, metadata.get(RECORD))
            if record is not None:
                self.metrics.continue_record(record, resume_step=resume_from)
        # No-progress watch (recovery.no_progress_timeout_s): the last progress seen, when a
        # step last committed, and the preemption and start counts at that moment.
        self.stall_progress = 0
        self.stall_since = time.monotonic()
        self.stall_marks = (0, 0)

    # -- the job token ------------------------------------------------------------------
    def _forged(self, key: str) -> None:
        if key not in self.forged:
            self.forged.add(key)
            self.metrics.event("forged", key=key)

    def _refused(self, what: str) -> None:
        self.metrics.event("refused", what=what)
        print(f"spotline: refused {what}", file=sys.stderr, flush=True)

    # -- what the parts read ------------------------------------------------------------
    @property
    def layout(self) -> Layout | None:
        return self.planner.layout

    def members(self) -> list[str]:
        return self.planner.members()

    def max_progress(self) -> int:
        """The highest step a member of the current generation has started.

        Within one turn of :meth:`_watch_workers` the value read at its start: a turn asks
        for it five times, and each read is two store round trips a worker, 50 times a
        second (on a small host the coordinator's polling took CPU from the workers)."""
        if self._turn_progress is not None:
            return self._turn_progress
        return self._read_progress()

    def _read_progress(self) -> int:
        best = self.planner.resume_step
        for w in self.supervisor.live_ids():
            value = self.store.read(progress_key(self.generation, w))
            if value is not None:
                best = max(best, int(value.decode()))
                if self.metrics.first_step_t is None:
                    self.metrics.first_step_t = time.monotonic()
        return best

    def _placement(self) -> dict[str, str]:
        """What each live worker does now, for the timeline ("p0:s1", "standby", "joining")."""
        placement = {}
        layout = self.layout
        if layout is not None:
            for w in self.supervisor.live_ids():
                placement[w] = (
                    layout.describe(w) if w in layout.members or w in layout.standby else "joining"
                )
        return placement

    def _snapshot(self) -> tuple[int, int, dict[str, str]]:
        return self.max_progress(), len(self.supervisor.live_ids()), self._placement()

    # -- arrivals -----------------------------------------------------------------------
    def joined_waiting(self) -> list[str]:
        """Live workers that finished starting up and are not in any plan yet."""
        return [
            w
            for w in self.supervisor.live_ids()
            if w not in self.planner.included and self.supervisor.has_joined(w)
        ]

    def _admit_joiners(self) -> None:
        """A started worker that has joined: members stop at the next boundary to let it in."""
        for wid in self.joined_waiting():
            if wid not in self.boundary_for_joiners:
                self.boundary_for_joiners.add(wid)
                self.metrics.event("joined", worker=wid)
                # A step boundary a little ahead, so that every member sees it in time.
                self.request_boundary()

    def _use_new_machines(self) -> None:
        """A cluster's free slots get workers: a machine that joined mid-run (its workers
        join at the next step boundary, as the planner decides: standby or new pipelines,
        their state sent from live machines), or a slot whose worker was lost while its
        machine lives on. ``spotline train``'s one machine runs the workers its faults
        start."""
        if not self.cluster:
            return
        for info in self.supervisor.machines.refresh():
            self.metrics.event("machine-joined", machine=info.name, slots=info.slots)
        for machine, free in self.supervisor.free_slots().items():
            for _ in range(free):
                wid = self.supervisor.spawn(machine=machine)
                self.metrics.event("arrived", worker=wid, machine=machine)

    def request_boundary(self, at_step: int | None = None) -> None:
        """Ask the members to stop at a step boundary (``at_step``, or a little ahead so that
        every member sees it in time)."""
        key = stop_key(self.generation)
        if not self.store.check([key]):
            ahead = self.max_progress() + 2
            self.store.set(key, str(ahead if at_step is None else max(at_step, ahead)))

    def wait_for_joiners(self) -> list[str]:
        """Block until a started worker has joined (trace arrivals, replacements)."""
        while True:
            self._check_stalled()
            self.metrics.record_throughput()
            self._use_new_machines()
            self.poll_workers()
            self.faults.deliver()
            joiners = self.joined_waiting()
            if joiners:
                return joiners
            starting = [w for w in self.supervisor.live_ids() if not self.supervisor.has_joined(w)]
            if not starting:
                self.faults.skip_idle_time()
            if not starting and not self.faults.more_to_come():
                if self.cluster:
                    # A cluster's machines join when their cloud brings them (a preempted
                    # spot machine's replacement boots minutes later): wait, bounded by
                    # _check_stalled's no_progress_timeout_s.
                    self._say_waiting_for_machines()
                    time.sleep(POLL_S)
                    continue
                raise RuntimeError(
                    no_workers_message(
                        len(self.supervisor.live_ids()),
                        crashed=self.supervisor.crashed_ids(),
                        trace=self.faults.replay is not None,
                        random_preemptions=self.sl.recovery.preempt_rate > 0,
                        num_stages=self.cfg.num_stages,
                        stages_per_worker=self.sl.redundancy.stages_per_worker,
                    )
                )
            time.sleep(POLL_S)

    def _say_waiting_for_machines(self) -> None:
        """One line, once per wait, that a cluster's job waits for machines to join."""
        if self.said_waiting_at == self.generation:
            return
        self.said_waiting_at = self.generation
        limit = self.sl.recovery.no_progress_timeout_s
        bound = f"; it stops after {limit:g} s without a committed step" if limit > 0 else ""
        print(
            f"spotline: {len(self.supervisor.live_ids())} live worker(s), too few to train: "
            f"waiting for machines to join (`spotline agent --join {self._join_arg()} "
            f"--token-file {self.token_path}`){bound}",
            file=sys.stderr,
            flush=True,
        )

    def _check_stalled(self) -> None:
        """Stop a run that cannot progress: no step committed for no_progress_timeout_s while
        workers were preempted (on the wall clock, faster than they start and join)."""
        limit = self.sl.recovery.no_progress_timeout_s
        progress = self.max_progress()
        now = time.monotonic()
        preemptions, started_total = self.metrics.preemptions, self.supervisor.next_index
        if progress > self.stall_progress:
            # Starting a step means the one before it committed (a redone one too).
            self.stall_since, self.stall_marks = now, (preemptions, started_total)
        self.stall_progress = progress  # after a fallback progress goes back: from there
        preempted = preemptions - self.stall_marks[0]
        if limit <= 0 or now - self.stall_since < limit or preempted == 0:
            return
        started = started_total - self.stall_marks[1]
        raise RuntimeError(
            no_progress_message(limit, preempted, started, clock=self.sl.recovery.trace_clock)
        )

    # -- the run ------------------------------------------------------------------------
    def _adoptable(self) -> bool:
        """Whether this store holds a job a predecessor started and did not end."""
        return self.store.check([plan_key(0)]) and not self.store.check([JOB_END_KEY])

    def _adopt(self) -> None:
        """Take the running job over from the store: the machines admitted, the workers
        started, the generation running and its plan, the losses so far. The generation loop
        then goes on from there: the workers never stopped."""
        store, planner = self.store, self.planner
        self.supervisor.adopt()
        g = 0
        while store.check([plan_key(g + 1)]):
            g += 1
        plan = Plan.decode(store.get(plan_key(g)))
        if plan.action == "finish":  # it died as the job ended: end it again
            g, plan = g - 1, Plan.decode(store.get(plan_key(g - 1)))
        self.generation = g
        planner.layout, planner.resume_step = plan.layout, plan.resume_step
        planner.included.update(w for w in self.supervisor.workers if store.check([entry_key(w)]))
        for step in range(1, self.sl.training.steps + 1):
            if store.check([loss_key(step)]):
                self.metrics.losses[step] = float(store.get(loss_key(step)).decode())
                self.metrics.learning_rates[step] = float(store.get(lr_key(step)).decode())
        self.metrics.collect_evaluations()
        self.metrics.event(
            "adopted",
            generation=g,
            step=self.max_progress(),
            workers=len(self.supervisor.live_ids()),
            machines=len(self.supervisor.machines.joined),
        )

    def run(self) -> dict[str, Any]:
        if self.cluster and self._adoptable():
            self._adopt()
            return self._run_generations(time.monotonic())
        S, P = self.cfg.num_stages, self.cfg.num_pipelines
        ids = []
        # Machines that joined a predecessor that never started training are kept.
        self.supervisor.machines.adopt()
        if self.cluster:
            self._wait_for_machines(slots=self.faults.initial_workers())
        else:
            self._start_local_agent()
        for _ in range(self.faults.initial_workers()):
            wid = self.supervisor.spawn()
            self.planner.include(wid, 0)
            ids.append(wid)
        self.faults.initial_ids = list(ids)
        self.faults.keep_warm()
        planner = self.planner
        planner.layout = initial_layout(
            S,
            P,
            ids,
            elastic=True,
            machines={w: self.supervisor.machine_of(w) for w in ids},
            capacity=self.cfg.capacity,
            sharded=planner.sharded,
        )
        if planner.layout is None:
            # Fewer starting workers than the model needs within redundancy.stages_per_worker
            # (a trace's first nodes): they stand by, and the next generation waits for more.
            planner.note_short(len(ids))
        if self.resume_from is None:
            planner.publish(0, planner.plan("train", planner.layout, 0, {}, []))
        else:
            # Every member reads every stage from the checkpoint: no transfers.
            step = self.resume_from
            planner.resume_step = step
            holders = {s: list(ids) for s in range(S)}
            planner.publish(
                0,
                planner.plan("restore", planner.layout, step, holders, [], checkpoint_step=step),
            )
        self.metrics.event("start", workers=len(ids), step=planner.resume_step)
        return self._run_generations(time.monotonic())

    def _run_generations(self, t_start: float) -> dict[str, Any]:
        """Generations until the job is done (or stopped); its summary."""
        while True:
            outcome = self._run_generation()
            if outcome in ("done", "stopped"):
                break
        if outcome == "stopped":
            self._stop_workers()
            raise Stopped(self.last_committed(), self.stop_target or self.max_progress())
        end = time.monotonic()
        self.metrics.show_progress(done=self.sl.training.steps)
        self.metrics.collect_evaluations()
        wall = end - t_start
        # Training time: from the first step to the last commit, recoveries included.
        train_wall_s = end - (self.metrics.first_step_t or t_start)
        self._finish_workers(timeout_s=30)
        train_wall_s = self.metrics.train_wall_s(fallback_s=train_wall_s)
        self.checkpoints.poll_errors()  # those of the last steps, told as the workers exited
        self.checkpoints.commit(last=self.sl.training.steps)
        self.metrics.write_timeline(self.output)
        summary = self.metrics.summary(
            wall=wall,
            train_wall_s=train_wall_s,
            layout=self.layout,
            generations=self.generation + 1,
            checkpoint_interval_steps=self.checkpoints.interval_steps,
            exposure_checkpoints=self.checkpoints.exposure_checkpoints(),
            resumed_from_step=self.resume_from,
        )
        self.release_store()
        return summary

    def _finish_workers(self, timeout_s: float) -> None:
        """Publish "finish" and wait for every worker to exit."""
        self.planner.publish(self.generation + 1, Plan.finish())
        for w in self.supervisor.live_ids() + self.supervisor.warm_ids():
            if w not in self.planner.included:
                # Started but never planned (warm, or arrived at the end): let it read "finish".
                self.store.set(entry_key(w), str(self.generation + 1))
        self.supervisor.wait_all(timeout_s)
        self._end_agents()

    def start_local_agent(self) -> None:
        """``spotline train``'s machine: one agent on this one, through the same code as a
        cluster's (``spotline agent``), with a slot for each starting worker. Started once;
        the CLI starts it early (while it checks the inputs), else :meth:`run` does."""
        if self.local_agent is not None:
            return
        from spotline.launch.agent import start_local_agent

        self.local_agent = start_local_agent(
            self.store_spec.to_arg(),
            slots=self.faults.initial_workers(),
            logs=self.output / LOGS_DIR,
            env=self.supervisor.env,
            lost_after_s=LOCAL_AGENT_LOST_AFTER_S,
            token_file=self.token_path,
        )

    def abandon(self) -> None:
        """The job does not start (its inputs were wrong, or a Ctrl-C came first): the local
        agent, which has started no worker, is stopped (its spawner exits on its own when
        the agent's pipe closes)."""
        if self.local_agent is not None:
            self.local_agent.kill()
            self.local_agent.wait()
            self.local_agent = None

    def admit_machines(self) -> None:
        """Answer the machines that registered (the local agent's head start registers while
        the CLI still checks the inputs, and waits for its answer only so long)."""
        self.supervisor.machines.refresh()

    def _start_local_agent(self) -> None:
        """The local agent started (if the CLI has not already) and joined: the run starts
        then."""
        from spotline.launch.agent import LOCAL_MACHINE

        self.start_local_agent()
        assert self.local_agent is not None
        deadline = time.monotonic() + AGENT_JOIN_WAIT_S
        machines = self.supervisor.machines
        while not (machines.refresh() or LOCAL_MACHINE in machines.joined):
            if self.local_agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the local agent did not join (exit {self.local_agent.poll()}); see "
                    f"{self.output}/logs/agent.log"
                )
            time.sleep(0.02)

    def _wait_for_machines(self, slots: int) -> None:
        """``spotline coordinator``: the run starts once the machines that joined have
        ``slots`` slots (the workers the run starts with)."""
        machines = self.supervisor.machines
        have = -1
        while have < slots:
            machines.refresh()
            joined = sum(m.slots for m in machines.joined.values())
            if joined != have:
                have = joined
                print(
                    f"spotline: {len(machines.joined)} machine(s) joined with {have} of the "
                    f"{slots} slots the run starts with; join more with `spotline agent "
                    f"--join {self._join_arg()} --slots K "
                    f"--token-file {self.token_path}` (a copy of that file on each machine)",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.05)

    def _join_arg(self) -> str:
        """What agents pass to ``--join``: the coordinator's address, or the etcd job."""
        spec = self.store_spec
        return f"{spec.host}:{spec.port}" if spec.backend == "tcp" else spec.to_arg()

    def _end_agents(self) -> None:
        """The job is over: every agent exits once its workers have."""
        unheard = self.supervisor.machines.end_job()
        if unheard:
            print(
                f"spotline: the agent(s) of {', '.join(unheard)} did not confirm the job's end; "
                "they will stop on their own once they find the coordinator gone",
                file=sys.stderr,
                flush=True,
            )
        if self.local_agent is not None:
            try:
                self.local_agent.wait(timeout=AGENT_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                self.local_agent.kill()
                self.local_agent.wait()
            self.local_agent = None

    def _stop_workers(self) -> None:
        """After a stop at a boundary: every worker exits, its checkpoint writes done; the
        stop's checkpoint is committed."""
        self._finish_workers(timeout_s=60)
        self.checkpoints.poll_errors()
        assert self.stop_target is not None  # stopped: a stop was chosen
        self.checkpoints.commit(last=self.stop_target)
        self.release_store()

    def last_committed(self) -> int | None:
        """The newest checkpoint this job committed (or resumed from): where a resume starts."""
        known = set(self.checkpoints.committed)
        if self.resume_from is not None:
            known.add(self.resume_from)
        return max(known, default=None)

    # -- stopping -----------------------------------------------------------------------
    def request_stop(self) -> None:
        """A first Ctrl-C (called from a signal handler: it only sets a flag)."""
        self.stop_requested = True

    def _apply_stop(self) -> None:
        """After a first Ctrl-C: choose where the job stops, the next step boundary that has
        a checkpoint (the interval's, or one written there), a little ahead so that every
        member sees it in time, and tell the current generation."""
        if not self.stop_requested or self.stop_target is not None:
            return
        ahead = self.max_progress() + 2
        interval = self.checkpoints.interval_steps
        target = -(-ahead // interval) * interval if interval > 0 else ahead
        self.stop_target = min(target, self.sl.training.steps)
        if self.stop_target < self.sl.training.steps:
            line = f"stopping at step {self.stop_target} after its checkpoint"
        else:
            line = f"the run ends at step {self.stop_target} before a checkpoint would: finishing"
        print(f"spotline: {line} (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        self.stop_keys(self.generation)

    def stop_keys(self, generation: int) -> None:
        """``stop-checkpoint/<g>`` and ``stop/<g>`` for the stop chosen by ``_apply_stop``
        (generations planned after it get them before their plan is published)."""
        if self.stop_target is None or generation in self.stop_applied:
            return
        self.stop_applied.add(generation)
        target = max(self.stop_target, self.planner.resume_step)
        if target >= self.sl.training.steps:
            return  # the run ends first: it finishes as usual
        # Always: an exposed plan's schedule (spotline.plan.exposure) may skip the interval's
        # steps, and a step written by both is committed once.
        self.checkpoints.extra.add(target)
        # Set before stop/<g>: a member that sees the stop must see where to checkpoint.
        self.store.set(stop_checkpoint_key(generation), str(target))
        key = stop_key(generation)
        if not self.store.check([key]) or int(self.store.get(key).decode()) > target:
            # An arrival's boundary that comes later moves to the stop (no member has
            # passed it: the target is ahead of every member).
            self.store.set(key, str(target))

    # -- one generation -----------------------------------------------------------------
    def _run_generation(self) -> str:
        g = self.generation
        included = self.planner.included
        expected = {w for w in self.supervisor.live_ids() if w in included}
        if not expected:
            # Everyone in the last plan is gone: wait for new workers, then restore.
            self.metrics.event("waiting-for-workers", live=0)
            joiners = self.wait_for_joiners()
            self.generation = g + 1
            self._plan_next(
                [WorkerReport(w, machine=self.supervisor.machine_of(w)) for w in joiners],
                failure=True,
                reached=self.max_progress() + 1,
            )
            return "continue"
        reports = self._collect_reports(g, expected)
        self._take_reports(reports)
        outcomes = {w: r.outcome for w, r in reports.items()}
        members = self.members()
        if members and all(outcomes.get(w) == "done" for w in members):
            return "done"
        if (
            self.stop_target is not None
            and members
            and all(outcomes.get(w) == "boundary" for w in members)
            and self.max_progress() >= self.stop_target
        ):
            return "stopped"
        # A generation ended early: failure, arrival or departure.
        # The step in flight when the generation ended (started, maybe not committed).
        reached = self.max_progress() + 1
        self.checkpoints.commit(last=self.max_progress() + 1)
        live_reports = [
            reports[w].planner_view(self.supervisor.machine_of(w))
            if w in reports
            else WorkerReport(w, machine=self.supervisor.machine_of(w))
            for w in self.supervisor.live_ids()
            if self.supervisor[w].fate == "running"
            and (w in included or w in self.joined_waiting())
        ]
        failure = any(o == "failed" for o in outcomes.values())
        if failure:
            self._count_failure(reports)
        self.generation = g + 1
        self._plan_next(live_reports, failure=failure, reached=reached)
        return "continue"

    def _take_reports(self, reports: dict[str, Report]) -> None:
        """Record the generation's reports; stop the job on one that redoing cannot fix."""
        for report in reports.values():
            self.metrics.take_report(report)
        for w, report in reports.items():
            worker = self.supervisor[w]
            if report.outcome == "leaving" and worker.fate in ("running", "exited"):
                # A notice that came while the generation failed: the worker reported and
                # exited before its heartbeat wrote leaving/<w>, so the watch never saw it
                # leave (found as a departure missing from the events and the count).
                self.metrics.preemptions += 1
                worker.fate = "left"
                self.metrics.event("leaving", worker=w)
        failed = sorted(
            f"worker {w}: {r.error}" for w, r in reports.items() if r.outcome == "error"
        )
        if failed:
            # Not a lost process: a full disk, an export error, a bug. Redoing the work
            # would repeat it; stop with the cause.
            raise JobError(failed[0])
        self.checkpoints.poll_errors()
        errors = sorted({str(r.error) for r in reports.values() if r.outcome == "non-finite"})
        if errors:
            # Not a failure to recover from: the same step would give the same gradients.
            raise RuntimeError(
                f"{errors[0]}; the step was not applied. Lower the learning rate, enable "
                "gradient_clipping or check the data"
            )

    def _count_failure(self, reports: dict[str, Report]) -> None:
        """A generation failed: a second failure with no process lost (since the last one that
        lost one) stops the job."""
        if self.metrics.pending_failure_t is not None:
            self.failures_without_loss = 0
            return
        # Every member failed but no process was lost: an error in the training itself
        # (a model or optimizer error), which redoing the step would only repeat.
        self.failures_without_loss += 1
        if self.failures_without_loss >= 2:
            error = next((r.error for r in reports.values() if r.error), "unknown")
            raise RuntimeError(f"training failed twice with no process lost: {error}")

    def _collect_reports(self, g: int, expected: set[str]) -> dict[str, Report]:
        """Run generation ``g`` until every expected worker has reported or is gone: deliver
        faults, admit arrivals, apply a stop, commit checkpoints, show progress meanwhile."""
        first_report_t: float | None = None
        reports: dict[str, Report] = {}
        sup = self.supervisor
        pause = POLL_S
        while True:
            changed = self._watch_workers(g)
            # A quiet turn (None) saw no key added: no report either.
            if changed is not None and self._read_reports(g, expected, reports):
                # Only a member's report means the generation has ended: a standby reports
                # at once and must not start the clock on the members, who may rightly
                # train for hours.
                first_report_t = first_report_t or self.metrics.now()
            waiting_on = [w for w in expected if sup[w].alive and w not in reports]
            if not waiting_on and expected:
                break
            if (
                first_report_t is not None
                and waiting_on
                and self.metrics.now() - first_report_t > self.sl.recovery.collective_timeout_s + 5
            ):
                for w in waiting_on:  # hung: its peers reported long ago
                    if sup[w].fate != "killed":  # told once; its agent reports the exit
                        self.metrics.event("unresponsive", worker=w)
                        sup.kill(w, "killed")
            time.sleep(pause)
            # While nothing happens and nothing is due, the pause doubles up to
            # IDLE_POLL_S: a turn costs store round trips for every worker, CPU time the
            # workers of a small host lose. A lost worker's peers fail their collectives
            # and abort on their own; an exit or a new step brings the pause back down.
            quiet = not changed and first_report_t is None and self.faults.quiet()
            pause = min(IDLE_POLL_S, 2 * pause) if quiet else POLL_S
        self.generation_end_t = first_report_t
        return reports

    def _watch_workers(self, g: int) -> bool | None:
        """One turn of generation ``g``'s watch: exits, heartbeats, the stall limit, faults,
        arrivals, a stop, checkpoint errors and commits, progress, departures. Whether a
        worker exited or a new step started since the last turn; None for a quiet turn
        (:meth:`_quiet`), which only checks the heartbeats."""
        sup = self.supervisor
        if self.local_agent is not None and self.local_agent.poll() is not None:
            raise JobError(
                f"the local agent exited ({self.local_agent.returncode}); see "
                f"{self.output}/logs/agent.log"
            )
        if self._quiet():
            self._check_heartbeats()
            return None
        self._use_new_machines()
        died = self.poll_workers()
        self._turn_progress = None
        progress = self._turn_progress = self._read_progress()
        try:
            self._watch_turn(sup)
        finally:
            self._turn_progress = None
        changed = bool(died) or progress != self._last_turn_progress
        self._last_turn_progress = progress
        return changed

    def _quiet(self) -> bool:
        """Whether this turn may skip everything but the heartbeats: no key was added to
        the store since the last full turn (every event a turn looks for adds one: an exit,
        a report, an abort, a departure, an arrival, a machine, a loss, an evaluation, a
        checkpoint error), the last full turn is under FULL_TURN_S old (progress, stalls
        and commits are read from overwritten keys), and nothing is due from this side (an
        injected fault, a stop). One round trip instead of some 25: during steady training
        most turns are quiet, and the workers of a small host get the CPU back."""
        if not self.faults.quiet() or self.stop_requested:
            return False
        return self._quiet_turns.quiet(time.monotonic())

    def _check_heartbeats(self) -> None:
        limit_s = self.sl.recovery.heartbeat_timeout_s
        if time.monotonic() - self.last_heartbeat_check >= min(HEARTBEAT_CHECK_S, limit_s / 10):
            # A heartbeat is seconds old before it counts as missed: a few checks a second
            # see it in time, at a tenth of the store traffic of one every turn.
            self.last_heartbeat_check = time.monotonic()
            self.supervisor.check_heartbeats(limit_s)

    def _watch_turn(self, sup: Supervisor) -> None:
        """The rest of a watch turn, with the members' progress read once."""
        self._check_heartbeats()
        self._check_stalled()
        self.faults.deliver()
        self._admit_joiners()
        self._apply_stop()
        self.checkpoints.poll_errors()
        # A step's loss line before its evaluation's: rank 0 writes the loss first.
        self.metrics.show_progress(done=self.max_progress())
        self.metrics.collect_evaluations()
        self.metrics.record_throughput()
        if time.monotonic() - self.last_commit_check > 0.5:
            # Checkpoints are committed while a generation runs, not only when it ends.
            self.last_commit_check = time.monotonic()
            self.checkpoints.commit(last=self.max_progress() + 1)
        for w in sup.live_ids():
            if self.store.check([leaving_key(w)]) and sup[w].fate in ("running", "terminated"):
                if sup[w].fate == "running":
                    self.metrics.preemptions += 1  # a SIGTERM the worker delivered to itself
                sup[w].fate = "left"
                self.metrics.event("leaving", worker=w)
                self.request_boundary()

    def poll_workers(self) -> list[str]:
        """The workers that exited since the last call, and those of a machine lost (a
        cluster's machine is lost when its agent goes quiet; the one local machine's agent
        is this process's child, whose exit :meth:`_watch_workers` sees)."""
        sup = self.supervisor
        timeout_s = self.sl.recovery.heartbeat_timeout_s if self.cluster else None
        died = sup.poll(machine_timeout_s=timeout_s)
        for w in died:
            if sup[w].fate in ("killed", "crashed") and w in self.members():
                self.metrics.pending_failure_t = (
                    self.metrics.pending_failure_t or self.metrics.now()
                )
                # Members waiting in the commit barrier (or blocked on a machine gone
                # silent) leave it at once: their abort watches wait on these keys.
                for key, value in abort_entries(self.generation, self.members(), w):
                    self.store.set(key, value)
        return died

    def _read_reports(self, g: int, expected: set[str], reports: dict[str, Report]) -> bool:
        """Add generation ``g``'s new reports to ``reports``; whether a member's is among them."""
        member_reported = False
        for w in list(expected | set(self.supervisor.live_ids())):
            key = report_key(g, w)
            if w not in reports and self.store.check([key]):
                reports[w] = Report.decode(self.store.get(key))
                member_reported = member_reported or w in self.members()
        return member_reported

    def _plan_next(self, reports: list[WorkerReport], *, failure: bool, reached: int) -> None:
        """The next generation: awaited arrivals first, then the recovery policy (a failure)
        or a plan from what everyone holds (an arrival, a departure)."""
        awaited = self.faults.awaited_joiners
        # Injected arrivals are waited for (they were started ahead of their step).
        deadline = time.monotonic() + 180
        while awaited and time.monotonic() < deadline:
            self._check_stalled()
            self.poll_workers()
            ready = [
                w for w in awaited if self.supervisor.has_joined(w) or not self.supervisor[w].alive
            ]
            for w in ready:
                awaited.discard(w)
                if self.supervisor[w].alive and w not in {r.worker for r in reports}:
                    reports = [*reports, WorkerReport(w, machine=self.supervisor.machine_of(w))]
            if awaited:
                time.sleep(POLL_S)
        # A change without a failure is timed from here: everyone has stopped and every
        # awaited arrival has finished starting (its start-up is the cloud's boot time).
        ready_t = self.metrics.now()
        if failure:
            self.policy.recover(self.planner, reports, reached=reached, ready_t=ready_t)
        else:
            self.planner.replan(reports, failure=False, reached=reached, ready_t=ready_t)

    # -- the end ------------------------------------------------------------------------
    def release_store(self) -> None:
        """An etcd job's keys are deleted when it ends (a TCPStore goes with the process)."""
        if self.store_spec.backend == "etcd":
            from spotline.stores import delete_etcd_prefix

            delete_etcd_prefix(self.store_spec)
        (self.output / ETCD_JOB_NAME).unlink(missing_ok=True)  # nothing left to take over

    def shutdown(self) -> None:
        """Stop every worker (Ctrl-C or a coordinator error): nothing is left running, and
        nothing for a restarted coordinator to take over."""
        (self.output / ETCD_JOB_NAME).unlink(missing_ok=True)
        self.supervisor.shutdown()
        try:
            self._end_agents()
        except RuntimeError:  # the store is gone: the local agent is stopped below
            if self.local_agent is not None:
                self.local_agent.kill()
                self.local_agent.wait()
                self.local_agent = None

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


def write_job_file(output: Path, spec: StoreSpec) -> None:
    write_json_atomic(output / ETCD_JOB_NAME, {"store": spec.to_arg()})


def earlier_record(output: Path, committed: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The record a resume continues: the one the last part saved as it ended, or the one
    committed with the checkpoint (``committed``) where that one has more parts (the last
    part ended without saving one: a crash, a lost coordinator). None: neither (a run from
    before records were kept)."""
    path = output / RECORD_NAME
    saved: dict[str, Any] | None = json.loads(path.read_text()) if path.is_file() else None
    if committed is None or (saved is not None and len(saved["parts"]) >= len(committed["parts"])):
        return saved
    return dict(committed)


def read_job_file(output: Path) -> StoreSpec | None:
    """The etcd job a coordinator with this ``--output`` ran and did not end (None: none)."""
    from spotline.stores import parse_store_arg

    path = output / ETCD_JOB_NAME
    if not path.exists():
        return None
    spec = parse_store_arg(json.loads(path.read_text())["store"])
    return spec if spec.backend == "etcd" else None


def no_progress_message(limit_s: float, preempted: int, started: int, *, clock: str) -> str:
    """One line: the run stalls because preemptions outpace start-ups, and what to change."""
    advice = (
        "replay on the step clock (--trace-clock steps), lower --time-scale, or start more "
        "warm workers (--warm-workers)"
        if clock == "wall"
        else "lower --time-scale or --preempt-rate, or start more warm workers (--warm-workers)"
    )
    return (
        f"no step committed in {limit_s:g} s while {preempted} worker(s) were preempted and "
        f"{started} started: preemptions outpace start-ups, so the run would never progress; "
        f"{advice} (recovery.no_progress_timeout_s sets the limit)"
    )


def no_workers_message(
    live: int,
    *,
    crashed: list[str],
    trace: bool,
    random_preemptions: bool,
    num_stages: int = 1,
    stages_per_worker: int = 1,
) -> str:
    """Why a run that can no longer train stops: the real cause, not a guess at one."""
    head = f"{live} worker(s) left, too few to train, and"
    if 0 < live and live * stages_per_worker < num_stages:
        # Live workers that the memory limit alone keeps from training: say so, and how.
        head = (
            f"{live} worker(s) left, too few for {num_stages} stages at most "
            f"{stages_per_worker} a worker (spotline.redundancy.stages_per_worker: raise it "
            "where memory permits), and"
        )
    if crashed:
        return f"{head} {len(crashed)} worker(s) ({', '.join(crashed)}) exited with an error"
    if trace:
        return f"{head} none is scheduled to arrive (the trace has ended)"
    if random_preemptions:
        return f"{head} no replacement is scheduled (--preempt-rate's arrivals have ended)"
    return (
        f"{head} nothing in this run adds a worker (no --trace, --preempt-rate, "
        "--inject add:STEP or --rescale growth left); start more workers than you preempt"
    )
