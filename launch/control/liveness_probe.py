"""Whether a quiet machine's agent is dead, asked of the machine's kernel.

Every agent listens on a TCP port of its own (``MachineInfo.probe_port``) and accepts and
closes whatever connects. When an agent stops heartbeating, the coordinator connects there:

- **refused** (a TCP reset): the machine's kernel answers and no process listens, so the
  agent is dead, and with it, as a rule, the machine's workers (every process killed at
  once, a container deleted, an out-of-memory kill). The machine is lost now, not after the
  heartbeat timeout: this is what brings a hard machine kill to within a moment of a
  one-machine takeover.
- **accepted**: the agent is alive, only slow; nothing is decided.
- **no answer** (a machine powered off, a cut link): nothing is decided here; the heartbeat
  timeout decides, as it must for a silent machine.

Only a refusal is acted on, and a refusal is proof (no process holds the port), so a probe
never declares a live machine lost. Connects are non-blocking: the coordinator's loop never
waits on a silent machine. Pure sockets: no torch.
"""

from __future__ import annotations

import errno
import select
import socket
import time
from dataclasses import dataclass

# A probe not answered in this long is abandoned (a silent machine: the heartbeat decides).
GIVE_UP_S = 2.0
# The same machine is probed again no sooner than this after its last probe ended.
REPROBE_S = 0.2


@dataclass
class _InFlight:
    sock: socket.socket
    started: float


class LivenessProbe:
    """Non-blocking TCP probes of agents' liveness ports, one in flight per machine."""

    def __init__(self) -> None:
        self._in_flight: dict[str, _InFlight] = {}
        self._ended: dict[str, float] = {}  # machine -> when its last probe ended
        self._refused: set[str] = set()  # refused, not yet returned by refused()

    def probe(self, machine: str, address: str, port: int) -> None:
        """Start a probe of ``machine`` unless one is in flight or one ended just now."""
        now = time.monotonic()
        if machine in self._in_flight or now - self._ended.get(machine, -REPROBE_S) < REPROBE_S:
            return
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        code = sock.connect_ex((address, port))
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            self._ended[machine] = now
            if code == errno.ECONNREFUSED:  # answered at once (the same host): refused
                self._refused.add(machine)
            return
        self._in_flight[machine] = _InFlight(sock, now)

    def refused(self) -> set[str]:
        """The machines whose probe was refused since the last call (their agents are dead)."""
        refused, self._refused = self._refused, set()
        if not self._in_flight:
            return refused
        socks = {f.sock: m for m, f in self._in_flight.items()}
        _, writable, _ = select.select([], list(socks), [], 0)
        now = time.monotonic()
        for sock in writable:
            machine = socks[sock]
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED:
                refused.add(machine)
            self._end(machine, now)
        for machine, flight in list(self._in_flight.items()):
            if now - flight.started > GIVE_UP_S:
                self._end(machine, now)
        return refused

    def _end(self, machine: str, now: float) -> None:
        self._in_flight.pop(machine).sock.close()
        self._ended[machine] = now

    def close(self) -> None:
        for machine in list(self._in_flight):
            self._end(machine, time.monotonic())


class Pokes:
    """Wake agents: a connection to an agent's liveness port, carrying nothing, wakes it
    from its sleep between heartbeats (``spotline.launch.agent``), so an order written to
    the store is read at once rather than at the next beat. Non-blocking, as the probes
    are: a connect still in progress is kept and closed once done or after GIVE_UP_S (a
    silent machine reads the order at its next beat, if ever)."""

    def __init__(self) -> None:
        self._in_flight: list[tuple[socket.socket, float]] = []

    def poke(self, address: str, port: int) -> None:
        self._reap()
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        if sock.connect_ex((address, port)) == errno.EINPROGRESS:
            self._in_flight.append((sock, time.monotonic()))
        else:  # connected (the agent will accept it) or refused (nobody to wake)
            sock.close()

    def _reap(self) -> None:
        """Close the connects that completed, failed, or waited past GIVE_UP_S."""
        if not self._in_flight:
            return
        _, writable, _ = select.select([], [s for s, _ in self._in_flight], [], 0)
        now = time.monotonic()
        done = set(writable)
        keep = []
        for sock, started in self._in_flight:
            if sock in done or now - started > GIVE_UP_S:
                sock.close()
            else:
                keep.append((sock, started))
        self._in_flight = keep

    def close(self) -> None:
        for sock, _ in self._in_flight:
            sock.close()
        self._in_flight = []
