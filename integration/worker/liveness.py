"""An elastic worker's liveness: its heartbeat, the abort of the generation it trains in,
the coordinator's loss, and SIGTERM.

Threads besides the main one (which trains, blocked for as long as a collective takes):

- the heartbeat (``spotline.wire.heartbeat.Heartbeat``): a beat to the store, the leaving
  flag once SIGTERM came, and, while a generation is aborted, the shutdown of this process's
  connections (:func:`abort_connections`) at every turn until the main thread has left it;
- the generation's abort watch (``AbortWatch``): it waits on the store for the abort of the
  generation (a peer lost) and shuts the connections at once, so that the main thread's
  gloo operation fails within a fraction of a second instead of a timeout.

A worker whose coordinator is gone (its TCPStore refuses connections) exits with
:data:`EXIT_COORDINATOR_LOST`, from whichever thread finds out first.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from spotline.errors import UserError
from spotline.wire.auth import TOKEN_ENV, AuthStore, JobToken
from spotline.wire.heartbeat import AbortWatch, Heartbeat
from spotline.wire.protocol import (
    WATCH_RELEASED,
    abort_entries,
    abort_key,
    abort_watch_key,
    leaving_key,
)
from spotline.wire.stores import StoreSpec, store_port

# A worker whose coordinator is gone exits with this code (nobody is left to read it, but a
# supervisor or a test can tell it from a crash).
EXIT_COORDINATOR_LOST = 3
# How long a member waits for its abort watch's thread to end after writing its release.
ABORT_WATCH_JOIN_S = 5.0


class CoordinatorLost(Exception):
    """The coordinator's store no longer accepts connections: no plan will ever come."""


def worker_token() -> JobToken:
    """The job token this worker's agent handed it (every store value is sealed with it)."""
    text = os.environ.get(TOKEN_ENV)
    if not text:
        raise UserError(
            f"no job token in {TOKEN_ENV}: a worker is started by `spotline agent`, which "
            "hands it the token"
        )
    try:
        return JobToken.from_text(text)
    except ValueError:
        raise UserError(f"{TOKEN_ENV} is not a job token (64 hex digits)") from None


def abort_connections(keep_port: int) -> int:
    """Shut down this process's TCP connections except those to the store (port ``keep_port``).

    Gloo has no abort: after a failure, a peer blocked on a receive from this process (or
    this process blocked on one) waits for the process group's timeout unless the socket
    closes, and a failed process group's sockets can outlive ``destroy_process_group``.
    Shutting them down ends every pending operation at once, on both sides, except a
    transfer that has begun, which gloo leaves to its timeout: the generation's waits end
    on its abort instead (``spotline.wire.gloo_waits``). The file descriptors stay owned by
    gloo, which closes them when its context goes away.
    """
    count = 0
    for fd_name in os.listdir("/proc/self/fd"):
        fd = int(fd_name)
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                continue
            try:
                peer = sock.getpeername()
            except OSError:
                # Not connected: listening (gloo's listener, kept), or still connecting: a
                # connect to a machine gone silent waits out the whole collective timeout
                # (SYNs unanswered), so it is shut too (Linux aborts a SYN_SENT on shutdown).
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                peer = ("", -1)
            local = sock.getsockname()
            if peer[1] == keep_port or local[1] == keep_port:
                continue
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return count


