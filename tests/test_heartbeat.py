"""spotline.wire.heartbeat on a real TCPStore in this process: beats land, a beat the store did not
take (the connection shut under it) is retried on a new connection instead of ending the
thread, and a beat held back (the GIL held by the main thread) is said with its delay."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from spotline.wire.auth import AuthStore, JobToken
from spotline.wire.heartbeat import AbortWatch, Heartbeat
from spotline.wire.protocol import WATCH_RELEASED, abort_watch_key, heartbeat_key

pytestmark = pytest.mark.timeout(120)

TOKEN = JobToken.from_text("cd" * 32)


@pytest.fixture
def server() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    yield store


def _client(port: int) -> AuthStore:
    return AuthStore(
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)), TOKEN
    )


def _shut_connections_to(port: int) -> int:
    """Shut this process's client connections to ``port`` (what a reset does to them)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                if sock.getpeername()[1] == port and sock.getsockname()[1] != port:
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return count


def _beats(port: int, after: float, limit_s: float = 30.0) -> float:
    """The first beat newer than ``after`` (read on a fresh client); a bound, not a timing."""
    deadline = time.monotonic() + limit_s
    while True:
        reader = _client(port)
        if reader.check([heartbeat_key("w0")]):
            beat = float(reader.get(heartbeat_key("w0")).decode())
            if beat > after:
                return beat
        assert time.monotonic() < deadline, f"no beat after {after}"
        time.sleep(0.05)


def _heartbeat(port: int, notes: list[str], timeout_s: float = 4.0) -> Heartbeat:
    lost: list[bool] = []
    return Heartbeat(
        "w0",
        lambda: _client(port),
        interval_s=0.05,
        timeout_s=timeout_s,
        note=notes.append,
        coordinator_lost=lambda: False,  # the store below never goes away
        on_coordinator_lost=lambda: lost.append(True),
    )


def test_a_beat_the_store_did_not_take_is_retried_on_a_new_connection(
    server: dist.TCPStore,
) -> None:
    notes: list[str] = []
    heartbeat = _heartbeat(server.port, notes)
    heartbeat.start()
    try:
        first = _beats(server.port, 0.0)
        assert _shut_connections_to(server.port) >= 1
        cut = time.time()
        # Beats resume on a new connection: the thread did not end at the failed beat.
        assert _beats(server.port, cut) > first
        assert any("did not take a beat" in n for n in notes), notes
        assert any("takes beats again" in n for n in notes), notes
    finally:
        heartbeat.stop()


def test_a_beat_held_back_by_the_gil_is_said_with_its_delay(server: dist.TCPStore) -> None:
    notes: list[str] = []
    heartbeat = _heartbeat(server.port, notes, timeout_s=1.0)
    heartbeat.start()
    switch = sys.getswitchinterval()
    try:
        _beats(server.port, 0.0)
        # The main thread keeps the GIL for 1.5 s at a time while it runs bytecode: the
        # heartbeat thread cannot beat meanwhile.
        sys.setswitchinterval(1.5)
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(switch)
    try:
        _beats(server.port, time.time())
        late = [n for n in notes if "late" in n]
        assert late and "taken for a hung worker" in late[0], notes
    finally:
        heartbeat.stop()


def test_the_beat_is_written_every_beat_every_turns_and_the_watch_runs_every_turn(
    server: dist.TCPStore,
) -> None:
    turns: list[float] = []
    beats: list[bytes] = []
    reader = _client(server.port)

    def each_beat(store: AuthStore) -> None:
        beats.append(reader.get(heartbeat_key("w0")))  # the value this turn left
        turns.append(time.monotonic())

    heartbeat = Heartbeat(
        "w0",
        lambda: _client(server.port),
        interval_s=0.01,
        timeout_s=4.0,
        note=lambda line: None,
        coordinator_lost=lambda: False,
        on_coordinator_lost=lambda: None,
        each_beat=each_beat,
        beat_every=4,
    )
    heartbeat.start()
    try:
        while len(turns) < 24:
            time.sleep(0.02)
    finally:
        heartbeat.stop()
    # Turn i leaves beat i // 4: a new value every fourth turn, from the first.
    changes = [i for i in range(1, 24) if beats[i] != beats[i - 1]]
    assert changes == list(range(4, 24, 4)), changes


def _watch(port: int, lost: list[str], notes: list[str], wait_s: float = 3600.0) -> AbortWatch:
    watch = AbortWatch(
        lambda: _client(port),
        abort_watch_key(3, "w0"),
        WATCH_RELEASED,
        lost.append,
        notes.append,
        wait_s=wait_s,
    )
    watch.start()
    return watch


def test_the_abort_watch_wakes_on_its_key_and_ends_on_its_release(
    server: dist.TCPStore,
) -> None:
    writer = _client(server.port)
    lost: list[str] = []
    notes: list[str] = []
    # A wait that times out (the generation trains on) is waited again, not a failure.
    aborted = _watch(server.port, lost, notes, wait_s=0.2)
    time.sleep(0.7)
    assert aborted.watching and not lost
    writer.set(abort_watch_key(3, "w0"), "w2")
    assert aborted.join(30.0)
    assert lost == ["w2"] and not aborted.watching and not notes
    # Released: the thread ends without an abort.
    released = _watch(server.port, lost, notes)
    writer.set(abort_watch_key(3, "w0"), WATCH_RELEASED)
    assert released.join(30.0)
    assert lost == ["w2"] and not released.watching and not notes


def test_an_abort_watch_that_cannot_wait_hands_the_check_back_to_the_heartbeat(
    server: dist.TCPStore,
) -> None:
    lost: list[str] = []
    notes: list[str] = []
    # Its connection reset while it waits (the store gone, a network fault).
    watch = _watch(server.port, lost, notes)
    deadline = time.monotonic() + 30
    # Shut until the watch gives up: a client reset while it connects connects again.
    while not watch.join(0.1):
        assert time.monotonic() < deadline, "the watch never gave up"
        _shut_connections_to(server.port)
    assert not watch.watching and not lost
    assert len(notes) == 1 and "the heartbeat checks instead" in notes[0], notes
    # A value that is not sealed with the job's token is no abort either.
    forged = _watch(server.port, lost, notes)
    raw = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    raw.set(abort_watch_key(3, "w0"), "w2")  # not through AuthStore: no seal
    assert forged.join(30.0)
    assert not forged.watching and not lost and len(notes) == 2, notes
