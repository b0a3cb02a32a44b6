"""Start worker processes by forking a process that has already imported the heavy libraries.

A worker spends its first seconds importing torch, DeepSpeed and transformers (about 2.5 s of
CPU each on a laptop core; four workers starting together on two cores wait twice that). The
:class:`Spawner` pays it once: it starts one *zygote* process (``python -m
spotline.launch.control.spawner --preload MODULE ...``) that imports the worker's modules and
then forks a worker for each request it reads, each child running the worker's ``python -m``
entry point as if it had been started fresh (own process group, own log, its own environment
and argv; the zygote's session, which the supervisor started apart from the terminal's).
The zygote reaps its children and reports each exit status back, so a
:class:`ForkedProcess` answers ``poll``/``wait``/``send_signal`` like ``subprocess.Popen``
and the supervisor treats both alike.

Forking is safe here because the zygote never starts a thread: it only imports (torch,
DeepSpeed and transformers start none at import; :func:`_serve` asserts one thread before
the first fork) and every child builds its own process groups, stores and RNG state after
the fork. The children share the imported pages copy-on-write, so a machine's workers also
take less memory.

The zygote talks JSON lines: requests on its stdin (``{"id", "module", "argv", "env",
"log"}``), replies on its stdout (``{"id", "pid"}`` once started, ``{"pid", "code"}`` when
reaped; ``code`` as ``Popen.returncode``: negative for a signal). It exits when its stdin
closes (the supervisor is gone or done); workers it started that still run are reparented,
and find out on their own that their store is gone, as workers started with ``subprocess``
would.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

REAP_POLL_S = 0.02
# The exit code a worker gets when the zygote that would have reported it is gone (killed
# with its agent's machine, or by hand): the code cannot be known; the worker reads as
# killed, which is how its peers and the coordinator treat a worker that vanished.
LOST_EXIT_CODE = -signal.SIGKILL


@dataclass
class ForkedProcess:
    """A worker forked by the zygote, with the part of ``subprocess.Popen``'s interface the
    supervisor uses."""

    pid: int
    _spawner: Spawner = field(repr=False)
    returncode: int | None = None

    def poll(self) -> int | None:
        self._spawner.read_replies(0.0)
        if self.returncode is None and self._spawner.zygote_gone and not _exists(self.pid):
            self.returncode = LOST_EXIT_CODE
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            pause = REAP_POLL_S if left is None else min(left, REAP_POLL_S)
            if self._spawner.zygote_gone:
                # Nothing more will come on the pipe (select returns at once on its end):
                # wait for the pid itself, without spinning.
                time.sleep(pause)
            else:
                self._spawner.read_replies(pause)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # Not after its exit was reported: the pid may belong to another process by now.
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited; the zygote's reply is on its way
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Spawner:
    """The supervisor's side: one zygote, and the workers it forked."""

    def __init__(self, preload: list[str], env: dict[str, str], log: Path) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as zygote_log:
            self._zygote = subprocess.Popen(
                [sys.executable, "-m", "spotline.launch.control.spawner"]
                + [arg for module in preload for arg in ("--preload", module)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=zygote_log,
                # Its own session: a Ctrl-C at the terminal reaches the coordinator only.
                start_new_session=True,
            )
        assert self._zygote.stdin is not None and self._zygote.stdout is not None
        self._requests: IO[bytes] = self._zygote.stdin
        self._replies: IO[bytes] = self._zygote.stdout
        self._buffer = b""
        self._by_pid: dict[int, ForkedProcess] = {}
        self._started: dict[str, int] = {}
        self.ready = False  # the zygote has imported its modules
        # The zygote's pipe reached its end: no exit will be reported from now on.
        self.zygote_gone = False

    @property
    def zygote_pid(self) -> int:
        """The zygote's process id: its session's, which its workers share."""
        return self._zygote.pid

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the zygote has imported its modules (a start is a fork from then on:
        an agent joins only once it can start a worker at once)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if self._zygote.poll() is not None:
                raise RuntimeError(
                    f"the worker spawner exited with {self._zygote.returncode} while importing"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker spawner did not import in {timeout_s:g} s")
            self.read_replies(0.1)

    def start(
        self, request_id: str, module: str, argv: list[str], env: dict[str, str], log: Path
    ) -> ForkedProcess:
        """Fork a worker running ``python -m module *argv`` with ``env``, output to ``log``."""
        line = json.dumps(
            {"id": request_id, "module": module, "argv": argv, "env": env, "log": str(log)}
        )
        try:
            self._requests.write(line.encode() + b"\n")
            self._requests.flush()
        except BrokenPipeError:
            raise RuntimeError(f"the worker spawner exited ({self._zygote.poll()})") from None
        while request_id not in self._started:
            if not self.read_replies(1.0) and self._zygote.poll() is not None:
                raise RuntimeError(
                    f"the worker spawner exited with {self._zygote.returncode} before starting "
                    f"{request_id}"
                )
        proc = ForkedProcess(self._started.pop(request_id), self)
        self._by_pid[proc.pid] = proc
        return proc

    def exit_pipe(self) -> IO[bytes] | None:
        """The pipe the zygote reports exits on, to wait on with select() (its readability
        means a reply to read); None once it has ended (select would return at once)."""
        if self.zygote_gone or self._replies.closed:
            return None
        return self._replies

    def read_replies(self, timeout_s: float) -> bool:
        """Read what the zygote reported within ``timeout_s``; whether anything came."""
        if self._replies.closed:  # after close(): nothing more will be reported
            return False
        ready, _, _ = select.select([self._replies], [], [], timeout_s)
        if not ready:
            return False
        chunk = os.read(self._replies.fileno(), 65536)
        if not chunk:
            self.zygote_gone = True
            return False
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            reply = json.loads(raw)
            if "ready" in reply:
                self.ready = True
            elif "code" in reply:
                proc = self._by_pid.get(reply["pid"])
                if proc is not None:
                    proc.returncode = reply["code"]
            else:
                self._started[reply["id"]] = reply["pid"]
        return True

    def close(self) -> None:
        """Stop the zygote (its workers are the supervisor's to stop)."""
        self._requests.close()
        try:
            self._zygote.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._zygote.kill()
            self._zygote.wait()
        self._replies.close()


def _exists(pid: int) -> bool:
    """Whether ``pid`` is still a process (a worker whose zygote is gone is init's child,
    and init reaps it at once)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process now holds the pid
        return False
    return True


# The zygote's own descriptors, closed in each forked child.
_CHILD_CLEANUP: list[int] = []


def _run_child(request: dict[str, object]) -> None:
    """In the forked child: become the worker process the request describes. Never returns."""
    code = 1
    try:
        # Not the zygote's: its exit pipe and SIGCHLD handler (a worker's own children are
        # its own business).
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in _CHILD_CLEANUP:
            os.close(fd)
        # Its own process group (the agent's signals and a terminal's reach it alone), but
        # the zygote's session, shared by the machine's workers. A session is what the
        # kernel's autogroup scheduling (on by default) gives a CPU share of its own: a
        # session per worker made each its own scheduling group, and with more workers than
        # cores the pipelines drifted out of phase and waited for each other in the
        # data-parallel reduction (BENCHMARKS.md, seventeenth pass).
        os.setpgid(0, 0)
        log_fd = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)  # not the zygote's request pipe
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update(env)
        module = str(request["module"])
        argv = request["argv"]
        assert isinstance(argv, list)
        sys.argv = [module, *map(str, argv)]
        import runpy

        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            import logging

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            # Not the zygote's atexit handlers and teardown: they are the zygote's.
            os._exit(code)


def _serve(preload: list[str]) -> int:
    t0 = time.monotonic()
    for module in preload:
        importlib.import_module(module)
    # The imports' objects (torch, DeepSpeed, transformers: hundreds of thousands) live as
    # long as a worker does: out of the collector's reach, a worker's full collection (at
    # every generation's teardown) walks only what the worker made. It held the GIL, and so
    # the heartbeat thread, for 1-1.5 s a teardown on a loaded machine; and forked workers
    # no longer write the shared pages a collection would touch.
    gc.collect()
    gc.freeze()
    # In the log: how long this machine takes before a worker starts in a fraction of a second.
    print(
        f"spawner: ready ({', '.join(preload)} imported in {time.monotonic() - t0:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    # Forking is safe only from a process with one thread (see the module docstring).
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, (
        "a preloaded module started a thread; the spawner cannot fork safely"
    )
    out = sys.stdout.buffer
    out.write(json.dumps({"ready": True}).encode() + b"\n")  # the imports are done
    out.flush()
    requests = sys.stdin.fileno()
    pending = b""
    children: dict[int, str] = {}  # pid -> the request's id
    # A child's exit wakes the loop at once: SIGCHLD writes a byte to this pipe (Python's
    # wakeup fd, written by the C handler even while select() waits), so the zygote sleeps
    # until there is something to do instead of polling waitpid 50 times a second.
    exited_r, exited_w = os.pipe()
    os.set_blocking(exited_r, False)
    os.set_blocking(exited_w, False)
    signal.set_wakeup_fd(exited_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    _CHILD_CLEANUP.extend([exited_r, exited_w])

    def reply(message: dict[str, object]) -> None:
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()

    while True:
        # The timeout only bounds a missed wakeup (the pipe full): exits are reaped below.
        ready, _, _ = select.select([requests, exited_r], [], [], 1.0)
        if exited_r in ready:
            while True:
                try:
                    if not os.read(exited_r, 4096):
                        break
                except BlockingIOError:
                    break
        if requests in ready:
            chunk = os.read(requests, 65536)
            if not chunk:
                # The supervisor is gone (or done): so is the zygote. Its workers, if any
                # still run, are left to find out on their own, as the workers of a lost
                # coordinator do (their store is gone).
                return 0
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                request = json.loads(raw)
                pid = os.fork()
                if pid == 0:
                    _run_child(request)
                children[pid] = str(request["id"])
                reply({"id": request["id"], "pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                # In this process's log too: the record that outlives a lost supervisor.
                print(
                    f"spawner: {children.pop(pid)} (pid {pid}) exited with {code}",
                    file=sys.stderr,
                    flush=True,
                )
                reply({"pid": pid, "code": code})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spotline-spawner")
    parser.add_argument("--preload", action="append", default=[])
    args = parser.parse_args(argv)
    return _serve(args.preload)


if __name__ == "__main__":
    sys.exit(main())