class Liveness:
    """Worker ``wid``'s heartbeat, generation aborts and exits.

    ``store``: the main thread's client of the job's store; ``connect``: a new client, for
    a thread of its own (a client is one thread's); ``spec``: where the store lives (its port
    is the one :func:`abort_connections` keeps)."""

    def __init__(
        self,
        wid: str,
        spec: StoreSpec,
        store: AuthStore,
        connect: Callable[[], AuthStore],
        note: Callable[[str], None],
        *,
        heartbeat_timeout_s: float,
        term_grace_s: float,
    ) -> None:
        self.wid = wid
        self.spec = spec
        self.store = store
        self.connect = connect
        self.note = note
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.term_grace_s = term_grace_s
        self.leaving = False  # SIGTERM came: leave at the next step boundary
        self.heartbeat: Heartbeat | None = None
        self._lost_lock = threading.Lock()
        self._lost_said = False
        # The generation this worker trains in (None outside one), its members, its abort
        # watch, and the event its abort sets (which ends its rendezvous store's waits).
        self._training: int | None = None
        self._members: tuple[str, ...] = ()
        self._watch: AbortWatch | None = None
        self._aborted = threading.Event()

    @property
    def port(self) -> int:
        """The store's port: the connections to it are never shut."""
        return store_port(self.spec)

    # -- the heartbeat ------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        def coordinator_lost() -> None:
            # The main thread may be blocked in a collective with live peers for as long
            # as the collective timeout: exit from here, now.
            self.say_coordinator_lost()
            os._exit(EXIT_COORDINATOR_LOST)

        timeout_s = self.heartbeat_timeout_s
        interval_s = max(0.02, min(0.1, timeout_s / 10))
        self.heartbeat = Heartbeat(
            self.wid,
            self.connect,
            interval_s=interval_s,
            # A beat a second at most (five in the default 5 s timeout). Each turn of
            # interval_s re-shuts the connections of an aborted generation; it asks the
            # store for the abort only when the abort watch cannot wait for it.
            beat_every=max(1, round(min(1.0, timeout_s / 5) / interval_s)),
            timeout_s=timeout_s,
            note=self.note,
            coordinator_lost=self.coordinator_lost,
            on_coordinator_lost=coordinator_lost,
            each_beat=self._each_beat,
        )
        self.heartbeat.start()

    def stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()

    def _each_beat(self, hb_store: AuthStore) -> None:
        """The heartbeat thread's work besides the beat: the leaving flag, and the abort of
        the generation this worker trains in."""
        if self.leaving:
            hb_store.set(leaving_key(self.wid), "1")
        training = self._training
        aborted = self._aborted
        watch = self._watch
        # The abort watch waits for it on the store; only a watch that could not wait is
        # polled for here, once a beat.
        polled = watch is None or not watch.watching
        if training is not None and (
            aborted.is_set() or (polled and hb_store.check([abort_key(training)]))
        ):
            # A peer failed: unblock whatever gloo operation this process waits in, and
            # again at every beat until the main thread has left the generation: gloo
            # retries a failed connect (to a machine gone silent, each try would wait out
            # the whole timeout).
            aborted.set()
            abort_connections(self.port)

    def on_term(self, signum: int, frame: Any) -> None:
        """SIGTERM's handler. A preemption notice: finish the step, leave at the next
        boundary, and in any case exit within the grace time."""
        self.leaving = True
        threading.Timer(self.term_grace_s, lambda: os._exit(0)).start()

    # -- the coordinator --------------------------------------------------------------------
    def coordinator_lost(self, patience_s: float = 1.0) -> bool:
        """Whether the coordinator's TCPStore is gone (called after a store operation failed).

        A dying process's sockets close one by one: a worker whose store connection was just
        reset may still connect to the listening socket for a moment, so the store is probed
        until a connection is refused or ``patience_s`` has passed. An etcd store outlives
        the coordinator by design: it is never taken for lost here."""
        if self.spec.backend != "tcp":
            return False
        deadline = time.monotonic() + patience_s
        while True:
            try:
                with socket.create_connection((self.spec.host, self.spec.port), 2.0):
                    pass
            except OSError:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def say_coordinator_lost(self) -> None:
        """One line, once: the heartbeat thread and the main thread may both find out."""
        with self._lost_lock:
            if self._lost_said:
                return
            self._lost_said = True
        spec = self.spec
        print(
            f"spotline worker {self.wid}: lost the coordinator at {spec.host}:{spec.port}; exiting",
            flush=True,
        )

    # -- one generation -----------------------------------------------------------------------
    def enter_generation(self, generation: int, members: Sequence[str]) -> threading.Event:
        """Watch generation ``generation`` from here on (a peer lost while the group, the
        engine or the state transfer is being set up must unblock this process as it would
        mid-step). Returns the event its abort sets."""
        self._aborted = threading.Event()  # before the heartbeat can see the generation
        self._training = generation
        self._members = tuple(members)
        self._watch = self._watch_for_abort(generation)
        return self._aborted

    def abort_generation(self, generation: int) -> None:
        """Tell every member at once (their watches unblock them), and unblock our peers."""
        self._training = None
        self._aborted.set()
        for key, value in abort_entries(generation, self._members, self.wid):
            self.store.set(key, value)
        abort_connections(self.port)

    def leave_generation(self, generation: int) -> None:
        """This process has left the generation: its watch ends."""
        self._training = None
        self._release_abort_watch(generation)

    def _watch_for_abort(self, generation: int) -> AbortWatch:
        """Start generation ``generation``'s abort watch: an abort sets its event (which ends
        the rendezvous store's waits) and shuts this process's connections at once; the
        heartbeat shuts them again at each beat until this process has left the generation."""
        aborted = self._aborted

        def on_abort(lost: str) -> None:
            if self._training == generation:
                aborted.set()
                abort_connections(self.port)

        watch = AbortWatch(
            self.connect,
            abort_watch_key(generation, self.wid),
            WATCH_RELEASED,
            on_abort,
            self.note,
        )
        watch.start()
        return watch

    def _release_abort_watch(self, generation: int) -> None:
        """End the generation's abort watch: an aborted one has ended by itself (or waits on
        a key that the abort wrote); otherwise this member writes its own release."""
        watch, self._watch = self._watch, None
        if watch is None or not watch.watching:
            return
        try:
            self.store.set(abort_watch_key(generation, self.wid), WATCH_RELEASED)
        except Exception:
            return  # the store is gone: so is the watch's connection, and its thread
        watch.join(ABORT_WATCH_JOIN_S)
