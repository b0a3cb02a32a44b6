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

from spotline.auth import AuthStore
from spotline.errors import one_line
from spotline.protocol import heartbeat_key


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
