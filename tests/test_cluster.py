"""Spotline on a cluster of machines built on this one (network namespaces, tests/netns.py):
``spotline coordinator`` in one namespace, ``spotline agent`` in each of the others, every
worker bound to its machine's own address. Real processes, real kills of whole machines;
each run ends with the undisturbed run's ``param_sha256`` and every step's loss.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from components import missing
from conftest import REPO, child_env, read_summary, small_config, write_config
from netns import Machine

from spotline.checkpointing.checkpoint import latest_complete
from spotline.wire.stores import ETCD_BINARY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Long enough for a run to see an arrival, a silent loss, a fence and a notice one after the
# other (a step of this tiny model takes a fraction of a second).
STEPS = 200
# Dropout on (gpt2-tiny's default): the takeover must also reproduce the dropout masks. A
# machine is declared lost after 4 s without its agent's heartbeat.
# Collectives time out after 20 s, not 60: what a hung peer costs. A machine cut off while
# its generation sets up costs its peers at most 10 s (spotline.pipeline.group_setup; see the
# silent-loss test).
CONFIG = small_config(
    training={"steps": STEPS},
    redundancy={"mode": "lazy"},
    recovery={"heartbeat_timeout_s": 4, "collective_timeout_s": 20},
)
TOPOLOGY = ("--workers", "4", "--stages", "2")
JOIN = re.compile(r"--join (\S+:\d+)")


class Baseline:
    """The undisturbed run (``spotline train`` on one machine) every cluster run of this
    topology must match; it runs alongside the first cluster run (which mostly waits)."""

    def __init__(
        self, tmp: Path, config: dict[str, Any] = CONFIG, topology: tuple[str, ...] = TOPOLOGY
    ) -> None:
        # The reference is not under test, and it shares two cores with a cluster run: a
        # heartbeat timeout of 4 s on it would only add a way for the reference to fail (the
        # timeouts decide no bit of the result).
        recovery = {**config["spotline"].get("recovery", {}), "heartbeat_timeout_s": 30}
        config = {**config, "spotline": {**config["spotline"], "recovery": recovery}}
        cfg = write_config(tmp / "c.json", config)
        self.out = tmp / "base"
        self.err = open(tmp / "base.err", "w")  # noqa: SIM115 - closed in result()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spotline.launch.cli", "train", "--config", str(cfg)]
            + ["--output", str(self.out), *topology],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=self.err,
        )
        self.summary: dict[str, Any] | None = None

    def stop(self) -> None:
        """A test that failed before needing it: Ctrl-C, which stops its agent and workers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()

    def result(self) -> dict[str, Any]:
        if self.summary is None:
            code = self.proc.wait(timeout=600)
            self.err.close()
            assert code == 0, Path(self.err.name).read_text()[-3000:] + _log_tails(self.out)
            self.summary = read_summary(self.out)
        return self.summary


