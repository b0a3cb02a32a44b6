"""The coordinator's side of the agents: the machines that joined, and their workers as
process handles.

:class:`Machines` admits the machines the agents registered (``machine/<n>``, sealed with the
job token; one that is not is refused, ``admit/<n>`` says why), tells whether an agent still
heartbeats, fences a machine declared lost (``fenced/<m>``) and sends orders
(:class:`~spotline.wire.protocol.Order`). A worker
started on a machine is an :class:`AgentProcess`: the part of ``subprocess.Popen``'s
interface the supervisor uses (``poll``, ``wait``, ``send_signal``, ``kill``), answered
through the store (its agent writes ``exit/<w>``), so the supervisor treats a worker on
another machine as it treats one it forked itself.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from spotline.launch.control.liveness_probe import Pokes
from spotline.wire.agent_messages import Admission, MachineInfo, Order, Signal
from spotline.wire.auth import AuthStore, is_sealed, unsealed_payload
from spotline.wire.protocol import (
    JOB_END_KEY,
    MACHINES_COUNTER,
    admit_key,
    agent_done_key,
    agent_heartbeat_key,
    agent_leaving_key,
    exit_key,
    fenced_key,
    machine_key,
    order_counter_key,
    order_key,
)

POLL_S = 0.02
# The job's end waits this long at most for the agents to say they are done (each answers
# within a heartbeat of its workers' exit, which the coordinator has already waited for),
# and not for one whose heartbeat stood still for END_QUIET_S (thirty missed beats).
END_LIMIT_S = 30.0
END_QUIET_S = 3.0
# Registrations read ahead of the first undecided one: a counter bumped by someone without
# the token (a number cannot be sealed) must not make each refresh scan without end.
SCAN_AHEAD = 64
NO_TOKEN = "no job token"
WRONG_TOKEN = "a wrong job token"
SIGNAL_NAMES: dict[int, Signal] = {signal.SIGKILL: "kill", signal.SIGTERM: "term"}


@dataclass
class AgentProcess:
    """A worker that an agent started on ``machine``."""

    worker: str
    machine: str
    _machines: Machines = field(repr=False)
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self._machines.store.read(exit_key(self.worker))
            if code is not None:
                self.returncode = int(code.decode())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"{self.worker} on {self.machine}", timeout or 0)
            time.sleep(POLL_S)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        assert sig in SIGNAL_NAMES, f"agents deliver SIGKILL and SIGTERM, not {sig}"
        if self.poll() is None:
            self._machines.order(self.machine, Order.send(self.worker, SIGNAL_NAMES[sig]))

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Machines:
    """The machines whose agents joined the job, in join order."""

    def __init__(self, store: AuthStore, on_refused: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.on_refused = on_refused
        self.joined: dict[str, MachineInfo] = {}
        self.lost: set[str] = set()  # declared lost and fenced: never placed again
        self._decided: set[int] = set()  # machine/<n> admitted or refused
        self._low = 1  # the first n not decided
        self._pokes = Pokes()  # wakes an agent once its order is in the store

    def refresh(self) -> list[MachineInfo]:
        """Admit (or refuse) the machines that registered since the last call; returns the
        admitted ones."""
        new = []
        total = self.store.add(MACHINES_COUNTER, 0)
        for n in range(self._low, min(total, self._low + SCAN_AHEAD) + 1):
            if n in self._decided or not self.store.inner.check([machine_key(n)]):
                continue  # decided, or between the agent's add and its set
            self._decided.add(n)
            info = self._admit(n, self.store.inner.get(machine_key(n)))
            if info is not None:
                new.append(info)
        while self._low in self._decided:
            self._low += 1
        return new

    def _admit(self, n: int, raw: bytes) -> MachineInfo | None:
        payload = self.store.token.open(machine_key(n), raw)
        if payload is None:
            reason = WRONG_TOKEN if is_sealed(raw) else NO_TOKEN
            self.store.set(admit_key(n), Admission(refused=reason).encode())
            if self.on_refused is not None:
                self.on_refused(f"machine {_claimed_name(raw)} (registration {n}): {reason}")
            return None
        info = MachineInfo.decode(payload)
        # A name already taken (a machine lost earlier that came back, a second agent with
        # the same host name) joins as a new machine: nothing addressed to the old one
        # (its orders, its fence) applies to it.
        name, k = info.name, 1
        while name in self.joined:
            k += 1
            name = f"{info.name}#{k}"
        info = replace(info, name=name)
        self.joined[name] = info
        self.store.set(admit_key(n), Admission(machine=name).encode())
        return info

    def adopt(self) -> None:
        """A restarted coordinator's view: the machines its predecessor admitted (their
        ``admit/<n>``) and fenced, read back from the store; registrations it never
        answered are answered by the next :meth:`refresh`."""
        total = self.store.add(MACHINES_COUNTER, 0)
        for n in range(1, total + 1):
            if not self.store.check([admit_key(n)]):
                continue
            self._decided.add(n)
            answer = Admission.decode(self.store.get(admit_key(n)))
            if answer.machine is None:
                continue
            payload = self.store.get(machine_key(n))  # it was admitted: sealed
            self.joined[answer.machine] = replace(MachineInfo.decode(payload), name=answer.machine)
            if self.store.check([fenced_key(answer.machine)]):
                self.lost.add(answer.machine)
        while self._low in self._decided:
            self._low += 1

    def started_workers(self, machine: str) -> list[str]:
        """The workers ordered to start on ``machine``, in order (read back from its orders)."""
        started = []
        for n in range(1, self.store.add(order_counter_key(machine), 0) + 1):
            if self.store.check([order_key(machine, n)]):
                order = Order.decode(self.store.get(order_key(machine, n)))
                if order.kind == "start":
                    started.append(order.worker)
        return started

    def placeable(self) -> list[str]:
        """Machines a worker may be started on: joined, not lost, not leaving."""
        return [
            m
            for m in self.joined
            if m not in self.lost and not self.store.check([agent_leaving_key(m)])
        ]

    def fence(self, machine: str) -> None:
        """``machine`` is lost: nothing it writes is acted on, and its agent, should it come
        back, stops its workers and exits."""
        self.lost.add(machine)
        self.store.set(fenced_key(machine), "1")

    def last_heartbeat(self, machine: str) -> float | None:
        """The agent's last heartbeat (``time.time()``), None if it never beat."""
        beat = self.store.read(agent_heartbeat_key(machine))
        return None if beat is None else float(beat.decode())

    def order(self, machine: str, order: Order) -> None:
        assert machine in self.joined, f"no machine {machine!r} joined"
        n = self.store.add(order_counter_key(machine), 1)
        self.store.set(order_key(machine, n), order.encode())
        info = self.joined[machine]
        # The agent sleeps between heartbeats: woken, it reads the order now.
        self._pokes.poke(info.address, info.probe_port)

    def start(self, machine: str, worker: str, module: str, argv: list[str]) -> AgentProcess:
        """Order ``machine``'s agent to start ``worker`` (``python -m module *argv``)."""
        assert machine not in self.lost, f"{machine} is fenced"
        self.order(machine, Order.start(worker, module, tuple(argv)))
        return AgentProcess(worker, machine, self)

    def end_job(self, limit_s: float = END_LIMIT_S) -> list[str]:
        """Every agent exits once its workers have. Returns once each agent that can still
        be heard has said so (``agent-done/<m>``), or after ``limit_s``: the store must
        outlive the agents' last read of it (a TCPStore goes with this process, an etcd
        job's keys are deleted next), or an agent finding it gone would take the job's end
        for a lost coordinator. An agent whose heartbeat stood still for END_QUIET_S is
        not waited for. Returns the machines that did not say it."""
        self.store.set(JOB_END_KEY, "1")
        agents = [m for m in self.joined if m not in self.lost]
        for m in agents:
            self._pokes.poke(self.joined[m].address, self.joined[m].probe_port)
        start = time.monotonic()
        # Per agent still waited for: its last heartbeat as stored, and when it changed.
        waiting = {m: (self._beat(m), start) for m in agents}
        while waiting and time.monotonic() - start < limit_s:
            time.sleep(POLL_S)
            now = time.monotonic()
            for m, (beat, since) in list(waiting.items()):
                if self.store.check([agent_done_key(m)]):
                    del waiting[m]
                elif (new := self._beat(m)) != beat:
                    waiting[m] = (new, now)
                elif now - since > END_QUIET_S:
                    del waiting[m]  # gone quiet: killed, or cut off
        return [m for m in agents if not self.store.check([agent_done_key(m)])]

    def _beat(self, machine: str) -> bytes | None:
        """The agent's heartbeat as stored (compared, never read as a time)."""
        key = agent_heartbeat_key(machine)
        return self.store.inner.get(key) if self.store.inner.check([key]) else None


def _claimed_name(raw: bytes) -> str:
    """The name an unauthenticated registration claims, for the coordinator's log only."""
    try:
        return repr(str(json.loads(unsealed_payload(raw))["name"])[:40])
    except (ValueError, KeyError, TypeError):
        return "(unreadable)"
