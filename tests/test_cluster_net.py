"""Machines as network namespaces on one bridge (tests/netns.py): the fixture itself, and
gloo between namespaces bound to each machine's own interface (spotline.wire.net)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import netns
import pytest
from components import ALLOW_ENV, missing
from conftest import REPO, child_env

# netns_cluster is a fixture: importing it makes it available to this module's tests.
from netns import PREFIX, Machine, cluster, netns_cluster, our_names  # noqa: F401

WORKER = Path(__file__).parent / "workers" / "netns_worker.py"
PORT = 29500  # each namespace has its own ports: no clash with other runs
# How long the survivor of a silent loss is watched: it must still be blocked after it.
SILENT_BOUND_S = 3.0


def test_fixture_leaves_nothing_behind_even_when_the_body_raises() -> None:
    with cluster(2) as machines:
        tag = machines[0].tag
        assert [m.address for m in machines] == ["10.77.0.1", "10.77.0.2"]
        assert {m.name for m in machines} <= set(our_names())
        sleeper = machines[1].popen(["sleep", "600"])
    assert sleeper.returncode is not None
    assert not [n for n in our_names() if n.startswith(tag)]

    with pytest.raises(RuntimeError, match="body failed"), cluster(1) as machines:
        tag = machines[0].tag
        sleeper = machines[0].popen(["sleep", "600"])
        raise RuntimeError("body failed")
    assert sleeper.returncode is not None
    assert not [n for n in our_names() if n.startswith(tag)]


def test_a_sigterm_to_the_owner_still_removes_everything_it_made(tmp_path: Path) -> None:
    # A bench killed with SIGTERM (a `kill`, a CI's stop) once left its machines and their
    # processes running: the teardown ran only on an exception or Ctrl-C.
    if os.geteuid() != 0 or shutil.which("ip") is None:
        missing("netns", "network namespaces: needs root and `ip`")
    ready = tmp_path / "ready"
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import pathlib, sys, time\n"
         "from spotline.launch.bench.netns import cluster\n"
         "with cluster(1) as machines:\n"
         "    sleeper = machines[0].popen(['sleep', '600'])\n"
         "    pathlib.Path(sys.argv[1]).write_text(f'{machines[0].tag} {sleeper.pid}')\n"
         "    time.sleep(600)\n",
         str(ready)],
        cwd=REPO, env=child_env(),
    )  # fmt: skip
    try:
        for _ in range(600):  # a bound on the test, not a timing claim
            if ready.exists() and ready.read_text():
                break
            assert owner.poll() is None
            time.sleep(0.1)
        tag, pid = ready.read_text().split()
        owner.terminate()
        assert owner.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        owner.kill()
        owner.wait()
    assert not [n for n in our_names() if n.startswith(tag)]
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)


def test_without_root_the_cluster_fails_with_one_reason_line_or_skips_if_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Not root is simulated: the test itself runs as root wherever the others run.
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match="needs root") as failed, cluster(1):
        pass
    assert f"{ALLOW_ENV}=netns" in str(failed.value) and "\n" not in str(failed.value)
    monkeypatch.setenv(ALLOW_ENV, "etcd,netns")
    with pytest.raises(pytest.skip.Exception, match="needs root") as info, cluster(1):
        pass
    assert "\n" not in str(info.value)


def test_start_sweeps_a_dead_runs_leftovers_and_keeps_a_live_runs() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        missing("netns", "network namespaces: needs root and `ip`")
    finished = subprocess.Popen(["true"])
    finished.wait()  # its pid now names a run that was killed
    dead = f"{PREFIX}{finished.pid:x}c0"
    live = f"{PREFIX}{os.getpid():x}c999"  # this process's: as if another cluster were open
    made = [("netns", f"{dead}n0"), ("link", f"{dead}b"), ("link", f"{live}b")]
    try:
        for kind, name in made:
            args = (
                ["netns", "add", name]
                if kind == "netns"
                else ["link", "add", name, "type", "bridge"]
            )
            subprocess.run(["ip", *args], check=True)
        with cluster(1):
            names = set(our_names())
            assert f"{dead}n0" not in names and f"{dead}b" not in names
            assert f"{live}b" in names
    finally:
        subprocess.run(["ip", "netns", "delete", f"{dead}n0"], capture_output=True, check=False)
        for name in (f"{dead}b", f"{live}b"):
            subprocess.run(["ip", "link", "delete", name], capture_output=True, check=False)


def test_fixture_gives_machines_that_reach_each_other(netns_cluster: Any) -> None:  # noqa: F811
    server, client = netns_cluster(2)
    listen = f"import socket; s = socket.create_server(({server.address!r}, 7)); print(1, flush=True); s.accept()"
    connect = (
        f"import socket; socket.create_connection(({server.address!r}, 7), timeout=30).close()"
    )
    listener = server.popen([sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True)
    assert listener.stdout is not None and listener.stdout.readline() == "1\n"
    assert client.popen([sys.executable, "-c", connect]).wait() == 0
    assert listener.wait() == 0


def _report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"worker exited with {proc.wait()} before reporting"
    report: dict[str, Any] = json.loads(line)
    return report


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_gloo_across_namespaces_and_a_cut_link_is_a_silent_loss() -> None:
    def start(machine: Machine, *args: str, stdin: int | None = None) -> subprocess.Popen[str]:
        return machine.popen(
            [sys.executable, str(WORKER), *args],
            cwd=REPO,
            env=child_env(),
            stdin=stdin,
            stdout=subprocess.PIPE,
            text=True,
        )

    with cluster(3) as (coordinator, one, two):
        tag = coordinator.tag
        store = start(coordinator, "store", coordinator.address, str(PORT))
        assert store.stdout is not None and store.stdout.readline() == "ready\n"
        a = start(one, "rank", "0", one.iface, coordinator.address, str(PORT))
        b = start(two, "rank", "1", two.iface, coordinator.address, str(PORT), "--hold",
                  stdin=subprocess.PIPE)  # fmt: skip
        reports = [_report(a), _report(b)]

        expected = [3 * i for i in range(8)]  # arange(8) * 1 + arange(8) * 2
        for report, me, peer in ((reports[0], one, two), (reports[1], two, one)):
            assert report["sum"] == expected
            assert (report["ip"], report["ifname"]) == (me.address, me.iface)
            assert report["master_addr"] == coordinator.address
            connections = {tuple(c) for c in report["connections"]}
            # The rendezvous went to the coordinator's member address, from this machine's.
            assert (me.address, coordinator.address, PORT) in {
                (c[0], c[2], c[3]) for c in connections
            }
            # Gloo's own connections: every one between the two members' addresses, none
            # on loopback (gloo would have picked it had it bound to the host name's guess).
            gloo = {(c[0], c[2]) for c in connections if PORT not in (c[1], c[3])}
            assert gloo == {(me.address, peer.address)}, connections

        # `one` is now blocked in a second all-reduce that `two` never joins; `two`'s machine
        # vanishes from the network. Nothing tells `one`: it stays blocked (the silent loss
        # the agents' heartbeat must detect).
        two.link_down()
        with pytest.raises(subprocess.TimeoutExpired):
            a.wait(timeout=SILENT_BOUND_S)
        assert a.poll() is None
        a.kill()
        assert a.wait() == -9
        procs = [store, a, b]
    assert all(p.returncode is not None for p in procs)
    assert not [n for n in our_names() if n.startswith(tag)]
