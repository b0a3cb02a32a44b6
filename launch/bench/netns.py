"""A cluster of machines on one machine: Linux network namespaces on a private bridge.

Used by ``spotline bench cluster`` and, through the pytest wrapper ``tests/netns.py`` (which
turns :class:`NetnsUnavailable` into a skip and adds the ``netns_cluster`` fixture), by the
cluster tests.

``with cluster(n) as machines:`` makes a bridge in the root namespace and ``n`` namespaces,
each joined to it by a veth pair: one end inside as ``eth0`` with ``10.77.0.(i+1)/24``, the
other end on the bridge. The range exists only inside those namespaces: the bridge itself has
no address, so no traffic from them can leave this machine and the root namespace's routes
are untouched. Two runs at once (other worktrees) do not collide: names carry the pid and a
per-process counter, and each run's bridge is its own L2 segment.

Teardown (always, also when the body raises or is interrupted) kills every process the
machines started (their process groups, then anything still in the namespace), and deletes
the namespaces, the veths and the bridge. At start, leftovers of a run whose process is gone
(a killed earlier run) are swept. Where the kernel or permissions refuse, the test is skipped
with one reason line (:class:`NetnsUnavailable`, one line, raised before anything is made or
after what was made is removed).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

# Every name this module makes starts with PREFIX, then the owner's pid in hex and a counter:
# "sln" + 6 hex digits (pid_max is at most 2**22) + "c" + counter + role + index stays within
# the kernel's 15-character limit on interface names (IFNAMSIZ - 1).
PREFIX = "sln"
_NAME = re.compile(rf"^{PREFIX}([0-9a-f]+)c\d+")
_SUBNET = "10.77.0"
_COUNTER = itertools.count()
IFACE = "eth0"


class NetnsUnavailable(Exception):
    """Network namespaces cannot be made here (no ``ip``, not root, the kernel refuses):
    the message is one line saying why."""


def _ip(
    *args: str, netns: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def our_names() -> list[str]:
    """Namespaces and links (root namespace) whose names start with PREFIX."""
    names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    for line in _ip("-o", "link", "show").stdout.splitlines():
        # "12: slnab12c0v1@if11: <...>": the name, without the peer suffix.
        names.append(line.split(":")[1].strip().split("@")[0])
    return [n for n in names if n.startswith(PREFIX)]


def sweep_leftovers() -> None:
    """Remove namespaces and links of earlier runs whose owning process is gone."""
    for name in our_names():
        match = _NAME.match(name)
        if match is None or _pid_alive(int(match.group(1), 16)):
            continue
        if name in _ip("netns", "list").stdout.split():
            _kill_namespace_pids(name)
            _ip("netns", "delete", name, check=False)
        else:
            _ip("link", "delete", name, check=False)


def _kill_namespace_pids(netns: str) -> None:
    pids = _ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Machine:
    """One namespace: a machine with its own address on the cluster's bridge."""

    name: str
    address: str
    iface: str
    host_veth: str
    tag: str  # the prefix of every name its cluster made
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this machine in its own session (process group): teardown
        kills the whole group. ``ip netns exec`` execs the command, so the Popen's pid is
        the command's own."""
        kw.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen(
            ["ip", "netns", "exec", self.name, *argv], **kw
        )
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every process running in this machine (its namespace), whoever started it."""
        return [int(p) for p in _ip("netns", "pids", self.name, check=False).stdout.split()]

    def kill_everything(self) -> int:
        """A preemption that takes the whole machine at once: SIGKILL to every process in
        it. Returns how many were signalled."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def link_down(self) -> None:
        """Cut this machine off: its interface goes down, its processes keep running."""
        _ip("link", "set", self.iface, "down", netns=self.name)

    def link_up(self) -> None:
        _ip("link", "set", self.iface, "up", netns=self.name)

    def reap(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()


def check_possible() -> None:
    """NetnsUnavailable unless this process can make namespaces (``ip`` present, root)."""
    if shutil.which("ip") is None:
        raise NetnsUnavailable("network namespaces: the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces: creating them needs root")


def _refused(reason: str) -> NoReturn:
    # One line: the kernel's message can span several (the skip reason must not).
    raise NetnsUnavailable(" ".join(reason.split()))


def _exit_on_term(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)


@contextmanager
def cluster(n: int) -> Iterator[list[Machine]]:
    """``n`` machines (namespaces) on one private bridge; everything removed on exit."""
    assert 1 <= n <= 99, n
    check_possible()
    sweep_leftovers()
    tag = f"{PREFIX}{os.getpid():x}c{next(_COUNTER)}"
    bridge = f"{tag}b"
    assert len(f"{tag}v{n - 1}") <= 15, tag
    machines: list[Machine] = []
    made: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order
    # SIGTERM (a `kill`, a CI's stop) would end the process without the teardown below and
    # leave the machines' processes running: turn it into an exit that runs it.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        proc = _ip("link", "add", bridge, "type", "bridge", check=False)
        if proc.returncode != 0:
            _refused(f"network namespaces: cannot create a bridge: {proc.stderr.strip()}")
        made.append(("link", bridge))
        _ip("link", "set", bridge, "up")
        for i in range(n):
            machine = Machine(f"{tag}n{i}", f"{_SUBNET}.{i + 1}", IFACE, f"{tag}v{i}", tag)
            proc = _ip("netns", "add", machine.name, check=False)
            if proc.returncode != 0:
                _refused(f"network namespaces: `ip netns add` failed: {proc.stderr.strip()}")
            made.append(("netns", machine.name))
            machines.append(machine)
            # The namespace end is created inside the namespace directly under its final name,
            # so no temporary name ever appears in the root namespace.
            proc = _ip("link", "add", machine.host_veth, "type", "veth", "peer", "name", IFACE,
                       "netns", machine.name, check=False)  # fmt: skip
            if proc.returncode != 0:
                _refused(f"network namespaces: cannot create a veth pair: {proc.stderr.strip()}")
            made.append(("link", machine.host_veth))
            _ip("link", "set", machine.host_veth, "master", bridge, "up")
            _ip("addr", "add", f"{machine.address}/24", "dev", IFACE, netns=machine.name)
            _ip("link", "set", IFACE, "up", netns=machine.name)
            _ip("link", "set", "lo", "up", netns=machine.name)
        yield machines
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for machine in machines:
            machine.reap()
        for kind, name in reversed(made):
            if kind == "netns":
                # Processes the machines did not start themselves (none expected) would keep
                # the namespace alive after `ip netns delete`: kill them first.
                _kill_namespace_pids(name)
                _ip("netns", "delete", name, check=False)
            else:
                # Deleting one end of a veth deletes both; the namespace's end may be gone.
                _ip("link", "delete", name, check=False)