def _log_tails(out: Path, lines: int = 8) -> str:
    """The last lines of every worker's log under ``out`` (what a failed run's message needs
    where its logs are gone with the machine that ran it)."""
    tails = []
    for log in sorted((out / "logs").glob("w*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n" + "\n".join(tails)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Baseline]:
    run = Baseline(tmp_path_factory.mktemp("baseline"))
    try:
        yield run
    finally:
        run.stop()


def _wait_for(
    path: Path,
    pattern: str,
    procs: list[subprocess.Popen[str]],
    limit_s: float,
    poll_s: float = 0.1,
) -> str:
    """The first match of ``pattern`` in ``path``; a bound on the test, not a timing claim."""
    deadline = time.monotonic() + limit_s
    while True:
        text = path.read_text() if path.exists() else ""
        found = re.search(pattern, text)
        if found:
            return found.group(0)
        assert all(p.poll() is None for p in procs), text[-3000:]
        assert time.monotonic() < deadline, f"no {pattern!r} in {path}: {text[-3000:]}"
        time.sleep(poll_s)


def _coordinator(
    host: Machine, cfg: Path, out: Path, topology: tuple[str, ...]
) -> tuple[subprocess.Popen[str], Path, str]:
    """``spotline coordinator`` on ``host``; returns it, its stderr file and its --join."""
    err = out.parent / f"{out.name}.coordinator.err"
    with open(err, "w") as err_file:
        proc = host.popen(
            [sys.executable, "-m", "spotline.launch.cli", "coordinator", "--config", str(cfg)]
            + [*topology, "--output", str(out), "--listen", f"{host.address}:0"],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            text=True,
        )
    join = JOIN.search(_wait_for(err, r"--join \S+:\d+", [proc], 300))
    assert join is not None
    assert join.group(1).startswith(f"{host.address}:")  # never 127.0.0.1 across machines
    return proc, err, join.group(1)


def _agent(
    host: Machine, join: str, name: str, out: Path, *extra: str, slots: int = 1
) -> subprocess.Popen[str]:
    return host.popen(
        [sys.executable, "-m", "spotline.launch.cli", "agent", "--join", join]
        + ["--slots", str(slots), "--name", name, "--iface", host.iface]
        + ["--logs", str(out / "agents" / name), *extra],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _token(out: Path) -> tuple[str, str]:
    return ("--token-file", str(out / "job-token"))


def _one_line(proc: subprocess.Popen[str], code: int) -> str:
    """A process that must exit ``code`` with exactly one line on stderr: that line."""
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_silent_loss_fencing_arrival_notice_and_intruders_in_one_run(
    netns_cluster, baseline, tmp_path: Path
) -> None:
    """One run of 4 machines x 1 slot (2 stages x 2 pipelines), and on the way:

    - two intruders try to join, one with no token and one with a wrong token: refused, one
      line each, never in a plan;
    - a fifth machine, up before its network is, joins mid-run when its link comes up: its
      worker is used from the next step boundary (its state sent from live machines);
    - one machine's link is cut (its processes keep running): declared lost within the
      heartbeat timeout and taken over in memory; its link restored: it is fenced, its agent
      stops its worker and says so, and nothing it writes is acted on;
    - SIGTERM to another machine's agent (a cloud's preemption notice): its worker leaves at
      a step boundary and the agent exits 0.

    The run ends with the undisturbed run's hash and every step's loss; no checkpoint is read.
    """
    cfg = write_config(tmp_path / "c.json", CONFIG)
    coordinator_host, *hosts = netns_cluster(6)
    out = tmp_path / "out"
    coordinator, err, join = _coordinator(coordinator_host, cfg, out, TOPOLOGY)
    live = [coordinator]
    agents = {
        # --lost-after 300: m2's agent, cut off, must learn it was fenced when its link
        # returns, whatever the wait (not give the coordinator up first).
        f"m{i}": _agent(host, join, f"m{i}", out, *_token(out), "--lost-after", "300")
        for i, host in enumerate(hosts[:4], start=1)
    }
    # The intruders run on the coordinator's machine: they reach its store as well as any.
    wrong = tmp_path / "wrong-token"
    wrong.write_text("ab" * 32)
    no_token = _agent(coordinator_host, join, "intruder1", tmp_path / "i1")
    wrong_token = _agent(
        coordinator_host, join, "intruder2", tmp_path / "i2", "--token-file", str(wrong)
    )
    # The fifth machine boots with its link down: its agent imports while it waits for it.
    hosts[4].link_down()
    agents["m5"] = _agent(hosts[4], join, "m5", out, *_token(out), "--lost-after", "300")
    assert "this job needs its token" in _one_line(no_token, 2)
    assert "is not this job's token" in _one_line(wrong_token, 2)
    _wait_for(out / "agents" / "m5" / "spawner.log", r"spawner: ready", live, 300)

    _wait_for(err, r"spotline: step \d+/", live, 600)
    hosts[4].link_up()  # m5 arrives mid-run
    arrived = _wait_for(err, r"arrived \{'worker': '(w\d+)', 'machine': 'm5'\}", live, 300)
    newcomer = re.search(r"'(w\d+)'", arrived).group(1)  # type: ignore[union-attr]
    # Cut at once when the newcomer's generation is planned, while its members set it up
    # (group rendezvous, subgroups, state sent): m2's peers are then blocked in gloo's
    # connects and store waits, not in a collective, and must be freed all the same.
    _wait_for(err, rf"joined \{{'worker': '{newcomer}'\}}[\s\S]*plan ", live, 300, poll_s=0.005)
    hosts[1].link_down()  # m2 goes silent: no FIN, no RST
    # No reset reaches anyone: only the heartbeat timeout reveals it.
    silent = r"machine-lost \{'machine': 'm2', 'evidence': 'silent'\}"
    _wait_for(err, silent, live, 300)
    hosts[1].link_up()  # back at once: its agent must find itself fenced, not the store gone
    # m3's preemption notice, while the generation m2's loss failed is wound up: its worker
    # may report and leave before its heartbeat says so, and must still count as a departure.
    agents["m3"].send_signal(signal.SIGTERM)
    fenced = _one_line(agents.pop("m2"), 4)
    assert fenced.startswith("spotline agent m2: the coordinator declared this machine lost")
    assert coordinator.wait(timeout=600) == 0, err.read_text()[-3000:]
    for name, agent in agents.items():
        assert agent.wait(timeout=120) == 0, (name, agent.communicate()[1])

    summary = read_summary(out)
    expected = baseline.result()
    assert summary["param_sha256"] == expected["param_sha256"]
    assert summary["losses"] == expected["losses"]
    assert summary["checkpoint_fallbacks"] == 0  # in memory, not from disk
    kinds = [(e["kind"], e.get("machine") or e.get("worker")) for e in summary["events"]]
    assert ("machine-lost", "m2") in kinds and ("machine-joined", "m5") in kinds
    refused = [e["what"] for e in summary["events"] if e["kind"] == "refused"]
    assert sorted(w.split(" (")[0] for w in refused) == [
        "machine 'intruder1'",
        "machine 'intruder2'",
    ]
    leaving = [e["worker"] for e in summary["events"] if e["kind"] == "leaving"]
    assert len(leaving) == 1  # m3's worker, at a boundary: a departure, not a failure
    assert summary["preemptions"] == 2  # m2 (silent) and m3 (notice)
    assert summary["recoveries"] == 1  # only m2's loss was a failure
    # No survivor waited on m2 until it was taken for hung (spotline.pipeline.group_setup): m2's link
    # is cut while the arrival's generation sets up.
    assert not [e for e in summary["events"] if e["kind"] == "unresponsive"], summary["events"]
    assert summary["exposed_stages"] == []


def test_two_machines_of_two_slots_one_machine_lost_is_recovered_on_the_other(
    netns_cluster, tmp_path: Path
) -> None:
    """2 machines x 2 slots, 4 stages in one pipeline (lazy redundancy: each stage's replica
    on its predecessor's worker). The plan puts no stage and its replica on one machine
    (asserted on every plan published); every process of one machine SIGKILLed mid-run:
    the other machine's two workers hold every stage and take over in memory."""
    config = {**CONFIG, "spotline": {**CONFIG["spotline"], "training": {"steps": 40, "seed": 7}}}
    topology = ("--workers", "4", "--stages", "4")
    (tmp_path / "base").mkdir()
    baseline = Baseline(tmp_path / "base", config, topology)  # alongside the cluster run
    try:
        _two_by_two(netns_cluster, tmp_path, config, topology, baseline)
    finally:
        baseline.stop()


def _two_by_two(
    netns_cluster: Any,
    tmp_path: Path,
    config: dict[str, Any],
    topology: tuple[str, ...],
    baseline: Baseline,
) -> None:
    cfg = write_config(tmp_path / "c.json", config)
    coordinator_host, *hosts = netns_cluster(3)
    out = tmp_path / "out"
    coordinator, err, join = _coordinator(coordinator_host, cfg, out, topology)
    agents = [
        _agent(host, join, f"m{i}", out, *_token(out), slots=2)
        for i, host in enumerate(hosts, start=1)
    ]
    _wait_for(err, r"spotline: step \d+/", [coordinator], 600)
    assert hosts[1].kill_everything() > 0  # m2: its agent and both its workers
    assert coordinator.wait(timeout=600) == 0, err.read_text()[-3000:]
    summary = read_summary(out)
    expected = baseline.result()
    assert summary["param_sha256"] == expected["param_sha256"]
    assert summary["losses"] == expected["losses"]
    assert summary["checkpoint_fallbacks"] == 0  # in memory, not from disk
    assert summary["preemptions"] == 2 and summary["recoveries"] == 1
    (lost,) = [e for e in summary["events"] if e["kind"] == "machine-lost"]
    assert lost == {**lost, "machine": "m2", "evidence": "refused"}  # its agent's port refused
    # The first plan (two machines) exposed no stage; only the one after the loss did, on
    # the one machine left, where it cannot be helped, and the summary says so.
    assert summary["exposed_generations"] == 1
    assert summary["exposed_stages"] == [{"stage": s, "machine": "m1"} for s in range(4)]
    assert agents[0].wait(timeout=120) == 0, agents[0].communicate()[1]


def _etcd(host: Machine, data: Path) -> str:
    """A one-member etcd on ``host`` (its own machine, as a user's would be); its endpoint."""
    etcd = shutil.which(ETCD_BINARY)
    if etcd is None:
        missing("etcd", f"{ETCD_BINARY} is absent: apt-get install -y etcd-server")
    client = f"http://{host.address}:2379"
    peer = "http://127.0.0.1:2380"  # its own loopback: nobody else's
    host.popen(
        [etcd, "--name=e", f"--data-dir={data}", f"--listen-client-urls={client}"]
        + [f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}"]
        + [f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=e={peer}"]
        + ["--log-level=warn", "--logger=zap"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return f"{host.address}:2379"


def test_a_machine_killed_then_the_coordinator_killed_and_restarted_over_etcd(
    netns_cluster, baseline, tmp_path: Path
) -> None:
    """etcd on its own machine, the coordinator on another, 4 machines x 1 slot (2 stages x
    2 pipelines). Every process of one machine (its agent and its worker) is SIGKILLed
    mid-step: the survivors take its stage over from memory. Then the coordinator is
    SIGKILLed: the workers train on without it (they need it only at a generation change);
    started again with the same --output it takes the running generation over. The job
    ends with the undisturbed run's hash and every step's loss; no checkpoint is read."""
    cfg = write_config(tmp_path / "c.json", CONFIG)
    etcd_host, coordinator_host, *hosts = netns_cluster(6)
    endpoint = _etcd(etcd_host, tmp_path / "etcd")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "spotline.launch.cli", "coordinator", "--config", str(cfg)]
    argv += [*TOPOLOGY, "--output", str(out), "--listen", f"{coordinator_host.address}:0"]
    argv += ["--store", "etcd", "--etcd-endpoint", endpoint]

    def start(err: Path) -> subprocess.Popen[str]:
        with open(err, "w") as err_file:
            return coordinator_host.popen(
                argv,
                cwd=REPO,
                env=child_env(),
                stdout=subprocess.DEVNULL,
                stderr=err_file,
                text=True,
            )

    first_err, second_err = tmp_path / "first.err", tmp_path / "second.err"
    first = start(first_err)
    join = _wait_for(first_err, r"--join etcd://\S+", [first], 300).split()[1]
    agents = [_agent(host, join, f"m{i}", out, *_token(out)) for i, host in enumerate(hosts, 1)]
    _wait_for(first_err, r"spotline: step \d+", [first], 600)
    assert hosts[1].kill_everything() > 0  # m2: its agent and its worker
    # Its kernel still answers: its agent's liveness port refuses, so the machine is lost at
    # once (the heartbeat timeout is 5 s), not when its heartbeats are overdue.
    lost = _wait_for(first_err, r"machine-lost \{'machine': 'm2'.*", [first], 300)
    assert "'evidence': 'refused'" in lost, lost
    _wait_for(first_err, r"machine-lost[\s\S]*recovered ", [first], 300)
    killed_at = int(re.findall(r"step (\d+)/", first_err.read_text())[-1])  # shown so far
    first.kill()
    first.wait()
    second = start(second_err)
    assert second.wait(timeout=600) == 0, second_err.read_text()[-3000:]
    summary = read_summary(out)
    expected = baseline.result()
    assert summary["param_sha256"] == expected["param_sha256"]
    assert summary["losses"] == expected["losses"]
    assert summary["checkpoint_fallbacks"] == 0  # in memory, not from disk
    (adopted,) = [e for e in summary["events"] if e["kind"] == "adopted"]
    # The workers trained on while no coordinator ran, in the generation the first one had
    # planned after the loss (m2 stays fenced: 3 workers on the 4 machines that joined).
    assert adopted["generation"] == 1 and adopted["step"] > killed_at
    assert adopted["workers"] == 3 and adopted["machines"] == 4
    assert summary["recoveries"] == 0 and summary["preemptions"] == 0  # none since then
    for i, agent in enumerate(agents, start=1):
        code = agent.wait(timeout=120)
        if i != 2:
            assert code == 0, agent.communicate()[1]
    assert not (out / "job.json").exists()  # nothing left for a third one to take over


def test_the_tcp_coordinator_killed_stops_every_machine_then_the_job_resumes_from_its_checkpoint(
    netns_cluster, baseline, tmp_path: Path
) -> None:
    """The TCP store lives in the coordinator: SIGKILL it (2 machines x 2 slots, 2 stages x
    2 pipelines) and every worker and agent stops within its timeout with one line, leaving
    no process on any machine. ``spotline coordinator --resume`` with new agents continues
    from the last checkpoint and ends with the undisturbed run's hash and every step's loss."""
    config = {**CONFIG, "spotline": {**CONFIG["spotline"], "checkpoints": {"interval_steps": 10}}}
    cfg = write_config(tmp_path / "c.json", config)
    coordinator_host, *hosts = netns_cluster(3)
    out = tmp_path / "out"
    coordinator, err, join = _coordinator(coordinator_host, cfg, out, TOPOLOGY)
    lost_after = ("--lost-after", "10")
    agents = [
        _agent(host, join, f"m{i}", out, *_token(out), *lost_after, slots=2)
        for i, host in enumerate(hosts, start=1)
    ]
    deadline = time.monotonic() + 600  # a bound on the test, not a timing claim
    while latest_complete(out / "checkpoints") is None:  # the step-10 checkpoint committed
        assert coordinator.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.1)
    coordinator.kill()
    coordinator.wait()
    for i, agent in enumerate(agents, start=1):
        line = _one_line(agent, 3)  # EXIT_COORDINATOR_LOST, within --lost-after
        assert line.startswith(f"spotline agent m{i}: lost the coordinator"), line
    for host in hosts:
        assert host.pids() == [], f"processes left on {host.name}"  # no orphan
    logs = sorted((out / "agents").glob("m*/w*.log"))
    assert len(logs) == 4
    for log in logs:
        text = log.read_text()
        said = [ln for ln in text.splitlines() if "lost the coordinator" in ln]
        assert len(said) == 1 and said[0].startswith(f"spotline worker {log.stem}: "), text[-2000:]
        assert "Traceback" not in text, text[-3000:]

    argv = [sys.executable, "-m", "spotline.launch.cli", "coordinator", "--resume", str(out)]
    argv += ["--listen", f"{coordinator_host.address}:0"]
    resumed_err = tmp_path / "resumed.err"
    with open(resumed_err, "w") as err_file:
        resumed = coordinator_host.popen(
            argv, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=err_file, text=True
        )
    join = JOIN.search(_wait_for(resumed_err, r"--join \S+:\d+", [resumed], 300))
    assert join is not None
    agents = [
        _agent(host, join.group(1), f"m{i}", out, *_token(out), slots=2)
        for i, host in enumerate(hosts, start=1)
    ]
    assert resumed.wait(timeout=600) == 0, resumed_err.read_text()[-3000:]
    summary = read_summary(out)
    expected = baseline.result()
    assert summary["resumed_from_step"] % 10 == 0 and summary["resumed_from_step"] > 0
    assert summary["param_sha256"] == expected["param_sha256"]
    assert summary["losses"] == expected["losses"]
    for agent in agents:
        assert agent.wait(timeout=120) == 0, agent.communicate()[1]


def test_a_job_started_on_fewer_machines_loses_them_all_and_restores_on_a_new_one(
    netns_cluster, baseline, tmp_path: Path
) -> None:
    """``--workers 4 --start-workers 2``: the job starts on 2 machines x 1 slot with the math
    of 2 pipelines. Both machines are SIGKILLed whole at once (a spot batch): no survivor
    holds any stage, and no worker is scheduled to come (the coordinator has no trace), yet
    on a cluster a new machine may boot at any time: the coordinator says it waits for one,
    one boots, and the job restores the last checkpoint on it and ends with the undisturbed
    run's hash and every step's loss (the logical topology is --workers', whatever ran it)."""
    config = {**CONFIG, "spotline": {**CONFIG["spotline"], "checkpoints": {"interval_steps": 10}}}
    cfg = write_config(tmp_path / "c.json", config)
    coordinator_host, *hosts = netns_cluster(4)
    out = tmp_path / "out"
    coordinator, err, join = _coordinator(
        coordinator_host, cfg, out, (*TOPOLOGY, "--start-workers", "2")
    )
    live = [coordinator]
    agents = [_agent(host, join, f"m{i}", out, *_token(out)) for i, host in enumerate(hosts[:2], 1)]
    deadline = time.monotonic() + 600  # a bound on the test, not a timing claim
    while latest_complete(out / "checkpoints") is None:  # the step-10 checkpoint committed
        assert coordinator.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.1)
    for host in hosts[:2]:
        assert host.kill_everything() > 0
    _wait_for(err, r"too few to train: waiting for machines to join", live, 300)
    newcomer = _agent(hosts[2], join, "m3", out, *_token(out))
    assert coordinator.wait(timeout=600) == 0, err.read_text()[-3000:]
    summary = read_summary(out)
    expected = baseline.result()
    assert summary["param_sha256"] == expected["param_sha256"]
    assert summary["losses"] == expected["losses"]
    assert summary["checkpoint_fallbacks"] == 1
    assert (summary["logical_workers"], summary["workers"]) == (2, 4)
    start = next(e for e in summary["events"] if e["kind"] == "start")
    assert start["workers"] == 2
    lost = sorted(e["machine"] for e in summary["events"] if e["kind"] == "machine-lost")
    assert lost == ["m1", "m2"]
    assert newcomer.wait(timeout=120) == 0, newcomer.communicate()[1]
    for agent in agents:
        agent.wait(timeout=10)  # killed with their machines: reaped
