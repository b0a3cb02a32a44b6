"""The coordinator's side of the agents: the machines that joined, and their workers as
process handles.

:class:`Machines` reads the machines the agents registered (``machine/<n>``), tells whether
an agent still heartbeats, and sends orders (:class:`~spotline.protocol.Order`). A worker
started on a machine is an :class:`AgentProcess`: the part of ``subprocess.Popen``'s
interface the supervisor uses (``poll``, ``wait``, ``send_signal``, ``kill``), answered
through the store (its agent writes ``exit/<w>``), so the supervisor treats a worker on
another machine as it treats one it forked itself.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field

from spotline.protocol import (
    JOB_END_KEY,
    MachineInfo,
    Order,
    Signal,
    Store,
    agent_heartbeat_key,
    exit_key,
    machine_key,
    order_counter_key,
    order_key,
)

POLL_S = 0.02
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
            key = exit_key(self.worker)
            if self._machines.store.check([key]):
                self.returncode = int(self._machines.store.get(key).decode())
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

    def __init__(self, store: Store) -> None:
        self.store = store
        self.joined: dict[str, MachineInfo] = {}
        self._read = 0  # machine/<n> read so far

    def refresh(self) -> list[MachineInfo]:
        """Read the machines that joined since the last call; returns them."""
        new = []
        while self.store.check([machine_key(self._read + 1)]):
            self._read += 1
            info = MachineInfo.decode(self.store.get(machine_key(self._read)))
            self.joined[info.name] = info
            new.append(info)
        return new

    def last_heartbeat(self, machine: str) -> float | None:
        """The agent's last heartbeat (``time.time()``), None if it never beat."""
        key = agent_heartbeat_key(machine)
        if not self.store.check([key]):
            return None
        return float(self.store.get(key).decode())

    def order(self, machine: str, order: Order) -> None:
        assert machine in self.joined, f"no machine {machine!r} joined"
        n = self.store.add(order_counter_key(machine), 1)
        self.store.set(order_key(machine, n), order.encode())

    def start(self, machine: str, worker: str, module: str, argv: list[str]) -> AgentProcess:
        """Order ``machine``'s agent to start ``worker`` (``python -m module *argv``)."""
        self.order(machine, Order.start(worker, module, tuple(argv)))
        return AgentProcess(worker, machine, self)

    def end_job(self) -> None:
        """Every agent exits once its workers have."""
        self.store.set(JOB_END_KEY, "1")
