"""Spotline's own processes on namespace machines, for the cluster benchmarks.

``spotline bench cluster`` and ``spotline bench cluster-replay`` start ``spotline
coordinator`` and ``spotline agent`` inside the machines of
:func:`spotline.launch.bench.netns.cluster` and follow the coordinator through its stderr
(:class:`LogWatch`); what they share is here, so that neither imports the other.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from spotline.errors import UserError
from spotline.launch.bench.jobs import RunFailed, child_env

WATCH_S = 0.005  # how often the coordinator's stderr is read: the timing resolution
JOIN = re.compile(r"--join (\S+:\d+)")


class LogWatch:
    """A file another process appends to, read as it grows; each complete line is kept with
    the time (this process's monotonic clock) it was first seen."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[tuple[float, str]] = []
        self._offset = 0
        self._partial = ""

    def poll(self) -> None:
        now = time.monotonic()
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return
        *complete, self._partial = (self._partial + chunk).split("\n")
        self.lines += [(now, line) for line in complete]

    def first(self, pattern: str, after: float = float("-inf")) -> tuple[float, str] | None:
        """The first line matching ``pattern`` seen at or after ``after``."""
        regex = re.compile(pattern)
        return next(((t, ln) for t, ln in self.lines if t >= after and regex.search(ln)), None)

    def wait(
        self, pattern: str, procs: Sequence[subprocess.Popen[Any]], limit_s: float
    ) -> tuple[float, str]:
        deadline = time.monotonic() + limit_s
        while True:
            self.poll()
            found = self.first(pattern)
            if found:
                return found
            tail = "\n".join(ln for _, ln in self.lines[-30:])
            if any(p.poll() is not None for p in procs):
                raise RunFailed(f"exited before {pattern!r}; {self.path} ends:\n{tail}", 1)
            if time.monotonic() > deadline:
                raise RunFailed(f"no {pattern!r} in {limit_s:g} s; {self.path} ends:\n{tail}", 1)
            time.sleep(WATCH_S)


def worker_pid(log: Path) -> int | None:
    """The process whose stdout is ``log``: the worker an agent forked with that log (forked
    workers keep the agent's command line, so the log is what names them)."""
    target = str(log.resolve())
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/fd/1") == target:
                return int(entry)
        except OSError:  # gone, or a kernel thread
            continue
    return None


def spotline_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "spotline.launch.cli", *args]


def popen_in(machine: Any, argv: list[str], err: Path) -> subprocess.Popen[bytes]:
    with open(err, "wb") as err_file:
        proc: subprocess.Popen[bytes] = machine.popen(
            argv, env=child_env(), stdout=subprocess.DEVNULL, stderr=err_file
        )
    return proc


def namespace_machines(stack: ExitStack, n: int) -> list[Any]:
    """``n`` namespace machines, removed when ``stack`` closes (UserError where the kernel
    or permissions refuse)."""
    from spotline.launch.bench import netns

    try:
        machines: list[Any] = stack.enter_context(netns.cluster(n))
    except netns.NetnsUnavailable as exc:
        raise UserError(f"bench: {exc}") from None
    return machines


def start_coordinator(
    host: Any, config: Path, out: Path, err: Path, flags: Sequence[str]
) -> tuple[subprocess.Popen[bytes], LogWatch, str]:
    """``spotline coordinator`` on ``host`` listening on its address; returns it, the watch
    on its stderr and the ``--join`` address its agents use."""
    watch = LogWatch(err)
    coordinator = popen_in(
        host,
        spotline_argv("coordinator", "--config", str(config), "--output", str(out),
                      "--listen", f"{host.address}:0", *flags),
        err,
    )  # fmt: skip
    join = JOIN.search(watch.wait(r"--join \S+:\d+", [coordinator], 300)[1])
    assert join is not None
    return coordinator, watch, join.group(1)


def start_agent(
    host: Any,
    join: str,
    name: str,
    logs: Path,
    token_file: Path,
    err: Path,
    *,
    nice: int = 0,
) -> subprocess.Popen[bytes]:
    """``spotline agent --slots 1`` named ``name`` on ``host``, bound to its interface, at
    CPU priority ``nice`` (``nice`` execs the agent: the Popen's pid stays the agent's)."""
    return popen_in(
        host,
        ["nice", "-n", str(nice)] * (nice != 0)
        + spotline_argv("agent", "--join", join, "--slots", "1", "--name", name,
                      "--iface", host.iface, "--logs", str(logs),
                      # The coordinator wrote the job's token there before printing --join.
                      "--token-file", str(token_file)),
        err,
    )  # fmt: skip
