"""Spotline on a cluster of machines built on this one (network namespaces, tests/netns.py):
``spotline coordinator`` in one namespace, ``spotline agent`` in each of the others, every
worker bound to its machine's own address. Real processes, real kills of whole machines;
each run ends with the undisturbed run's ``param_sha256`` and every step's loss.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, child_env, read_summary, run_spotline, small_config, write_config
from netns import Machine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 6
# Dropout on (gpt2-tiny's default): the takeover must also reproduce the dropout masks.
CONFIG = small_config(training={"steps": STEPS}, redundancy={"mode": "lazy"})
TOPOLOGY = ("--workers", "4", "--stages", "2")
JOIN = re.compile(r"--join (\S+:\d+)")


def _wait_for(path: Path, pattern: str, procs: list[subprocess.Popen[str]], limit_s: float) -> str:
    """The first match of ``pattern`` in ``path``; a bound on the test, not a timing claim."""
    deadline = time.monotonic() + limit_s
    while True:
        text = path.read_text() if path.exists() else ""
        found = re.search(pattern, text)
        if found:
            return found.group(0)
        assert all(p.poll() is None for p in procs), text[-3000:]
        assert time.monotonic() < deadline, f"no {pattern!r} in {path}: {text[-3000:]}"
        time.sleep(0.1)


def _kill_machine(machine: Machine) -> None:
    """A preemption that takes the whole machine at once: every process in it, SIGKILL."""
    pids = subprocess.run(
        ["ip", "netns", "pids", machine.name], capture_output=True, text=True, check=True
    ).stdout.split()
    assert pids, f"nothing runs on {machine.name}"
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_whole_machine_killed_mid_step_is_taken_over_in_memory(
    netns_cluster, tmp_path: Path
) -> None:
    """4 machines x 1 slot, 2 stages x 2 pipelines: every process of one machine (its agent
    and its worker) SIGKILLed mid-step. The survivors take its stage over from memory and
    the run ends with the undisturbed run's hash and losses; no checkpoint is read."""
    cfg = write_config(tmp_path / "c.json", CONFIG)
    baseline = run_spotline(
        ["train", "--config", str(cfg), "--output", str(tmp_path / "base"), *TOPOLOGY]
    )
    assert baseline.returncode == 0, baseline.stderr[-3000:]
    expected = read_summary(tmp_path / "base")

    coordinator_host, *hosts = netns_cluster(5)
    out = tmp_path / "out"
    err = tmp_path / "coordinator.err"
    with open(err, "w") as err_file:
        coordinator = coordinator_host.popen(
            [sys.executable, "-m", "spotline.launch.cli", "coordinator", "--config", str(cfg)]
            + [*TOPOLOGY, "--output", str(out), "--listen", f"{coordinator_host.address}:0"],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            text=True,
        )
    join = JOIN.search(_wait_for(err, r"--join \S+:\d+", [coordinator], 300)).group(1)
    assert join.startswith(f"{coordinator_host.address}:")  # never 127.0.0.1 across machines
    agents = [
        host.popen(
            [sys.executable, "-m", "spotline.launch.cli", "agent", "--join", join]
            + ["--slots", "1", "--name", f"m{i}", "--iface", host.iface]
            + ["--logs", str(out / "agents" / f"m{i}")],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, host in enumerate(hosts, start=1)
    ]
    _wait_for(err, r"spotline: step 2/", [coordinator], 600)
    _kill_machine(hosts[1])  # m2: its agent and its worker
    assert coordinator.wait(timeout=600) == 0, err.read_text()[-3000:]
    summary = read_summary(out)
    assert summary["param_sha256"] == expected["param_sha256"]
    assert summary["losses"] == expected["losses"]
    assert summary["checkpoint_fallbacks"] == 0  # in memory, not from disk
    assert summary["recoveries"] >= 1 and summary["preemptions"] == 1
    assert any(e["kind"] == "machine-lost" and e["machine"] == "m2" for e in summary["events"])
    for i, agent in enumerate(agents, start=1):
        code = agent.wait(timeout=120)
        if i != 2:
            assert code == 0, agent.communicate()[1]
