"""``spotline agent`` as a real process against a real store: it registers its machine,
starts the workers it is ordered to (forked by its spawner), delivers signals, reports every
exit, leaves on a preemption notice, and stops its workers when the coordinator is lost.

The workers are a stand-in module (tests/workers/agent_child.py, preloading only ``json``):
what is under test is the agent, so these runs take seconds. The training runs of the
many-machines tests drive the same agent with real workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import REPO, child_env

from spotline.launch.control.machines import Machines
from spotline.protocol import MachineInfo

WORKERS = REPO / "tests" / "workers"
pytestmark = pytest.mark.timeout(120)


def _agent(port: int, name: str, logs: Path, *extra: str) -> subprocess.Popen[str]:
    env = dict(child_env(), PYTHONPATH=f"{WORKERS}{os.pathsep}{child_env().get('PYTHONPATH', '')}")
    return subprocess.Popen(
        [sys.executable, "-m", "spotline.launch.cli", "agent", "--join", f"127.0.0.1:{port}"]
        + ["--slots", "2", "--name", name, "--logs", str(logs), "--preload", "json", *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture()
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    yield server


def _joined(machines: Machines, agent: subprocess.Popen[str]) -> MachineInfo:
    while not machines.joined:
        assert agent.poll() is None, agent.communicate()
        machines.refresh()
        time.sleep(0.02)
    (info,) = machines.joined.values()
    return info


def _wait_started(log: Path, agent: subprocess.Popen[str]) -> None:
    while not log.exists() or "pid" not in log.read_text():
        assert agent.poll() is None, agent.communicate()
        time.sleep(0.02)


def test_an_agent_starts_signals_and_reports_its_workers_and_leaves_on_notice(
    store, tmp_path
) -> None:
    agent = _agent(store.port, "m1", tmp_path / "logs")
    try:
        machines = Machines(store)
        info = _joined(machines, agent)
        assert (info.name, info.slots, info.address) == ("m1", 2, "127.0.0.1")
        done = machines.start("m1", "w0", "agent_child", ["exit", "5"])
        sleeper = machines.start("m1", "w1", "agent_child", ["sleep"])
        assert done.wait(timeout=60) == 5
        assert sleeper.poll() is None
        sleeper.kill()
        assert sleeper.wait(timeout=60) == -signal.SIGKILL
        assert machines.last_heartbeat("m1") is not None
        log = (tmp_path / "logs" / "w0.log").read_text()
        assert "machine m1 argv ['exit', '5']" in log
        # A preemption notice: the workers leave (this one exits 0 on SIGTERM), the agent
        # exits 0 once they have, and a worker ordered after the notice never starts.
        leaver = machines.start("m1", "w2", "agent_child", ["leave"])
        _wait_started(tmp_path / "logs" / "w2.log", agent)
        agent.send_signal(signal.SIGTERM)
        assert leaver.wait(timeout=60) == 0
        late = machines.start("m1", "w3", "agent_child", ["sleep"])
        assert agent.wait(timeout=60) == 0
        assert late.poll() in (None, -signal.SIGTERM)  # refused if the agent still read it
        assert not (tmp_path / "logs" / "w3.log").exists()
    finally:
        agent.kill()
        agent.communicate()


def test_an_agent_exits_when_the_job_ends(store, tmp_path) -> None:
    agent = _agent(store.port, "m2", tmp_path / "logs")
    try:
        machines = Machines(store)
        _joined(machines, agent)
        w = machines.start("m2", "w0", "agent_child", ["exit", "0"])
        assert w.wait(timeout=60) == 0
        machines.end_job()
        assert agent.wait(timeout=60) == 0
    finally:
        agent.kill()
        agent.communicate()


def test_an_agent_that_loses_its_coordinator_stops_its_workers_and_says_so(tmp_path) -> None:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    agent = _agent(server.port, "m3", tmp_path / "logs", "--lost-after", "1")
    try:
        machines = Machines(server)
        _joined(machines, agent)
        machines.start("m3", "w0", "agent_child", ["sleep"])
        log = tmp_path / "logs" / "w0.log"
        _wait_started(log, agent)
        pid = int(log.read_text().split()[1])
        del machines
        del server  # the coordinator's store goes with its process
        assert agent.wait(timeout=60) == 3
        _, err = agent.communicate()
        assert err.strip().splitlines() == [
            "spotline agent m3: lost the coordinator (its store did not answer for 1 s); "
            "stopped 1 worker(s), exiting"
        ]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        agent.kill()
        agent.communicate()


def test_an_agent_without_a_coordinator_says_so_in_one_line(tmp_path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens on it
    agent = _agent(port, "m4", tmp_path / "logs", "--lost-after", "1")
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 3
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"spotline agent m4: cannot reach the coordinator at 127.0.0.1:{port}")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--join", "nowhere", "--slots", "1"], "--join 'nowhere' is not HOST:PORT"),
        (["--join", "127.0.0.1:1", "--slots", "0"], "--slots 0: a machine has at least one slot"),
    ],
)
def test_bad_agent_flags_are_one_line_and_exit_2(flags, message) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "spotline.launch.cli", "agent", *flags],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"spotline agent: error: {proc.stderr.split('error: ', 1)[1].strip()}"
    ]
    assert message in proc.stderr
