"""The liveness probe (spotline.launch.control.liveness_probe) against real sockets on loopback:
only a refused connect is reported; an accepting port and an unanswered one are not. A poke
reaches a listening agent's port (and wakes an agent sleeping between its beats); a poke
to a dead or silent port costs the coordinator nothing."""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import pytest

from spotline.launch.control.liveness_probe import LivenessProbe, Pokes


def _refused_within(probe: LivenessProbe, limit_s: float) -> set[str]:
    """What ``refused()`` reports over ``limit_s`` (a bound, not a timing claim)."""
    seen: set[str] = set()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        seen |= probe.refused()
        time.sleep(0.01)
    return seen


def test_a_closed_port_is_refused_a_listening_one_and_a_silent_one_are_not() -> None:
    alive = socket.create_server(("127.0.0.1", 0), backlog=4)
    with socket.create_server(("127.0.0.1", 0)) as gone:
        dead_port = gone.getsockname()[1]  # closed below: nothing listens there any more
    # A port whose accept queue is full drops new connects without an answer: as silent as
    # a machine whose link is cut, without sending anything off this machine.
    silent = socket.create_server(("127.0.0.1", 0), backlog=0)
    fillers = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(silent.getsockname())
        fillers.append(s)
    probe = LivenessProbe()
    try:
        probe.probe("alive", "127.0.0.1", alive.getsockname()[1])
        probe.probe("dead", "127.0.0.1", dead_port)
        probe.probe("silent", "127.0.0.1", silent.getsockname()[1])
        assert _refused_within(probe, 0.5) == {"dead"}
        # Reported once, then probed again only when asked (and refused again).
        assert probe.refused() == set()
        time.sleep(0.25)  # past REPROBE_S
        probe.probe("dead", "127.0.0.1", dead_port)
        assert _refused_within(probe, 0.5) == {"dead"}
    finally:
        probe.close()
        for s in [alive, silent, *fillers]:
            s.close()


def test_a_poke_reaches_a_listening_port_and_a_dead_or_silent_one_raises_nothing() -> None:
    alive = socket.create_server(("127.0.0.1", 0), backlog=4)
    alive.setblocking(False)
    with socket.create_server(("127.0.0.1", 0)) as gone:
        dead_port = gone.getsockname()[1]
    silent = socket.create_server(("127.0.0.1", 0), backlog=0)
    filler = socket.socket()
    filler.setblocking(False)
    filler.connect_ex(silent.getsockname())
    pokes = Pokes()
    try:
        pokes.poke("127.0.0.1", dead_port)
        pokes.poke("127.0.0.1", silent.getsockname()[1])
        pokes.poke("127.0.0.1", alive.getsockname()[1])
        # The agent's select() sees the connection (no timeout: a lost poke hangs the test
        # into its timeout instead of passing).
        ready, _, _ = select.select([alive], [], [])
        assert ready == [alive]
        conn, _ = alive.accept()
        conn.close()
    finally:
        pokes.close()
        for s in (alive, silent, filler):
            s.close()


@pytest.mark.timeout(60)
def test_an_agent_sleeps_until_its_beat_and_a_poke_or_an_exit_wakes_it(tmp_path: Path) -> None:
    """``Agent.wait_for_news`` with the heartbeat a long way off: it returns on a poke to its
    liveness port and on a byte on its exit pipe (a test that cannot wake it hangs into the
    timeout), and at once when the beat is due."""
    import os

    from spotline.launch import agent as agent_module
    from spotline.wire.agent_messages import MachineInfo

    listener = socket.create_server(("127.0.0.1", 0), backlog=4)
    listener.setblocking(False)
    exit_r, exit_w = os.pipe()
    a = agent_module.Agent(
        None,  # type: ignore[arg-type]  # no store: wait_for_news uses none
        None,
        MachineInfo("m", 1, "127.0.0.1", "lo", listener.getsockname()[1]),
        lambda *args: None,  # type: ignore[arg-type,return-value]
        env={},
        logs=tmp_path,
        listener=listener,
    )
    reader = os.fdopen(exit_r, "rb", buffering=0)

    class Reports:
        """The spawner's side: its pipe, and the reads of what came on it."""

        read: list[bytes] = []

        def exit_pipe(self) -> object:
            return reader

        def read_replies(self, timeout_s: float) -> bool:
            self.read.append(reader.read(4096) or b"")
            return True

    reports = Reports()
    a.exits = reports  # type: ignore[assignment]
    pokes = Pokes()
    try:
        a.last_beat = time.monotonic() + 3600.0  # the next beat is an hour away
        pokes.poke("127.0.0.1", listener.getsockname()[1])
        a.wait_for_news()  # woken by the poke
        conn, _ = listener.accept()
        conn.close()
        os.write(exit_w, b"x")
        a.wait_for_news()  # woken by the exit pipe, and it read what came
        assert reports.read == [b"x"]
        a.last_beat = -float("inf")
        a.wait_for_news()  # the beat is due: no wait at all
    finally:
        pokes.close()
        listener.close()
        reader.close()
        os.close(exit_w)
