"""Process supervision: the worker processes the coordinator started, and what became of them.

A worker is started with :meth:`Supervisor.spawn` (``python -m`` the worker's module,
:data:`~spotline.launch.control.entry_points.WORKER_MODULE`) by the agent of a machine that
joined (:mod:`spotline.launch.agent`, ordered through
:class:`~spotline.launch.control.machines.Machines`; ``spotline train`` runs one local
agent), in its own session so that a Ctrl-C at the terminal reaches the coordinator only,
polled for exit (:meth:`Supervisor.poll`), watched by heartbeat
(:meth:`Supervisor.check_heartbeats`, deciding by :func:`missed_heartbeats`),
signalled (:meth:`Supervisor.preempt`: a kill or a SIGTERM notice) and stopped
(:meth:`Supervisor.shutdown`, :meth:`Supervisor.wait_all`). A worker that exits with an
error it told the store (``error/<w>``) stops the job (:class:`JobError`): an error is not a
preemption, and redoing the work would only repeat it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from spotline.launch.control.entry_points import WORKER_MODULE
from spotline.launch.control.liveness_probe import LivenessProbe
from spotline.launch.control.machines import AgentProcess, Machines
from spotline.launch.control.metrics import RunMetrics
from spotline.run_dir import LOGS_DIR
from spotline.wire.auth import AuthStore
from spotline.wire.protocol import error_key, heartbeat_key, joined_key

Fate = Literal["running", "killed", "terminated", "left", "exited", "crashed", "restarted"]
SHUTDOWN_WAIT_S = 30
# A worker's missed heartbeat is its own hang only while its agent still beats (every 0.1 s):
# an agent quiet this long means the whole machine is going, which lost_machines() decides.
AGENT_QUIET_S = 1.0
# An agent quiet this long (three missed beats) has its liveness port probed: a refused
# connect proves it dead, and its machine is lost at once (see control/liveness_probe.py).
PROBE_QUIET_S = 0.3
SIGNALLED = (0, -signal.SIGKILL, -signal.SIGTERM)  # exit codes that are no worker error


class JobError(RuntimeError):
    """The job cannot go on (a worker's error, a checkpoint that could not be written)."""


@dataclass
class WorkerProc:
    wid: str
    proc: AgentProcess
    started: float
    alive: bool = True
    fate: Fate = "running"
    # Started ahead of a trace arrival (recovery.warm_workers): not a node of the trace until
    # an arrival takes it, so it is neither counted, preempted nor planned before then.
    warm: bool = False


class Supervisor:
    """The worker processes of one job (ids ``w0``, ``w1``, ... in start order)."""

    def __init__(
        self,
        store: AuthStore,
        metrics: RunMetrics,
        *,
        config_path: Path,
        output: Path,
        store_arg: str,
        env: dict[str, str],
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.config_path = config_path
        self.output = output
        self.store_arg = store_arg
        self.env = env
        self.workers: dict[str, WorkerProc] = {}
        self.next_index = 0  # also the number of workers ever started
        self.machines = Machines(store, on_refused)
        # Per machine: its agent's last heartbeat value, and when this process saw it change.
        self._agent_seen: dict[str, tuple[float | None, float]] = {}
        self.liveness = LivenessProbe()

    def spawn(self, *, warm: bool = False, machine: str | None = None) -> str:
        """Start a worker process (on ``machine``, or where :meth:`_place` puts it); returns
        its id."""
        wid = f"w{self.next_index}"
        self.next_index += 1
        logs = self.output / LOGS_DIR
        logs.mkdir(parents=True, exist_ok=True)
        argv = [
            "--config",
            str(self.config_path),
            "--output",
            str(self.output),
            "--worker-id",
            wid,
            "--store",
            self.store_arg,
        ]
        proc = self.machines.start(machine or self._place(), wid, WORKER_MODULE, argv)
        self.workers[wid] = WorkerProc(wid, proc, self.metrics.now(), warm=warm)
        return wid

    def _place(self) -> str:
        """The machine a new worker starts on: the one with the most free slots. With every
        slot taken, the one with the most slots takes one more (one machine's
        ``spotline train`` starts warm and arriving workers beyond ``--workers``)."""
        self.machines.refresh()
        free = self.free_slots()
        assert free, "a worker is started only once a machine has joined"
        info = self.machines.joined
        return max(free, key=lambda m: (free[m], info[m].slots))

    def adopt(self) -> None:
        """A restarted coordinator takes over its predecessor's workers: every worker
        ordered on a machine, alive unless its agent reported its exit or its machine was
        fenced (those are past: no event, no preemption counted again)."""
        self.machines.adopt()
        for machine in self.machines.joined:
            for wid in self.machines.started_workers(machine):
                proc = AgentProcess(wid, machine, self.machines)
                gone = proc.poll() is not None or machine in self.machines.lost
                self.workers[wid] = WorkerProc(
                    wid,
                    proc,
                    self.metrics.now(),
                    alive=not gone,
                    fate="exited" if gone else "running",
                )
                self.next_index = max(self.next_index, int(wid.lstrip("w")) + 1)

    def free_slots(self) -> dict[str, int]:
        """Per placeable machine (joined, not lost, not leaving): its slots less its live
        workers (negative where ``spotline train`` runs more workers than slots)."""
        free = {m: self.machines.joined[m].slots for m in self.machines.placeable()}
        for p in self.workers.values():
            if p.alive and p.proc.machine in free:
                free[p.proc.machine] -= 1
        return free

    def machine_of(self, wid: str) -> str:
        """The machine worker ``wid`` runs on (the planner's placement keeps a stage and its
        replica on different machines)."""
        return self.workers[wid].proc.machine

    def __getitem__(self, wid: str) -> WorkerProc:
        return self.workers[wid]

    def __contains__(self, wid: object) -> bool:
        return wid in self.workers

    def live_ids(self) -> list[str]:
        """Live workers that are nodes of the run (warm workers not yet arrived excluded)."""
        return [w for w, p in self.workers.items() if p.alive and not p.warm]

    def warm_ids(self) -> list[str]:
        """Live workers started ahead of an arrival that no arrival has taken yet."""
        return [w for w, p in self.workers.items() if p.alive and p.warm]

    def crashed_ids(self) -> list[str]:
        return sorted(w for w, p in self.workers.items() if p.fate == "crashed")

    def has_joined(self, wid: str) -> bool:
        """Whether a worker finished starting up (imports, data) and can be planned."""
        return self.store.check([joined_key(wid)])

    def preempt(self, wid: str, how: str) -> None:
        """Deliver a preemption: ``kill`` (SIGKILL) or a notice (SIGTERM)."""
        proc = self.workers[wid]
        if not proc.alive:
            return
        self.metrics.note_preemption()
        if how == "kill":
            proc.proc.send_signal(signal.SIGKILL)
            proc.fate = "killed"
        else:
            proc.proc.send_signal(signal.SIGTERM)
            proc.fate = "terminated"
        self.metrics.event("preempted", worker=wid, signal=how)

    def kill(self, wid: str, fate: Fate) -> None:
        """SIGKILL a worker that is hung or replaced (no preemption counted)."""
        self.workers[wid].proc.send_signal(signal.SIGKILL)
        self.workers[wid].fate = fate

    def lost_machines(self, limit_s: float) -> dict[str, str]:
        """Machines with live workers, or that workers may be started on, whose agent's
        heartbeat has not changed for ``limit_s`` seconds of this process's clock (the
        agents' clocks are never compared with it: silently cut off), or whose agent is
        proven dead sooner (quiet, and its liveness port refused: killed outright). Returns
        each with the evidence, ``"silent"`` or ``"refused"``."""
        now = time.monotonic()
        lost: dict[str, str] = {}
        # Those with workers, and those a worker may be started on (an idle machine whose
        # agent died must not be given one).
        watched = {p.proc.machine for p in self.workers.values() if p.alive}
        watched |= set(self.machines.placeable())
        refused = self.liveness.refused()
        for m in sorted(watched):
            beat = self.machines.last_heartbeat(m)
            seen = self._agent_seen.get(m)
            if seen is None or seen[0] != beat:
                self._agent_seen[m] = (beat, now)
            elif m in refused:
                lost[m] = "refused"
            elif now - seen[1] > limit_s:
                lost[m] = "silent"
            elif now - seen[1] > PROBE_QUIET_S:
                info = self.machines.joined[m]
                self.liveness.probe(m, info.address, info.probe_port)
        return lost

    def silent_s(self, machine: str) -> float:
        """How long this process has seen no new heartbeat from ``machine``'s agent."""
        seen = self._agent_seen.get(machine)
        return 0.0 if seen is None else time.monotonic() - seen[1]

    def poll(self, machine_timeout_s: float | None = None) -> list[str]:
        """The workers that exited since the last poll, and those of a machine lost (its
        agent silent for ``machine_timeout_s``). JobError if one exited with an error it
        reported."""
        died = []
        lost = self.lost_machines(machine_timeout_s) if machine_timeout_s else {}
        for m, evidence in lost.items():
            self.machines.fence(m)
            self.metrics.event("machine-lost", machine=m, evidence=evidence)
            for w, p in self.workers.items():
                if p.alive and p.proc.machine == m:
                    p.alive = False
                    if p.fate == "running":
                        self.metrics.note_preemption()
                        self.metrics.event("preempted", worker=w, signal="machine")
                    p.fate = "killed"
                    died.append(w)
        for w, p in self.workers.items():
            if p.alive and p.proc.poll() is not None:
                p.alive = False
                code = p.proc.returncode
                if p.fate == "running" and code in (-signal.SIGKILL, -signal.SIGTERM):
                    # Killed by an --inject fault the worker delivered to itself.
                    self.metrics.note_preemption()
                    p.fate = "killed"
                    self.metrics.event("preempted", worker=w, signal="kill")
                elif p.fate == "running":
                    p.fate = "exited" if code == 0 else "crashed"
                if code not in SIGNALLED and self.store.check([error_key(w)]):
                    # An error, not a lost process: redoing the work would only repeat it.
                    raise JobError(self.store.get(error_key(w)).decode())
                died.append(w)
                if code not in SIGNALLED:
                    self.metrics.event("worker-exit", worker=w, code=code)
        return died

    def check_heartbeats(self, limit_s: float) -> None:
        """SIGKILL a live worker whose last heartbeat is older than ``limit_s`` (hung)."""
        beats: dict[str, float | None] = {}
        for w in self.live_ids():
            if self.workers[w].fate == "killed":
                continue  # killed already: its agent reports the exit
            if self.silent_s(self.workers[w].proc.machine) > AGENT_QUIET_S:
                continue  # its whole machine is going quiet: lost_machines() decides
            beat = self.store.read(heartbeat_key(w))
            beats[w] = None if beat is None else float(beat.decode())
        for w, silent_s in missed_heartbeats(beats, time.time(), limit_s).items():
            self.metrics.event("heartbeat-missed", worker=w, silent_s=round(silent_s, 1))
            self.kill(w, "killed")

    def wait_all(self, timeout_s: float) -> None:
        """Wait for every worker to exit; one still running after ``timeout_s`` is killed."""
        for p in self.workers.values():
            if not p.alive and p.proc.returncode is None:
                continue  # its machine was lost: no agent will tell how it ended
            try:
                p.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                try:
                    p.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass  # its agent is gone too; it stops its workers on its own

    def shutdown(self) -> None:
        """Stop every worker (Ctrl-C or a coordinator error): nothing is left running (a
        worker whose agent does not answer is that agent's to stop: it stops its workers
        when it loses the store)."""
        # A worker of a machine lost (or fenced) is skipped: no agent will ever tell how it
        # ended, and waiting SHUTDOWN_WAIT_S for each of them held a cluster's coordinator
        # for minutes after a run had lost its machines.
        running = [
            p
            for p in self.workers.values()
            if p.proc.poll() is None and p.proc.machine not in self.machines.lost
        ]
        for p in running:
            p.proc.send_signal(signal.SIGKILL)
        for p in running:
            try:
                p.proc.wait(timeout=SHUTDOWN_WAIT_S)
            except subprocess.TimeoutExpired:
                pass


def missed_heartbeats(
    beats: Mapping[str, float | None], now: float, limit_s: float
) -> dict[str, float]:
    """The workers whose last heartbeat (``beats``: Unix time; None: none written yet, a
    worker still starting) is more than ``limit_s`` old at ``now`` (the coordinator's
    Unix time), each with how long it has been silent, in ``beats``' order."""
    return {w: now - last for w, last in beats.items() if last is not None and now - last > limit_s}


def child_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    # torch's C++ warnings come with a C++ stack: a store or gloo peer that goes away (the
    # failures Spotline survives, or a lost coordinator, which the worker reports in one
    # line) filled the worker logs with them. Set it to WARNING to see them again.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env
