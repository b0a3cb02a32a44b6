"""Admission: machines and workers that join a job, and the waits for them.

- At the start, ``spotline coordinator`` waits for machines with the slots the run starts
  with (:meth:`Admitter.wait_for_machines`; ``spotline train``'s one machine is its local
  agent, :mod:`~spotline.launch.control.local_agent`).
- While a generation trains, a cluster's free slots get workers
  (:meth:`Admitter.use_new_machines`: a machine that joined mid-run, or a slot whose worker
  was lost while its machine lives on), and a started worker that has joined (finished its
  start-up) is let in at the next step boundary (:meth:`Admitter.admit_joiners`).
- Between generations, the next plan waits for the arrivals that must not decide by their
  start-up at which step they train (:meth:`Admitter.await_arrivals`), and a job that can
  no longer train waits for a worker to join (:meth:`Admitter.wait_for_joiners`), or stops
  with why none can come (:func:`no_workers_message`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from spotline.config import RunConfig
from spotline.launch.control.faults import FaultDelivery
from spotline.launch.control.job_state import JobState, Progress
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.recovery import POLL_S
from spotline.launch.control.supervisor import Supervisor
from spotline.plan.layout import WorkerReport

# The longest the next plan waits for the arrivals it awaits.
AWAIT_ARRIVALS_S = 180.0
# How often the start's wait for machines looks for new ones.
MACHINES_POLL_S = 0.05


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


class Admitter:
    """The machines and workers that join one job (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        supervisor: Supervisor,
        metrics: RunMetrics,
        state: JobState,
        progress: Progress,
        faults: FaultDelivery,
        *,
        poll_workers: Callable[[], list[str]],
        check_stalled: Callable[[], None],
        cluster: bool,
        join_arg: str,
        token_path: Path,
    ) -> None:
        """``poll_workers``: handles the workers lost since the last call
        (:meth:`~.watch.Losses.poll`); ``check_stalled``: raises if the run cannot progress
        (:meth:`~.watch.StallWatch.check`); ``cluster``: machines join on their own
        (``spotline coordinator``); ``join_arg`` and ``token_path``: what an agent joins
        with, for the lines that say how."""
        self.cfg = cfg
        self.supervisor = supervisor
        self.metrics = metrics
        self.state = state
        self.progress = progress
        self.faults = faults
        self.poll_workers = poll_workers
        self.check_stalled = check_stalled
        self.cluster = cluster
        self.join_arg = join_arg
        self.token_path = token_path
        self.boundary_for: set[str] = set()  # joiners a step boundary was asked for
        # The generation whose wait for machines was said (one line a wait, on a cluster).
        self.said_waiting_at: int | None = None

    # -- while a generation trains ------------------------------------------------------
    def joined_waiting(self) -> list[str]:
        """Live workers that finished starting up and are not in any plan yet."""
        return [
            w
            for w in self.supervisor.live_ids()
            if w not in self.state.included and self.supervisor.has_joined(w)
        ]

    def admit_joiners(self) -> None:
        """A started worker that has joined: members stop at the next boundary to let it in."""
        for wid in self.joined_waiting():
            if wid not in self.boundary_for:
                self.boundary_for.add(wid)
                self.metrics.event("joined", worker=wid)
                # A step boundary a little ahead, so that every member sees it in time.
                self.progress.request_boundary()

    def use_new_machines(self) -> None:
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

    # -- between generations ------------------------------------------------------------
    def await_arrivals(self, reports: list[WorkerReport]) -> list[WorkerReport]:
        """Wait for the arrivals fault delivery awaits (started ahead of the step they
        train from); ``reports`` with those that joined."""
        awaited = self.faults.awaited_joiners
        sup = self.supervisor
        deadline = time.monotonic() + AWAIT_ARRIVALS_S
        while awaited and time.monotonic() < deadline:
            self.check_stalled()
            self.poll_workers()
            ready = [w for w in awaited if sup.has_joined(w) or not sup[w].alive]
            for w in ready:
                awaited.discard(w)
                if sup[w].alive and w not in {r.worker for r in reports}:
                    reports = [*reports, WorkerReport(w, machine=sup.machine_of(w))]
            if awaited:
                time.sleep(POLL_S)
        return reports

    def wait_for_joiners(self) -> list[str]:
        """Block until a started worker has joined (trace arrivals, replacements)."""
        sup = self.supervisor
        while True:
            self.check_stalled()
            self.metrics.record_throughput()
            self.use_new_machines()
            self.poll_workers()
            self.faults.deliver()
            joiners = self.joined_waiting()
            if joiners:
                return joiners
            starting = [w for w in sup.live_ids() if not sup.has_joined(w)]
            if not starting:
                self.faults.skip_idle_time()
            if not starting and not self.faults.more_to_come():
                if self.cluster:
                    # A cluster's machines join when their cloud brings them (a preempted
                    # spot machine's replacement boots minutes later): wait, bounded by
                    # the no-progress limit (check_stalled).
                    self._say_waiting_for_machines()
                    time.sleep(POLL_S)
                    continue
                raise RuntimeError(
                    no_workers_message(
                        len(sup.live_ids()),
                        crashed=sup.crashed_ids(),
                        trace=self.faults.replay is not None,
                        random_preemptions=self.cfg.spotline.recovery.preempt_rate > 0,
                        num_stages=self.cfg.num_stages,
                        stages_per_worker=self.cfg.spotline.redundancy.stages_per_worker,
                    )
                )
            time.sleep(POLL_S)

    def _say_waiting_for_machines(self) -> None:
        """One line, once per wait, that a cluster's job waits for machines to join."""
        if self.said_waiting_at == self.state.generation:
            return
        self.said_waiting_at = self.state.generation
        limit = self.cfg.spotline.recovery.no_progress_timeout_s
        bound = f"; it stops after {limit:g} s without a committed step" if limit > 0 else ""
        print(
            f"spotline: {len(self.supervisor.live_ids())} live worker(s), too few to train: "
            f"waiting for machines to join (`spotline agent --join {self.join_arg} "
            f"--token-file {self.token_path}`){bound}",
            file=sys.stderr,
            flush=True,
        )

    # -- the start ----------------------------------------------------------------------
    def wait_for_machines(self, slots: int) -> None:
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
                    f"--join {self.join_arg} --slots K "
                    f"--token-file {self.token_path}` (a copy of that file on each machine)",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(MACHINES_POLL_S)
