"""A worker's heartbeat: a thread that writes ``hb/<worker>`` to the job's store every
``interval_s`` until the worker stops; the coordinator kills a worker whose last beat is
older than ``recovery.heartbeat_timeout_s`` (``spotline.launch.control.supervisor``).

Two failures of the beat itself must not look like a hung worker:

- a beat the store did not take (a reset connection, an etcd hiccup) while the coordinator
  lives: said once in the worker's log and retried on a new connection at the next beat.
  The thread used to return there, silently, and a healthy worker was killed as hung
  ``heartbeat_timeout_s`` later;
- a beat that comes late (the process was stopped or starved of CPU, a call held the GIL,
  the store answered slowly): said in the log with its delay, which is what explains the
  coordinator's ``heartbeat-missed`` when it follows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from spotline.errors import one_line
from spotline.wire.auth import AuthStore
from spotline.wire.protocol import heartbeat_key


@dataclass
class Heartbeat:
    """The heartbeat thread of worker ``worker`` (:meth:`start`, then :meth:`stop`)."""

    worker: str
    # A new client of the store: a store client is one thread's, and a failed one is
    # replaced, not reused.
    connect: Callable[[], AuthStore]
    interval_s: float
    timeout_s: float  # the coordinator's heartbeat timeout, for the log's lines
    note: Callable[[str], None]
    # After a beat failed: whether the coordinator is gone (then ``on_coordinator_lost``
    # runs, which exits the process: nothing is left to beat for).
    coordinator_lost: Callable[[], bool]
    on_coordinator_lost: Callable[[], None]
    # More work at each beat, on the beat's store (the worker's leaving flag, its
    # generation's abort watch); an exception in it counts as a failed beat.
    each_beat: Callable[[AuthStore], None] = lambda store: None
    # The beat itself is written every ``beat_every`` turns of ``interval_s`` (each turn
    # runs ``each_beat``): the coordinator needs a beat a second to tell a hung worker in
    # seconds, the abort watch wants to be quick, and each write is a round trip the
    # coordinator's store answers while the workers want the CPU.
    beat_every: int = 1
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def start(self) -> None:
        """Connect (in the caller: a store that cannot be reached at all is its error) and
        beat from a daemon thread."""
        assert self._thread is None, "started once"
        store = self.connect()
        self._thread = threading.Thread(
            target=self._run, args=(store,), name="spotline-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _run(self, store: AuthStore | None) -> None:
        failing = False
        turn_t = time.monotonic()
        store_s = 0.0  # how long the last beat's store calls took
        turn = 0
        while not self._stop.is_set():
            # A turn is a beat and a wait: what it took beyond the wait is its lateness,
            # the store's share of it apart (a slow store is another cause, and a remedy).
            now = time.monotonic()
            late_s, turn_t = now - turn_t - self.interval_s, now
            if late_s > self.timeout_s / 2:
                self.note(
                    f"heartbeat: a beat came {late_s:.1f} s late, {store_s:.1f} s of it in the "
                    "store's answers (the rest: this process stopped or starved of CPU, or a "
                    f"call holding the GIL); {self.timeout_s:g} s without one is taken for a "
                    "hung worker"
                )
            try:
                if store is None:
                    store = self.connect()
                store_t = time.monotonic()
                if failing or turn % self.beat_every == 0:
                    store.set(heartbeat_key(self.worker), repr(time.time()))
                turn += 1
                if failing:
                    self.note("heartbeat: the store takes beats again")
                    failing = False
                self.each_beat(store)
                store_s = time.monotonic() - store_t
            except Exception as exc:
                if self._stop.is_set():
                    return
                if self.coordinator_lost():
                    self.on_coordinator_lost()
                    return
                if not failing:
                    self.note(
                        f"heartbeat: the store did not take a beat ({one_line(exc)}); "
                        "retrying on a new connection"
                    )
                    failing = True
                store = None
            self._stop.wait(self.interval_s)


@dataclass
class AbortWatch:
    """A thread that waits for a generation's abort on a store connection of its own.

    The store holds the wait (TCPStore's ``wait``, an etcd watch) and answers it the moment
    ``key`` is written, so a member learns of an abort at once and asks nothing while it
    trains. The heartbeat used to check for the abort ten times a second: forty round trips a
    second to the coordinator for four workers, which cost a 2-core host about 3% of a
    gpt2-big step (BENCHMARKS.md, sixteenth pass). ``key`` is this member's own
    (``abort-watch/<g>/<w>``): written by whoever aborts the generation, with the name of who
    was lost, or by this member with ``released`` when it leaves the generation without an
    abort, which ends the wait. ``on_abort`` runs in the watch's thread.

    If the watch cannot wait (its store connection failed, a value that does not verify),
    :attr:`watching` turns False and the heartbeat checks for the abort at each beat, as it
    did before.
    """

    connect: Callable[[], AuthStore]
    key: str
    released: str  # the value that ends the watch without an abort
    on_abort: Callable[[str], None]
    note: Callable[[str], None]
    # A wait's bound: a wait that times out (the generation trains on) is waited again.
    # Long, because TCPStore logs each timed-out wait.
    wait_s: float = 3600.0
    _watching: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    @property
    def watching(self) -> bool:
        """Whether the thread waits on the store now (connected, not ended)."""
        return self._watching.is_set()

    def start(self) -> None:
        assert self._thread is None, "started once"
        self._watching.set()  # until the thread says otherwise: no beat polls meanwhile
        self._thread = threading.Thread(target=self._run, name="spotline-abort-watch", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to end (after an abort, or a release); whether it has."""
        assert self._thread is not None
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            store = self.connect()
            while True:
                try:
                    store.wait([self.key], timedelta(seconds=self.wait_s))
                except Exception:
                    # A timeout if the store still answers: wait again. If it does not,
                    # the check raises and the watch ends (the heartbeat polls instead).
                    if not store.check([self.key]):
                        continue
                value = store.get(self.key).decode()
                break
        except Exception as exc:
            self.note(
                f"abort watch: cannot wait on the store ({one_line(exc)}); the heartbeat checks instead"
            )
            self._watching.clear()
            return
        self._watching.clear()
        if value != self.released:
            self.on_abort(value)
