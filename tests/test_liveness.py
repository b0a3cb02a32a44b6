"""The liveness probe (spotline.launch.control.liveness) against real sockets on loopback:
only a refused connect is reported; an accepting port and an unanswered one are not."""

from __future__ import annotations

import socket
import time

from spotline.launch.control.liveness import LivenessProbe


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
