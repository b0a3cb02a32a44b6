"""``spotline agent`` as a real process against a real store: it registers its machine,
starts the workers it is ordered to (forked by its spawner), delivers signals, reports every
exit, leaves on a preemption notice, and stops its workers when the coordinator is lost or
fences it. Without the job token, or with a wrong one, it is refused; orders not sealed
with the token are ignored.

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

from spotline.launch.control.machines import NO_TOKEN, WRONG_TOKEN, Machines
from spotline.wire.agent_messages import MachineInfo, Order
from spotline.wire.auth import AuthStore, JobToken
from spotline.wire.protocol import (
    agent_done_key,
    exit_key,
    order_counter_key,
    order_key,
)

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


TOKEN = JobToken(bytes(range(32)))


def _token_file(tmp_path: Path, token: JobToken = TOKEN) -> str:
    path = tmp_path / f"token-{token.text()[:8]}"
    path.write_text(token.text())
    return str(path)


def _server() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )


@pytest.fixture()
def store() -> Iterator[AuthStore]:
    server = _server()
    yield AuthStore(server, TOKEN)


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
    agent = _agent(store.inner.port, "m1", tmp_path / "logs", "--token-file", _token_file(tmp_path))
    try:
        machines = Machines(store)
        info = _joined(machines, agent)
        assert (info.name, info.slots, info.address) == ("m1", 2, "127.0.0.1")
        # Someone without the token orders a start: the agent ignores it.
        n = store.add(order_counter_key("m1"), 1)
        store.inner.set(order_key("m1", n), Order.start("w9", "agent_child", ("sleep",)).encode())
        done = machines.start("m1", "w0", "agent_child", ["exit", "5"])
        sleeper = machines.start("m1", "w1", "agent_child", ["sleep"])
        assert done.wait(timeout=60) == 5
        assert sleeper.poll() is None
        sleeper.kill()
        assert sleeper.wait(timeout=60) == -signal.SIGKILL
        assert machines.last_heartbeat("m1") is not None
        log = (tmp_path / "logs" / "w0.log").read_text()
        # The worker was handed the job token.
        assert f"machine m1 argv ['exit', '5'] token {TOKEN.text()}" in log
        assert not (tmp_path / "logs" / "w9.log").exists()
        # A forged exit status is not taken for the worker's.
        store.inner.set(exit_key("w1"), "0")
        assert machines.start("m1", "w1b", "agent_child", ["exit", "7"]).wait(timeout=60) == 7
        assert sleeper.poll() == -signal.SIGKILL
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


def test_an_agent_exits_when_the_job_ends_even_if_the_store_goes_at_once(tmp_path) -> None:
    server = _server()
    store = AuthStore(server, TOKEN)
    token = _token_file(tmp_path)
    agent = _agent(server.port, "m2", tmp_path / "logs", "--token-file", token)
    stopped = _agent(server.port, "m3", tmp_path / "logs3", "--token-file", token)
    try:
        machines = Machines(store)
        while len(machines.joined) < 2:
            assert agent.poll() is None and stopped.poll() is None
            machines.refresh()
            time.sleep(0.02)
        w = machines.start("m2", "w0", "agent_child", ["exit", "0"])
        assert w.wait(timeout=60) == 0
        stopped.send_signal(signal.SIGSTOP)  # a machine cut off: its heartbeat stands still
        # end_job returns once m2's agent said it is done, not waiting for m3's...
        assert machines.end_job() == ["m3"]
        assert store.check([agent_done_key("m2")])
        # ... so the store may go at once (a TCPStore goes with the coordinator's process):
        # the agent had read the job's end, and does not take it for a lost coordinator.
        del machines, store, server
        assert agent.wait(timeout=60) == 0, agent.communicate()
    finally:
        for proc in (agent, stopped):
            proc.kill()
            proc.communicate()


def test_agents_without_the_token_are_refused_and_a_fenced_one_stops_its_workers(
    store, tmp_path
) -> None:
    """No token and a wrong token: refused, one line each, exit 2, never joined. A machine
    declared lost (fenced) stops its workers and exits 4 with one line; the same name
    joining again is a new machine (``m5#2``)."""
    refused: list[str] = []
    machines = Machines(store, on_refused=refused.append)
    wrong = JobToken(bytes(32))
    bare = _agent(store.inner.port, "rogue", tmp_path / "l1")
    forger = _agent(
        store.inner.port, "forger", tmp_path / "l2", "--token-file", _token_file(tmp_path, wrong)
    )
    fenced = _agent(store.inner.port, "m5", tmp_path / "l3", "--token-file", _token_file(tmp_path))
    try:
        while len(refused) < 2 or not machines.joined:
            assert fenced.poll() is None, fenced.communicate()
            machines.refresh()
            time.sleep(0.02)
        assert list(machines.joined) == ["m5"]
        assert sorted(refused) == [
            f"machine 'forger' (registration {_nth(machines, 'forger')}): {WRONG_TOKEN}",
            f"machine 'rogue' (registration {_nth(machines, 'rogue')}): {NO_TOKEN}",
        ]
        for proc, name, fix in [
            (bare, "rogue", "this job needs its token; pass the coordinator's job-token file"),
            (forger, "forger", "is not this job's token; copy the coordinator's job-token file"),
        ]:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 2
            (line,) = err.strip().splitlines()
            assert line.startswith(f"spotline agent {name}: refused by the coordinator (")
            assert fix in line
        machines.start("m5", "w0", "agent_child", ["sleep"])
        log = tmp_path / "l3" / "w0.log"
        _wait_started(log, fenced)
        pid = int(log.read_text().split()[1])
        machines.fence("m5")
        assert fenced.wait(timeout=60) == 4
        _, err = fenced.communicate()
        assert err.strip().splitlines() == [
            "spotline agent m5: the coordinator declared this machine lost while it was cut "
            "off and replaced its work; stopped 1 worker(s), exiting (start the agent again "
            "to rejoin as a new machine)"
        ]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        again = _agent(
            store.inner.port, "m5", tmp_path / "l4", "--token-file", _token_file(tmp_path)
        )
        try:
            while len(machines.joined) < 2:
                assert again.poll() is None, again.communicate()
                machines.refresh()
                time.sleep(0.02)
            assert list(machines.joined) == ["m5", "m5#2"]
            assert machines.placeable() == ["m5#2"]
        finally:
            again.kill()
            again.communicate()
    finally:
        for proc in (bare, forger, fenced):
            proc.kill()
            proc.communicate()


def _nth(machines: Machines, name: str) -> int:
    """The registration number of the agent that claimed ``name``."""
    import json

    from spotline.wire.auth import unsealed_payload
    from spotline.wire.protocol import machine_key

    for n in range(1, 10):
        raw = machines.store.inner.get(machine_key(n))
        if json.loads(unsealed_payload(raw))["name"] == name:
            return n
    raise AssertionError(name)


def test_an_agent_that_loses_its_coordinator_stops_its_workers_and_says_so(tmp_path) -> None:
    server = _server()
    agent = _agent(
        server.port,
        "m3",
        tmp_path / "logs",
        "--lost-after",
        "1",
        "--token-file",
        _token_file(tmp_path),
    )
    try:
        machines = Machines(AuthStore(server, TOKEN))
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


def test_an_agent_whose_registration_nobody_answers_says_so_not_that_its_token_is_wrong(
    tmp_path,
) -> None:
    # The store is up and takes the registration, but no coordinator reads it (one busy or
    # stopped mid-run): the cause is the silence, not the token (it once said the token).
    server = _server()
    agent = _agent(
        server.port, "m6", tmp_path / "logs", "--lost-after", "1",
        "--token-file", _token_file(tmp_path),
    )  # fmt: skip
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 3
    (line,) = err.strip().splitlines()
    assert line.startswith(
        f"spotline agent m6: the coordinator at 127.0.0.1:{server.port} took this machine's "
        "registration but did not answer it within 1 s"
    ), line
    assert "token" not in line


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
