"""``spotline bench cluster-replay``: a spot trace replayed machine by machine on a namespace
cluster, and the simulator's prediction of its goodput beside the measured one.

This process plays the cloud. The cluster is built on this machine
(:mod:`spotline.launch.bench.netns`: network namespaces on a private bridge, root only):
``spotline coordinator`` on one namespace machine and, as the trace says, ``spotline agent
--slots 1`` on the others. The trace is scaled to ``--machines`` nodes and compressed
``--time-scale`` times (:func:`spotline.sim.validate.wall_clock_trace`, the same function
the prediction uses, so both see the same nodes at the same times); each trace node is one
machine:

- the nodes of the trace's first instant boot first; the trace's clock starts when they have
  all joined (the coordinator then sets the first generation up: the simulator's first
  rendezvous);
- a node's removal kills its machine whole (SIGKILL to every process in the namespace: the
  agent and its worker at once, with no notice), whether or not it had joined yet;
- a node's arrival boots a fresh machine: a new agent (a new name: a machine declared lost
  never comes back under its old one) on a free namespace; it trains once it has started,
  joined and been planned at a step boundary.

The job: ``--stages`` stages, ``--workers`` (the logical topology, ``--machines`` rounded down
to whole pipelines) with ``--start-workers`` the first instant's nodes, the calibration's
logical workers (so its global batch is the calibration's), lazy redundancy, a checkpoint
every ``--checkpoint-interval`` steps. Measured: the window from the clock's start to the
last step's commit (the coordinator's ``step N/N`` line, read as it is written), the samples
it committed (every step exactly once), their ratio. With ``--calibration`` (a table of
``spotline calibrate`` measured on this machine) the bench first measures what the cluster
itself costs where it differs from one machine: a machine's boot to its worker joining, a
recovery from a machine's loss and an arrival's generation change (:func:`cluster_changes`,
once) and, before each round, the steady step at each pipeline count
(:func:`cluster_step_rows`); :func:`cluster_table` puts them into the local table, and the
report adds :func:`spotline.sim.validate.predict_cluster_replay` over the same window with
that table (and with the local one alone, for reference) and the errors.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import spotline
from spotline.atomic_files import write_json_atomic
from spotline.errors import UserError
from spotline.launch.bench.cluster_processes import (
    LogWatch,
    namespace_machines,
    start_agent,
    start_coordinator,
)
from spotline.launch.bench.jobs import (
    BenchSettings,
    RunFailed,
    clear_earlier_run,
    machine_info,
    progress,
    resolve_base_config,
    write_config,
)
from spotline.plan.traces import Trace
from spotline.run_dir import TOKEN_NAME

# The shipped p3 trace, wherever the package is installed (integration/assets/traces here).
DEFAULT_TRACE = str(Path(spotline.__file__).resolve().parent / "assets" / "traces" / "p3-trace.csv")
STAGES = 2
POLL_S = 0.01  # how often the cloud looks at the clock and the coordinator's stderr
# Spare namespaces beyond the trace's peak: a killed machine's namespace is reused only
# when its processes are gone, and a removal and an arrival can share an instant.
SPARE_MACHINES = 2
BOOT_NICE = 19  # a booting machine's CPU priority (see Cloud)
STEADY_FROM = 5  # a calibration run's steps before this one are its start-up
CALIBRATION_STEPS = 60
# The calibration's arrivals: booted this long after the clock starts, while the job trains.
ARRIVALS_AT_S = (3.0, 12.0, 21.0)
LOSS_AT_S = 32.0  # then the first of them is lost
ARRIVAL_STEPS = 150


@dataclass(frozen=True)
class MachineAction:
    """What the cloud does to one machine at ``t_s`` (seconds after the clock's start):
    boot it, or kill it whole. ``node`` names one life of a trace node (``NODE#k``, its
    k-th addition), so a node that comes back is a new machine."""

    t_s: float
    kind: Literal["boot", "kill"]
    node: str


def machine_actions(wall: Trace) -> tuple[tuple[str, ...], tuple[MachineAction, ...]]:
    """The machines of the first instant, and every later boot and kill in time order
    (within an instant kills first, as the simulator orders them). Pure."""
    first_t = wall.events[0].t_s if wall.events else 0.0
    lives: dict[str, int] = {}
    live: dict[str, str] = {}  # trace node -> its current life
    initial: list[str] = []
    actions: list[MachineAction] = []
    for event in sorted(wall.events, key=lambda e: (e.t_s, e.kind == "add")):
        if event.kind == "add":
            lives[event.node] = lives.get(event.node, 0) + 1
            life = f"{event.node}#{lives[event.node]}"
            live[event.node] = life
            if event.t_s == first_t:
                initial.append(life)
            else:
                actions.append(MachineAction(event.t_s - first_t, "boot", life))
        else:
            life = live.pop(event.node)
            if event.t_s == first_t:
                initial.remove(life)  # a first instant that also removes (none expected)
            else:
                actions.append(MachineAction(event.t_s - first_t, "kill", life))
    return tuple(initial), tuple(actions)


def machine_boots(
    watch: LogWatch, boot_t: dict[str, float], t0: float
) -> dict[str, dict[str, float | None]]:
    """Each machine booted: when (seconds after the clock's start; negative for the first
    instant's), and how long until its agent registered and until its worker joined the job
    (None: killed before), from the coordinator's event lines as this process saw them."""
    arrived = re.compile(r"\] arrived \{'worker': '(w\d+)', 'machine': '(m\d+)'\}")
    joined = re.compile(r"\] joined \{'worker': '(w\d+)'\}")
    registered = re.compile(r"\] machine-joined \{'machine': '(m\d+)'")
    worker_of: dict[str, str] = {}
    seen: dict[str, dict[str, float | None]] = {
        name: {"boot_t_s": t - t0, "registered_s": None, "worker_joined_s": None}
        for name, t in boot_t.items()
    }
    for t, line in watch.lines:
        if (m := registered.search(line)) and m.group(1) in seen:
            seen[m.group(1)]["registered_s"] = t - boot_t[m.group(1)]
        elif (m := arrived.search(line)) and m.group(2) in seen:
            worker_of[m.group(1)] = m.group(2)
        elif (m := joined.search(line)) and m.group(1) in worker_of:
            name = worker_of[m.group(1)]
            seen[name]["worker_joined_s"] = t - boot_t[name]
    return seen


def check_args(machines: int, time_scale: float, steps: int, checkpoint_interval: int) -> None:
    if machines < STAGES:
        raise UserError(
            f"--machines {machines}: at least {STAGES} (one pipeline of {STAGES} stages)"
        )
    if machines > 12:
        raise UserError(f"--machines {machines}: at most 12 on one 2-core host")
    if not time_scale > 0:
        raise UserError(f"--time-scale {time_scale}: use a positive number (e.g. 30)")
    if steps < 1:
        raise UserError(f"--steps {steps}: use at least 1 step")
    if checkpoint_interval < 0:
        raise UserError(f"--checkpoint-interval {checkpoint_interval}: use 0 (never) or more")


class Cloud:
    """The namespace machines and which trace node lives on which; boots and kills them.

    A real machine boots on its own CPU; these share this host's two cores with the ones
    that train. So a booting machine runs at the lowest CPU priority (nice 19) until its
    agent's spawner has imported the training stack (``spawner: ready`` in its log), then
    at the normal one: its boot takes CPU the training machines leave, not theirs. The
    calibration's boots are made the same way.
    """

    def __init__(self, hosts: Sequence[Any], run_dir: Path, join: str, token: Path) -> None:
        self.free = list(hosts)
        self.run_dir, self.join, self.token = run_dir, join, token
        self.on: dict[str, tuple[Any, subprocess.Popen[bytes], str]] = {}
        self.killed = 0
        self.boot_t: dict[str, float] = {}  # machine name -> when its agent was started
        self.booting: dict[str, Any] = {}  # machine name -> host, still at BOOT_NICE

    def boot(self, node: str, *, nice: int = BOOT_NICE) -> None:
        host = next((h for h in self.free if not h.pids()), None)
        if host is None:
            raise RunFailed(f"no free namespace machine to boot {node} on", 1)
        self.free.remove(host)
        name = f"m{len(self.boot_t) + 1}"
        self.boot_t[name] = time.monotonic()
        agent = start_agent(
            host,
            self.join,
            name,
            self.run_dir / "agents" / name,
            self.token,
            self.run_dir / f"agent-{name}.err",
            nice=nice,
        )
        self.on[node] = (host, agent, name)
        if nice != 0:
            self.booting[name] = host

    def promote_booted(self) -> None:
        """Every booting machine whose spawner is ready back to the normal CPU priority
        (each thread of each of its processes: Linux keeps a priority per thread)."""
        for name, host in list(self.booting.items()):
            log = self.run_dir / "agents" / name / "spawner.log"
            if not log.exists() or "spawner: ready" not in log.read_text(errors="replace"):
                continue
            del self.booting[name]
            for pid in host.pids():
                for task in Path(f"/proc/{pid}/task").glob("*"):
                    try:
                        os.setpriority(os.PRIO_PROCESS, int(task.name), 0)
                    except (ProcessLookupError, PermissionError):
                        pass  # gone meanwhile

    def kill(self, node: str) -> None:
        host, agent, name = self.on.pop(node)
        self.booting.pop(name, None)
        host.kill_everything()
        agent.wait()
        self.killed += 1
        self.free.append(host)


def run_cluster(
    config: Path,
    run_dir: Path,
    *,
    initial: Sequence[str],
    actions: Sequence[MachineAction],
    workers: int,
    machines: int,
    steps: int,
    limit_s: float,
) -> dict[str, Any]:
    """One job on namespace machines: the ``initial`` machines boot, the clock starts when
    they have joined, ``actions`` are played on it until the last step commits; the times
    seen from here and the summary's figures."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "out"
    if out.is_dir():
        clear_earlier_run(out)
    err = run_dir / "coordinator.err"
    flags = ["--workers", str(workers), "--stages", str(STAGES),
             "--start-workers", str(min(len(initial), workers)), "--steps", str(steps)]  # fmt: skip
    with ExitStack() as stack:
        head, *hosts = namespace_machines(stack, 1 + machines + SPARE_MACHINES)
        coordinator, watch, join = start_coordinator(head, config, out, err, flags)
        cloud = Cloud(hosts, run_dir, join, out / TOKEN_NAME)
        for node in initial:
            cloud.boot(node, nice=0)  # nothing trains yet: at the normal priority
        start = watch.wait(r"machine\(s\) joined with (\d+) of the \1 slots", [coordinator], 600)
        t0 = start[0]
        pending = list(actions)
        played: list[dict[str, Any]] = []
        deadline = t0 + limit_s
        done_pattern = rf"spotline: step {steps}/{steps} "
        while True:
            watch.poll()
            done = watch.first(done_pattern)
            if done is not None:
                break
            if coordinator.poll() is not None:
                tail = "\n".join(line for _, line in watch.lines[-30:])
                raise RunFailed(f"the coordinator exited {coordinator.returncode}:\n{tail}", 1)
            now = time.monotonic()
            if now > deadline:
                raise RunFailed(f"the run did not finish in {limit_s:g} s; see {err}", 1)
            cloud.promote_booted()
            while pending and pending[0].t_s <= now - t0:
                action = pending.pop(0)
                (cloud.boot if action.kind == "boot" else cloud.kill)(action.node)
                played.append({"t_s": round(now - t0, 3), "kind": action.kind, "node": action.node})
            time.sleep(POLL_S)
        window_s = done[0] - t0
        try:
            code = coordinator.wait(timeout=600)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"the coordinator did not finish; see {err}", 1) from None
        if code != 0:
            raise RunFailed(f"the coordinator exited {code}; see {err}", 1)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    samples_per_step = summary["micro_batch_size"] * summary["micro_batches"]
    samples = steps * samples_per_step * summary["logical_workers"]
    steady = [t for t in summary["step_times_s"][STEADY_FROM:] if t is not None]
    return {
        "window_s": window_s,
        "samples": samples,
        "goodput_samples_per_s": samples / window_s,
        "machines_booted": len(cloud.boot_t),
        "machines_killed": cloud.killed,
        "actions_played": played,
        "workers": workers,
        "start_workers": len(initial),
        "logical_workers": summary["logical_workers"],
        "samples_per_step": samples_per_step * summary["logical_workers"],
        "boots": machine_boots(watch, cloud.boot_t, t0),
        "recoveries_s": [e["recovery_s"] for e in summary["recovery_events"]],
        "reconfigurations_s": [e["reconfigure_s"] for e in summary["reconfigurations"]],
        "preemptions": summary["preemptions"],
        "recoveries": summary["recoveries"],
        "checkpoint_fallbacks": summary["checkpoint_fallbacks"],
        "steps_redone": summary["steps_redone"],
        "exposure_checkpoints": summary.get("exposure_checkpoints", 0),
        "param_sha256": summary["param_sha256"],
        "train_wall_s": summary["train_wall_s"],
        # The median step, its first STEADY_FROM left out (start-up, first generation).
        "median_step_s": statistics.median(steady) if steady else None,
    }


def cluster_step_rows(config: Path, work: Path, machines: int) -> list[dict[str, Any]]:
    """The steady step time at each pipeline count up to ``machines // STAGES``: a job on
    ``2P`` namespace machines with no loss, its median step; calibration table rows."""
    rows: list[dict[str, Any]] = []
    for pipelines in range(1, machines // STAGES + 1):
        progress(f"cluster-replay calibration: {STAGES} stages x {pipelines} pipelines")
        n = STAGES * pipelines
        run = run_cluster(
            config,
            work / f"steady-{pipelines}p",
            initial=[f"s{i}#1" for i in range(n)],
            actions=(),
            workers=n,
            machines=n,
            steps=CALIBRATION_STEPS,
            limit_s=600.0,
        )
        rows.append(
            {"num_stages": STAGES, "num_pipelines": pipelines, "degraded": False,
             "step_time_s": round(run["median_step_s"], 5)}
        )  # fmt: skip
    return rows


@dataclass(frozen=True)
class ClusterChanges:
    """What membership changes cost on the cluster: each booted machine's boot to its
    worker joining, each recovery from a machine's loss, each generation change that let
    an arrival in (its state sent to it)."""

    boots_s: tuple[float, ...]
    recoveries_s: tuple[float, ...]
    arrival_changes_s: tuple[float, ...]


def cluster_changes(config: Path, work: Path, machines: int) -> ClusterChanges:
    """Three machines booted one after another while a job trains, then one killed whole."""
    progress("cluster-replay calibration: three machines booted while a job trains, one lost")
    run = run_cluster(
        config,
        work / "changes",
        initial=["a0#1", "a1#1"],
        actions=[
            *(MachineAction(t, "boot", f"b{i}#1") for i, t in enumerate(ARRIVALS_AT_S)),
            MachineAction(LOSS_AT_S, "kill", "b0#1"),
        ],
        workers=machines - machines % STAGES,
        machines=machines,
        steps=ARRIVAL_STEPS,
        limit_s=600.0,
    )
    boots = [b["worker_joined_s"] for b in run["boots"].values() if b["boot_t_s"] >= 0]
    if None in boots or not boots or not run["recoveries_s"] or not run["reconfigurations_s"]:
        raise RunFailed(f"the calibration's arrivals or loss went unseen; see {work}/changes", 1)
    return ClusterChanges(
        tuple(float(b) for b in boots if b is not None),
        tuple(run["recoveries_s"]),
        tuple(run["reconfigurations_s"]),
    )


def cluster_table(
    local: dict[str, Any], rows: list[dict[str, Any]], changes: ClusterChanges, machines: int
) -> dict[str, Any]:
    """``local`` (a table of ``spotline calibrate``) with what the namespace cluster costs in
    its place: its steady step ``rows`` (the degraded row scaled from the first by the local
    slowdown), ``node_ready_s`` (the median boot), ``reconfigure_s`` and
    ``fatal_rendezvous_s`` (the median recovery from a machine's loss) and
    ``state_transfer_s`` (what an arrival's generation change takes beyond that). The
    checkpoint costs stay the local ones. Pure."""
    table: dict[str, Any] = json.loads(json.dumps(local))
    model = table["models"]["local"]
    degraded = [r for r in model["step_times"] if r["degraded"]]
    model["step_times"] = rows + [
        {**r, "step_time_s": round(rows[0]["step_time_s"] * table["degraded_slowdown"], 5)}
        for r in degraded
    ]
    reconfigure = statistics.median(changes.recoveries_s)
    table["node_ready_s"] = round(statistics.median(changes.boots_s), 4)
    table["reconfigure_s"] = table["fatal_rendezvous_s"] = round(reconfigure, 4)
    table["state_transfer_s"] = round(
        max(0.0, statistics.median(changes.arrival_changes_s) - reconfigure), 4
    )
    table["description"] = (
        f"{local.get('description', 'spotline calibrate')} Step times, node_ready_s, "
        f"reconfigure_s and state_transfer_s measured on {machines} namespace machines x 1 "
        "slot by spotline bench cluster-replay."
    )
    table["cluster"] = {
        "step_times": rows,
        "boots_s": list(changes.boots_s),
        "recoveries_s": list(changes.recoveries_s),
        "arrival_changes_s": list(changes.arrival_changes_s),
    }
    return table


def bench_cluster_replay(
    settings: BenchSettings,
    *,
    trace_path: str,
    machines: int,
    time_scale: float,
    checkpoint_interval: int,
    calibration_path: str | None,
) -> dict[str, Any]:
    """With a calibration: the cluster's own calibration runs first. Then
    ``settings.repeats`` replays of the trace, each with the simulator's prediction from the
    cluster's table (and from the local one alone, for reference)."""
    from spotline.launch.bench import netns
    from spotline.plan.traces import load_trace
    from spotline.sim.calibration import load_calibration
    from spotline.sim.validate import predict_cluster_replay, wall_clock_trace

    check_args(machines, time_scale, settings.steps, checkpoint_interval)
    trace = load_trace(trace_path)
    local = load_calibration(calibration_path) if calibration_path else None
    overrides: dict[str, Any] = {
        "spotline.topology.stages": STAGES,
        "spotline.model.name": "gpt2-tiny",
        "spotline.redundancy.mode": "lazy",
        "spotline.checkpoints.interval_steps": checkpoint_interval,
        # The clock's end is the coordinator's last progress line.
        "spotline.tracking.progress": True,
    }
    local_table: dict[str, Any] = {}
    if calibration_path is not None:
        local_table = json.loads(Path(calibration_path).read_text(encoding="utf-8"))
        # The calibrated runs' global batch: the replay trains the same logical workers.
        logical = local_table.get("measured", {}).get("logical_workers")
        if logical is not None:
            overrides["spotline.elasticity.logical_workers"] = logical
    try:
        netns.check_possible()  # before anything starts: root and `ip`
    except netns.NetnsUnavailable as exc:
        raise UserError(f"bench cluster-replay: {exc}") from None
    base = resolve_base_config(settings, overrides)
    work = settings.output / "cluster-replay"
    config = write_config(base, work / "config.json")
    wall = wall_clock_trace(trace, max_workers=machines, time_scale=time_scale)
    initial, actions = machine_actions(wall)
    changes = cluster_changes(config, work, machines) if local is not None else None
    runs = []
    for round_idx in range(settings.repeats):
        tables = {}
        if local is not None and changes is not None:
            # This host's speed drifts between runs (a shared 2-core VM): each round's
            # prediction takes the steady steps measured just before it.
            rows = cluster_step_rows(config, work / f"round-{round_idx}", machines)
            path = work / f"calibration-cluster-{round_idx}.json"
            write_json_atomic(path, cluster_table(local_table, rows, changes, machines))
            tables = {"cluster": load_calibration(path), "local": local}
        progress(f"cluster-replay round {round_idx + 1}/{settings.repeats}")
        run = run_cluster(
            config,
            work / f"replay-{round_idx}",
            initial=initial,
            actions=actions,
            workers=machines - machines % STAGES,
            machines=machines,
            steps=settings.steps,
            limit_s=max(600.0, 20.0 * settings.steps),
        )
        for name, table in tables.items():
            prediction = predict_cluster_replay(
                trace,
                table,
                model="local",
                num_workers=run["workers"],
                machines=machines,
                time_scale=time_scale,
                window_s=run["window_s"],
                checkpoint_interval_steps=checkpoint_interval,
            )
            goodput = prediction.goodput_samples_per_s
            run.setdefault("predicted", {})[name] = {
                "goodput_samples_per_s": goodput,
                "error": goodput / run["goodput_samples_per_s"] - 1,
                "simulated": prediction.result.summary(),
            }
        progress(f"cluster-replay: {_describe(run)}")
        runs.append(run)
    return {
        "bench": "cluster-replay",
        "trace": Path(trace_path).name,
        "machines": machines,
        "stages": STAGES,
        "time_scale": time_scale,
        "steps": settings.steps,
        "checkpoint_interval_steps": checkpoint_interval,
        "calibration": calibration_path,
        "cluster_calibrations": [
            str(work / f"calibration-cluster-{i}.json") for i in range(settings.repeats)
        ]
        if local is not None
        else [],
        "runs": runs,
        "machine": machine_info(),
    }


def _describe(run: dict[str, Any]) -> str:
    text = (
        f"{run['goodput_samples_per_s']:.1f} samples/s over {run['window_s']:.1f} s, "
        f"{run['machines_killed']} machines killed, {run['machines_booted']} booted, "
        f"{run['checkpoint_fallbacks']} checkpoint fallbacks"
    )
    for name, p in run.get("predicted", {}).items():
        text += f"; predicted ({name} table) {p['goodput_samples_per_s']:.1f} ({p['error']:+.1%})"
    return text


def format_cluster_replay(report: dict[str, Any]) -> str:
    lines = [
        f"cluster-replay: {report['trace']} on at most {report['machines']} machines x 1 slot "
        f"(network namespaces), {report['time_scale']:g}x, {report['stages']} stages, "
        f"{report['steps']} steps, a checkpoint every {report['checkpoint_interval_steps']}",
        "",
        "| round | window (s) | measured (samples/s) | predicted, cluster table | error | predicted, local table | error | machines killed / booted | preemptions (measured / simulated) | checkpoint fallbacks (measured / simulated) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for i, run in enumerate(report["runs"], start=1):
        predicted = run.get("predicted", {})
        cells = []
        for name in ("cluster", "local"):
            p = predicted.get(name)
            cells += (
                ["n/a", "n/a"]
                if p is None
                else [f"{p['goodput_samples_per_s']:.1f}", f"{p['error']:+.1%}"]
            )
        sim = predicted.get("cluster", {}).get("simulated", {})
        lines.append(
            f"| {i} | {run['window_s']:.1f} | {run['goodput_samples_per_s']:.1f} | "
            f"{' | '.join(cells)} | {run['machines_killed']} / {run['machines_booted']} | "
            f"{run['preemptions']} / {sim.get('num_preemptions', 'n/a')} | "
            f"{run['checkpoint_fallbacks']} / {sim.get('num_fatal_failures', 'n/a')} |"
        )
    return "\n".join(lines)
