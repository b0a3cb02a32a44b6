"""``spotline bench cluster``: losing a machine of a cluster, and moving state between machines.

The cluster is built on this machine (:mod:`spotline.launch.bench.netns`: network namespaces
on a private bridge, so it needs root): ``spotline coordinator`` in one namespace and one
``spotline agent --slots 1`` in each of four others, 2 stages x 2 pipelines of the tiny
GPT-2 with lazy redundancy, every worker bound to its machine's address.

Part 1, time from a loss to the next committed step, three variants interleaved per round:

- ``machine-kill``: every process of the victim worker's machine (its agent and its worker)
  SIGKILLed at once, a preemption that takes the whole machine;
- ``link-down``: the victim's machine cut off (``ip link set eth0 down`` in its namespace);
  its processes keep running, nothing tells anyone: only the agent's missing heartbeat
  (``recovery.heartbeat_timeout_s``) reveals it;
- ``single-machine``: for reference, ``spotline train`` with the same config on one machine
  (a namespace of its own), the victim worker alone SIGKILLed: the takeover without a
  network between machines.

Every run is killed at the same point, just after the coordinator shows step
``--kill-after`` (mid-step of the next one), the victim is the same worker id, and the clock
is this process's: from the kill (or the cut) to the coordinator's ``recovered`` line (printed
when the first step after the takeover has committed), read from its stderr as it is written
(polled every :data:`WATCH_S`). The coordinator's own ``recovery_s`` (from when it noticed)
is kept beside it.

Part 2, the state-transfer rate between two machines: the same bytes over a gloo process
group (``batch_isend_irecv``, as a replica rebuild sends a stage) and over a plain TCP socket,
alternating (:mod:`spotline.launch.bench.transfer_worker`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from spotline.errors import UserError
from spotline.launch.bench.cluster_processes import (
    LogWatch,
    namespace_machines,
    popen_in,
    spotline_argv,
    start_agent,
    start_coordinator,
    worker_pid,
)
from spotline.launch.bench.jobs import (
    BenchSettings,
    RunFailed,
    clear_earlier_run,
    interleaved,
    machine_info,
    median,
    progress,
    resolve_base_config,
    write_config,
)
from spotline.run_dir import LOGS_DIR, TOKEN_NAME

VARIANTS = ("machine-kill", "link-down", "single-machine")
WORKERS, STAGES = 4, 2
TOPOLOGY = ("--workers", str(WORKERS), "--stages", str(STAGES))
RUN_LIMIT_S = 600.0  # a bound on one run (a hang fails the bench), not a timing claim
STORE_PORT, TCP_PORT = 29500, 29501  # per namespace: no clash with anything outside it
# Targets (issue): a machine kill recovers at most this much slower than the one-machine
# takeover; a silent loss at most this much after the heartbeat timeout.
TARGET_MARGIN_S = 1.0


def _find_victim(logs: Sequence[Path], victim: str, procs: Sequence[subprocess.Popen[Any]]) -> int:
    """The index into ``logs`` of the folder where the victim's log is written by a live
    process (the victim's machine)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for i, folder in enumerate(logs):
            if (folder / f"{victim}.log").exists():
                pid = worker_pid(folder / f"{victim}.log")
                if pid is not None:
                    return i
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    raise RunFailed(f"worker {victim} is not running (no process writes {victim}.log)", 1)


def run_loss(
    variant: str, config: Path, run_dir: Path, *, victim: str, kill_after: int
) -> dict[str, Any]:
    """One run of ``variant``: a real job on namespace machines, the victim lost after step
    ``kill_after``; returns the times seen from here and the summary's figures."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "out"
    if out.is_dir():
        clear_earlier_run(out)
    err = run_dir / "coordinator.err"
    machines = 1 if variant == "single-machine" else 1 + WORKERS
    with ExitStack() as stack:
        hosts = namespace_machines(stack, machines)
        if variant == "single-machine":
            watch = LogWatch(err)
            coordinator = popen_in(
                hosts[0], spotline_argv("train", "--config", str(config), "--output", str(out),
                                        *TOPOLOGY), err,
            )  # fmt: skip
            procs: list[subprocess.Popen[Any]] = [coordinator]
            logs = [out / LOGS_DIR]
            machine_of = [hosts[0]]
        else:
            head, *agents_at = hosts
            coordinator, watch, join = start_coordinator(head, config, out, err, TOPOLOGY)
            logs = [run_dir / "agents" / f"m{i}" for i in range(1, len(agents_at) + 1)]
            procs = [coordinator] + [
                start_agent(host, join, f"m{i}", logs[i - 1], out / TOKEN_NAME,
                            run_dir / f"agent-m{i}.err")
                for i, host in enumerate(agents_at, start=1)
            ]  # fmt: skip
            machine_of = agents_at
        watch.wait(rf"spotline: step {kill_after}/", procs, RUN_LIMIT_S)
        where = _find_victim(logs, victim, procs)
        machine = machine_of[where]
        loss_t = time.monotonic()
        if variant == "machine-kill":
            machine.kill_everything()
        elif variant == "link-down":
            machine.link_down()
        else:
            pid = worker_pid(logs[where] / f"{victim}.log")
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        recovered = watch.wait(r"\] recovered ", [coordinator], RUN_LIMIT_S)
        detected = watch.first(r"\] (machine-lost|preempted) ", after=loss_t)
        try:
            code = coordinator.wait(timeout=RUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"{variant}: the coordinator did not finish; see {err}", 1) from None
        if code != 0:
            raise RunFailed(f"{variant}: the coordinator exited {code}; see {err}", 1)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    events = summary["recovery_events"]
    return {
        "loss_to_commit_s": recovered[0] - loss_t,
        "loss_to_detect_s": detected[0] - loss_t if detected else None,
        # The coordinator's own figure: from when it noticed the loss to the commit.
        "coordinator_recovery_s": events[0]["recovery_s"] if events else None,
        "in_memory": bool(events) and all(e["in_memory"] for e in events),
        "preemptions": summary["preemptions"],
        "recoveries": summary["recoveries"],
        "checkpoint_fallbacks": summary["checkpoint_fallbacks"],
        "machine_lost": [e["machine"] for e in summary["events"] if e["kind"] == "machine-lost"],
        "param_sha256": summary["param_sha256"],
        "losses": summary["losses"],
    }


def run_transfer(run_dir: Path, nbytes: int, repeats: int) -> dict[str, Any]:
    """The same ``nbytes`` over gloo and over a plain TCP socket between two namespace
    machines, ``repeats`` times each, alternating; returns rank 0's times."""
    run_dir.mkdir(parents=True, exist_ok=True)
    result = run_dir / "transfer.json"
    result.unlink(missing_ok=True)
    with ExitStack() as stack:
        sender, receiver = namespace_machines(stack, 2)
        common = ["--master", sender.address, "--port", str(STORE_PORT), "--peer",
                  receiver.address, "--tcp-port", str(TCP_PORT), "--bytes", str(nbytes),
                  "--repeats", str(repeats)]  # fmt: skip
        module = [sys.executable, "-m", "spotline.launch.bench.transfer_worker"]
        procs = [
            popen_in(
                machine,
                [
                    *module,
                    "--rank",
                    str(rank),
                    "--iface",
                    machine.iface,
                    *common,
                    *(["--output", str(result)] if rank == 0 else []),
                ],
                run_dir / f"transfer-{rank}.err",
            )  # fmt: skip
            for rank, machine in enumerate((sender, receiver))
        ]
        deadline = time.monotonic() + RUN_LIMIT_S
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    if any(codes) or not result.exists():
        raise RunFailed(f"transfer ranks exited {codes}; see {run_dir}/transfer-*.err", 1)
    measured: dict[str, Any] = json.loads(result.read_text())
    return measured


def bench_cluster(
    settings: BenchSettings,
    *,
    victim: str = "w1",
    kill_after: int = 2,
    heartbeat_timeout_s: float | None = None,
    transfer_mib: int = 256,
    transfer_repeats: int = 5,
) -> dict[str, Any]:
    """Part 1 (the three losses, interleaved per round) and part 2 (the transfer rates)."""
    check_args(settings.steps, kill_after, victim, transfer_mib, transfer_repeats)
    from spotline.launch.bench import netns

    try:
        netns.check_possible()  # before any run: root and `ip`
    except netns.NetnsUnavailable as exc:
        raise UserError(f"bench cluster: {exc}") from None
    overrides: dict[str, Any] = {
        "spotline.topology.workers": WORKERS,
        "spotline.topology.stages": STAGES,
        "spotline.model.name": "gpt2-tiny",
        "spotline.redundancy.mode": "lazy",
        "spotline.determinism.enabled": True,
        # The kill is timed from the progress lines: one per step (runs under 20 steps).
        "spotline.tracking.progress": True,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    if heartbeat_timeout_s is not None:
        overrides["spotline.recovery.heartbeat_timeout_s"] = heartbeat_timeout_s
    base = resolve_base_config(settings, overrides)
    work = settings.output / "cluster"
    config = write_config(base, work / "config.json")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for round_idx, variant in interleaved(VARIANTS, settings.repeats):
        progress(f"cluster round {round_idx + 1}/{settings.repeats}: {variant}")
        result = run_loss(
            variant,
            config,
            work / f"{variant}-{round_idx}",
            victim=victim,
            kill_after=kill_after,
        )
        progress(
            f"cluster {variant}: loss to commit {result['loss_to_commit_s']:.2f} s, to "
            f"detection {_s(result['loss_to_detect_s'])} s"
        )
        runs[variant].append(result)
    progress(f"cluster transfer: {transfer_mib} MiB x {transfer_repeats}, gloo and tcp")
    transfer = run_transfer(work / "transfer", transfer_mib * 2**20, transfer_repeats)
    return build_report(
        runs,
        transfer,
        heartbeat_timeout_s=base.spotline.recovery.heartbeat_timeout_s,
        steps=settings.steps,
        repeats=settings.repeats,
        victim=victim,
        kill_after=kill_after,
    )


def check_args(steps: int, kill_after: int, victim: str, mib: int, repeats: int) -> None:
    if not 1 <= kill_after < steps - 1:
        raise UserError(
            f"--kill-after {kill_after} with --steps {steps}: kill after a step from 1 to "
            f"{steps - 2} (a step must follow the takeover)"
        )
    if steps > 19:
        raise UserError(f"--steps {steps}: at most 19 (the kill is timed from per-step lines)")
    if not re.fullmatch(rf"w[0-{WORKERS - 1}]", victim):
        raise UserError(f"--victim {victim!r}: one of the first workers, w0 to w{WORKERS - 1}")
    if mib < 1 or repeats < 1:
        raise UserError(f"--transfer-mib {mib} --transfer-repeats {repeats}: use positive numbers")


def _median_of(results: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in results if r[key] is not None]
    return median(values) if values else None


def build_report(
    runs: dict[str, list[dict[str, Any]]],
    transfer: dict[str, Any],
    *,
    heartbeat_timeout_s: float,
    steps: int,
    repeats: int,
    victim: str,
    kill_after: int,
) -> dict[str, Any]:
    """Medians per variant, the targets' differences, the transfer rates (pure)."""
    rows = {
        name: {
            "loss_to_commit_s": _median_of(results, "loss_to_commit_s"),
            "loss_to_commit_all_s": [r["loss_to_commit_s"] for r in results],
            "loss_to_detect_s": _median_of(results, "loss_to_detect_s"),
            "coordinator_recovery_s": _median_of(results, "coordinator_recovery_s"),
            "in_memory": all(r["in_memory"] for r in results),
            "checkpoint_fallbacks": sum(r["checkpoint_fallbacks"] for r in results),
            "param_sha256": sorted({str(r["param_sha256"]) for r in results}),
        }
        for name, results in runs.items()
    }
    kill, cut, single = (rows[v]["loss_to_commit_s"] for v in VARIANTS)
    kill_over = kill - single if kill is not None and single is not None else None
    cut_over = cut - heartbeat_timeout_s if cut is not None else None
    nbytes = transfer["bytes"]
    rates = {k: nbytes / median(transfer[k]) / 2**20 for k in ("gloo", "tcp")}
    return {
        "bench": "cluster",
        "steps": steps,
        "repeats": repeats,
        "victim": victim,
        "kill_after_step": kill_after,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "rows": rows,
        "targets": {
            "machine_kill_minus_single_s": kill_over,
            "machine_kill_met": kill_over is not None and kill_over <= TARGET_MARGIN_S,
            "link_down_minus_heartbeat_s": cut_over,
            "link_down_met": cut_over is not None and cut_over <= TARGET_MARGIN_S,
            "margin_s": TARGET_MARGIN_S,
        },
        "transfer": {
            "bytes": nbytes,
            "repeats": transfer["repeats"],
            "gloo_s": transfer["gloo"],
            "tcp_s": transfer["tcp"],
            "gloo_mib_per_s": rates["gloo"],
            "tcp_mib_per_s": rates["tcp"],
            "gloo_over_tcp": rates["gloo"] / rates["tcp"],
        },
        # Every run's figures (its per-step losses left out), in the order they ran per variant.
        "runs": {
            name: [{k: v for k, v in r.items() if k != "losses"} for r in results]
            for name, results in runs.items()
        },
        "hashes_agree": len({h for r in rows.values() for h in r["param_sha256"]}) == 1,
        "machine": machine_info(),
    }


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def format_cluster(report: dict[str, Any]) -> str:
    t, x = report["targets"], report["transfer"]
    lines = [
        f"cluster: 4 machines x 1 slot (network namespaces), 2 stages x 2 pipelines, gpt2-tiny, "
        f"lazy redundancy; {report['steps']} steps, worker {report['victim']} lost after step "
        f"{report['kill_after_step']}; median of {report['repeats']} round(s)",
        "",
        "| loss | loss to next committed step (s) | loss to detection (s) | coordinator's recovery (s) | in memory | checkpoint fallbacks |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for name, row in report["rows"].items():
        lines.append(
            f"| {name} | {_s(row['loss_to_commit_s'])} | {_s(row['loss_to_detect_s'])} | "
            f"{_s(row['coordinator_recovery_s'])} | {'yes' if row['in_memory'] else 'no'} | "
            f"{row['checkpoint_fallbacks']} |"
        )
    margin = t["margin_s"]
    lines += [
        "",
        f"machine-kill - single-machine: {_s(t['machine_kill_minus_single_s'])} s "
        f"(target <= {margin:g} s: {'met' if t['machine_kill_met'] else 'NOT met'})",
        f"link-down - heartbeat timeout ({report['heartbeat_timeout_s']:g} s): "
        f"{_s(t['link_down_minus_heartbeat_s'])} s "
        f"(target <= {margin:g} s: {'met' if t['link_down_met'] else 'NOT met'})",
        f"final parameter hashes agree across variants: {report['hashes_agree']}",
        "",
        f"state transfer between two machines, {x['bytes'] / 2**20:.0f} MiB, median of "
        f"{x['repeats']}:",
        "",
        "| path | MiB/s | s per transfer |",
        "|---|---:|---:|",
        f"| gloo batch_isend_irecv | {x['gloo_mib_per_s']:.0f} | {median(x['gloo_s']):.3f} |",
        f"| plain TCP socket | {x['tcp_mib_per_s']:.0f} | {median(x['tcp_s']):.3f} |",
        "",
        f"gloo / tcp rate: {x['gloo_over_tcp']:.2f}x",
    ]
    return "\n".join(lines)
