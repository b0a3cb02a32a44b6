"""The ``spotline`` command.

``spotline train`` and ``spotline coordinator`` run a job (``spotline.launch.train_command``);
the other sub-commands have modules of their own, imported only when they are asked for
(``run``, ``agent``, ``simulate``, ``calibrate``, ``bench``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from spotline.launch.train_command import build_train_parser, cmd_train, fail


class _SpotlineLines(logging.Handler):
    """A warning of Spotline's modules (a skipped incomplete checkpoint) as one
    ``spotline: ...`` line on the stderr of the moment, as the command's own lines are:
    without a handler Python prints the bare message."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"spotline: {record.getMessage()}", file=sys.stderr, flush=True)
        except Exception:  # as logging's own handlers: a broken stderr never stops the run
            self.handleError(record)


def say_warnings() -> None:
    """Route the ``spotline`` loggers' warnings through :class:`_SpotlineLines` (once)."""
    logger = logging.getLogger("spotline")
    if not any(isinstance(h, _SpotlineLines) for h in logger.handlers):
        logger.addHandler(_SpotlineLines())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    say_warnings()
    parser = argparse.ArgumentParser(prog="spotline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build_train_parser(sub.add_parser("train", help="train on local worker processes"))
    sub.add_parser(
        "run", help="run a Hugging Face script's spotline.hf.Trainer under recovery", add_help=False
    )
    sub.add_parser("simulate", help="cluster-scale simulator on spot traces", add_help=False)
    sub.add_parser("bench", help="benchmarks (see BENCHMARKS.md)", add_help=False)
    sub.add_parser(
        "calibrate", help="measure this machine's numbers for the simulator", add_help=False
    )
    sub.add_parser(
        "agent", help="one per machine: start the workers a coordinator orders", add_help=False
    )
    coordinator_parser = sub.add_parser(
        "coordinator", help="the control plane of a job on many machines"
    )
    build_train_parser(coordinator_parser)
    coordinator_parser.add_argument(
        "--listen",
        required=True,
        metavar="ADDR:PORT",
        help="where the machines' agents (spotline agent --join) reach the coordinator",
    )
    coordinator_parser.add_argument(
        "--token-file",
        default=None,
        metavar="FILE",
        help="the job token (default: a new one, written to OUTPUT/job-token, mode 0600)",
    )
    if argv and argv[0] == "run":
        from spotline.launch.hf_run import main as run_main

        return run_main(argv[1:])
    if argv and argv[0] == "agent":
        from spotline.launch.agent import main as agent_main

        return agent_main(argv[1:])
    if argv and argv[0] == "simulate":
        from spotline.launch.simulate import main as simulate_main

        return simulate_main(argv[1:])
    if argv and argv[0] == "calibrate":
        from spotline.launch.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv and argv[0] == "bench":
        from spotline.launch.bench.command import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command in ("train", "coordinator"):
        return cmd_train(args)
    return fail(f"unknown command {args.command}")  # pragma: no cover - argparse rejects it


if __name__ == "__main__":
    sys.exit(main())
