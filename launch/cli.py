"""The ``spotline`` command.

``spotline train`` validates the whole run (config, model, corpus) before any worker starts,
then starts the local worker processes itself, so that it can later kill, replace and add
workers. A user mistake is one line on stderr and exit code 2, with nothing written that
looks like a finished run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spotline.errors import UserError
from spotline.launch.flags import add_run_flags, overrides_from_args

EXIT_USAGE = 2


def fail(message: str) -> int:
    print(f"spotline: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(rank: int, world_size: int, port: int, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def build_train_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="DeepSpeed config JSON with a 'spotline' section")
    parser.add_argument("--output", help="output directory (default: runs/<time>)")
    add_run_flags(parser, with_workers=True)


def resolve_config(args: argparse.Namespace) -> Any:
    from spotline.config import load_config, with_overrides

    return with_overrides(load_config(args.config), overrides_from_args(args))


def cmd_train(args: argparse.Namespace) -> int:
    from spotline.tracking import SUMMARY_NAME, write_json_atomic

    try:
        cfg = resolve_config(args)
        # Importing torch/transformers costs seconds; it buys a one-line error before any
        # process starts for a missing model directory or a corpus too small for a batch.
        from spotline.trainer import prepare_inputs

        prepare_inputs(cfg)
    except UserError as exc:
        return fail(str(exc))
    output = Path(args.output or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    output.mkdir(parents=True, exist_ok=True)
    # A summary left by an earlier run in this directory must not pass for this run's.
    (output / SUMMARY_NAME).unlink(missing_ok=True)
    resolved = output / "config.resolved.json"
    write_json_atomic(resolved, cfg.to_json())

    world = cfg.num_workers
    port = free_port()
    threads = cfg.spotline.determinism.intra_op_threads
    procs: list[subprocess.Popen[bytes]] = []
    logs_dir = output / "logs"
    logs_dir.mkdir(exist_ok=True)
    try:
        for rank in range(world):
            # Each worker's output goes to its log; rank 0's stderr (progress, errors) also
            # reaches the terminal.
            log = open(logs_dir / f"worker-{rank}.log", "wb")  # noqa: SIM115 - closed by the child's exit
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "spotline.launch.worker",
                        "--config",
                        str(resolved),
                        "--output",
                        str(output),
                    ],
                    env=worker_env(rank, world, port, threads),
                    stdout=log,
                    stderr=None if rank == 0 else subprocess.STDOUT,
                )
            )
            log.close()
        codes = wait_all(procs)
    except KeyboardInterrupt:
        terminate(procs)
        return 130
    if any(c != 0 for c in codes):
        if all(c in (0, EXIT_USAGE) for c in codes):
            return EXIT_USAGE
        print(
            f"spotline: error: worker exit codes {codes}; see {logs_dir}/worker-*.log",
            file=sys.stderr,
        )
        return 1
    summary = json.loads((output / SUMMARY_NAME).read_text())
    print(format_summary(summary, output))
    return 0


def wait_all(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    """Wait for every worker; when one fails, stop the others (static job: nothing to fail over to)."""
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes if c is not None]
        if any(c not in (None, 0) for c in codes):
            # Give the others a moment to report their own (often the same) error.
            time.sleep(1.0)
            terminate(procs)
            return [int(p.wait()) for p in procs]
        time.sleep(0.05)


def terminate(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def format_summary(s: dict[str, Any], output: Path) -> str:
    return "\n".join(
        [
            f"spotline: trained {s['model']} for {s['steps']} steps on {s['workers']} workers "
            f"({s['stages']} stages x {s['pipelines']} pipelines, redundancy {s['redundancy']})",
            f"  loss {s['losses'][0]:.4f} -> {s['final_loss']:.4f}   "
            f"{s['samples_per_s']:.1f} samples/s   {s['wall_s']:.1f} s",
            f"  preemptions {s['preemptions']}  recoveries {s['recoveries']}  "
            f"checkpoint fallbacks {s['checkpoint_fallbacks']}",
            f"  param_sha256 {s['param_sha256']}",
            f"  summary: {output / 'summary.json'}   model: {output / 'model'}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="spotline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build_train_parser(sub.add_parser("train", help="train on local worker processes"))
    sub.add_parser("simulate", help="cluster-scale simulator on spot traces", add_help=False)
    sub.add_parser("bench", help="benchmarks (see BENCHMARKS.md)", add_help=False)
    if argv and argv[0] == "simulate":
        from spotline.launch.simulate import main as simulate_main

        return simulate_main(argv[1:])
    if argv and argv[0] == "bench":
        from spotline.launch.bench import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "train":
        return cmd_train(args)
    return fail(f"unknown command {args.command}")  # pragma: no cover - argparse rejects it


if __name__ == "__main__":
    sys.exit(main())
