"""``spotline train`` and ``spotline coordinator``: check a run, start it, supervise it.

The whole run (config, model, corpus) is validated before any worker starts; then the
coordinator starts the local worker processes itself, so that it can later kill, replace
and add workers. A user mistake is one line on stderr and exit code 2, with nothing written
that looks like a finished run. ``spotline run`` (``spotline.launch.hf_run``) checks and
starts its job with the same functions.

An output directory that holds checkpoints belongs to its run: ``--resume DIR`` continues
that run from its last committed checkpoint (the math-deciding config must match), and a new
run into it is refused, never cleared. A first Ctrl-C stops at the next step boundary that
has a checkpoint and says how to resume; a second one stops at once (exit 130 either way).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from spotline.config import RunConfig, load_config, parse_config, with_overrides
from spotline.config_resume import resume_mismatch
from spotline.errors import UserError
from spotline.launch.flags import add_recovery_flags, add_run_flags, overrides_from_args
from spotline.launch.run_summary import format_summary
from spotline.run_dir import (
    ETCD_JOB_NAME,
    RESOLVED_NAME,
    TOKEN_NAME,
    finished_summary,
    refuse_earlier_run,
    refuse_finished_resume,
)

if TYPE_CHECKING:  # the coordinator imports the control plane: only when a run starts
    from spotline.launch.coordinator import Coordinator, Stopped

EXIT_USAGE = 2


def fail(message: str) -> int:
    print(f"spotline: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def build_train_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="DeepSpeed config JSON with a 'spotline' section")
    parser.add_argument("--output", help="output directory (default: runs/<time>)")
    parser.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the stopped run whose output directory is DIR from its last checkpoint",
    )
    add_run_flags(parser, with_workers=True)
    add_recovery_flags(parser)


def resolve_config(args: argparse.Namespace) -> RunConfig:
    return with_overrides(load_config(args.config), overrides_from_args(args))


def check_output(output: Path) -> None:
    """``--output`` must be a directory or a path one can create: checked before any work."""
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file; pass a directory (new or existing)")
    if output.is_dir():
        if not os.access(output, os.W_OK | os.X_OK):
            raise UserError(f"--output {output} is not writable; pass a directory you can write")
        return
    ancestor = output.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"--output {output} cannot be created: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"--output {output} cannot be created: {ancestor} is not writable")


def resume_config(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """``--resume DIR``: the config to continue with (the stopped run's, or --config's, with
    the flags on top) and the output directory (DIR). The math-deciding keys must match."""
    output = Path(args.resume)
    saved = output / RESOLVED_NAME
    if not saved.is_file():
        raise UserError(
            f"--resume {output}: no {RESOLVED_NAME} there; pass the output directory of a "
            "stopped `spotline train` run"
        )
    refuse_finished_resume(output)
    if args.output is not None and Path(args.output).resolve() != output.resolve():
        raise UserError(
            f"--resume {output} continues the run in {output}; drop --output {args.output} "
            "or make it the same directory"
        )
    stopped = load_config(saved)
    if args.config is not None:
        base = load_config(args.config)
    else:
        # The stopped run's injected faults were its own, at its steps: not replayed.
        raw = stopped.to_json()
        raw["spotline"]["recovery"]["inject"] = []
        raw["spotline"]["elasticity"]["rescale"] = None
        base = parse_config(raw, source=str(saved))
    cfg = with_overrides(base, overrides_from_args(args))
    problem = resume_mismatch(stopped, cfg)
    if problem is not None:
        raise UserError(f"--resume {output}: {problem}")
    if cfg.checkpoint_root(output) != stopped.checkpoint_root(output):
        raise UserError(
            f"--resume {output}: spotline.checkpoints.dir is "
            f"{cfg.spotline.checkpoints.dir!r} here but {stopped.spotline.checkpoints.dir!r} "
            "in the stopped run, whose checkpoints a resume reads; keep it"
        )
    return cfg, output


def cmd_train(args: argparse.Namespace) -> int:
    try:
        return _cmd_train(args)
    except KeyboardInterrupt:  # before any worker started: nothing to stop
        print("spotline: interrupted", file=sys.stderr, flush=True)
        return 130


def _cmd_train(args: argparse.Namespace) -> int:
    token_file = getattr(args, "token_file", None)
    try:
        listen = _parse_listen(args.listen) if getattr(args, "listen", None) else None
        cfg, output, resume_from, inputs, coordinator = _prepare_run(
            args, head_start=listen is None and token_file is None, listen=listen
        )
    except UserError as exc:
        return fail(str(exc))
    return start_run(
        cfg,
        output,
        resume_from,
        inputs,
        listen=listen,
        token_file=token_file,
        coordinator=coordinator,
    )


def _make_coordinator(
    cfg: RunConfig,
    output: Path,
    resume_from: int | None,
    *,
    listen: tuple[str, int] | None,
    token_file: str | None,
) -> Coordinator:
    """The job's coordinator (its store up, its token written), the resolved config in
    ``output``; a UserError if it cannot be (e.g. an unreachable etcd)."""
    from spotline.atomic_files import write_json_atomic
    from spotline.reports.tracking import SUMMARY_NAME

    # A summary left by an earlier run in this directory must not pass for this run's.
    (output / SUMMARY_NAME).unlink(missing_ok=True)
    resolved = output / RESOLVED_NAME
    # What this call adds to the directory, taken back if the coordinator cannot start.
    created = [path for path in (resolved, output / TOKEN_NAME) if not path.exists()]
    write_json_atomic(resolved, cfg.to_json())

    from spotline.launch.coordinator import Coordinator, child_environment

    # Before torch loads (the store): c10d's warnings come with a C++ stack, and a store
    # server on a machine without reverse DNS warns at every connection.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env = child_environment()
    env["OMP_NUM_THREADS"] = str(cfg.spotline.determinism.intra_op_threads)
    try:
        return Coordinator(
            cfg,
            resolved,
            output,
            env=env,
            resume_from=resume_from,
            listen=listen,
            token_file=token_file,
        )
    except BaseException:
        # A refused start (an etcd out of reach, an address taken since it was checked)
        # leaves no config or token behind that would pass for a run's.
        for path in created:
            path.unlink(missing_ok=True)
        raise


def start_run(
    cfg: RunConfig,
    output: Path,
    resume_from: int | None,
    inputs: dict[str, Any],
    *,
    listen: tuple[str, int] | None = None,
    token_file: str | None = None,
    coordinator: Coordinator | None = None,
) -> int:
    """Run a checked job (``_prepare_run``'s results) under a coordinator to its end
    (``coordinator``: the one ``_prepare_run`` started while it checked the inputs)."""
    if coordinator is None:
        try:
            coordinator = _make_coordinator(
                cfg, output, resume_from, listen=listen, token_file=token_file
            )
        except UserError as exc:  # e.g. an unreachable etcd
            return fail(str(exc))
    return _supervise(coordinator, output, inputs)


def _parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UserError(
            f"--listen {text!r} is not ADDR:PORT; give an address of this machine the agents "
            "reach, e.g. --listen 10.0.0.5:29400"
        )
    return host, int(port)


def check_listen(host: str, port: int) -> None:
    """UserError unless this machine can listen on ``host:port`` (an address it has, a port
    free), found by binding a socket there and closing it at once: checked before anything
    is written, so a wrong ``--listen`` leaves nothing behind (the store binds it later)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As the store's listener does: a port left in TIME_WAIT by a run just ended is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UserError(
                f"--listen {host}:{port}: cannot listen there ({exc.strerror}); give an "
                "address of this machine and a free port (0 lets the system choose)"
            ) from None


def _prepare_run(
    args: argparse.Namespace,
    *,
    head_start: bool = False,
    listen: tuple[str, int] | None = None,
) -> tuple[RunConfig, Path, int | None, dict[str, Any], Coordinator | None]:
    """Everything checked before any worker starts: the config, the output directory, the
    model and corpus, the recovery settings, ``listen`` (``spotline coordinator``'s address,
    where its TCP store will listen). Returns the config, the output directory
    (created), the step a resume continues from (None: step 0), what the inputs turned into
    (summary.json's ``data`` and ``memory_estimate_per_stage``) and, with ``head_start``, the coordinator if it was started
    while the inputs were checked (else None: the caller makes it)."""
    if args.resume is not None:
        cfg, output = resume_config(args)
    else:
        cfg, output = _new_run_config(args)
    if listen is not None and cfg.spotline.recovery.store == "tcp":
        check_listen(*listen)
    # A one-line error before any worker starts for a missing model directory or a corpus
    # too small for a batch, checked in a child process: this one, the coordinator's,
    # never loads transformers or DeepSpeed. Its wall time (what a worker does before it
    # can join) is a lower bound of a worker's start-up.
    from spotline.launch.control.input_check import start_check

    check = start_check(cfg)
    coordinator = None
    try:
        if head_start and args.resume is None and cfg.spotline.recovery.store == "tcp":
            coordinator = _head_start(cfg, output)
        # A head start's agent is admitted as soon as it registers (it waits only so long).
        checked = check.result(None if coordinator is None else coordinator.admit_machines)
        validate_recovery(cfg, startup_s=checked.startup_s)
        resume_from = _resume_step(cfg, output) if args.resume is not None else None
        try:
            output.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--output {output} cannot be created: {exc}") from None
    except BaseException:
        check.kill()
        if coordinator is not None:
            # Bad input (or a Ctrl-C) after the head start: nothing of this run is left,
            # neither its agent nor its output directory (this command made it).
            coordinator.abandon()
            shutil.rmtree(output, ignore_errors=True)
        raise
    return cfg, output, resume_from, checked.summary_fields(), coordinator


def _head_start(cfg: RunConfig, output: Path) -> Coordinator | None:
    """``spotline train`` into a new directory: the coordinator and its local agent start
    while the child checks the inputs, so the agent's spawner imports the training stack
    (seconds) meanwhile instead of after. None where the output directory already exists
    (what a failed check would leave in it could not be told from what was there) or
    cannot be made: the check's error comes first then, as without a head start."""
    try:
        output.mkdir()  # not its parents: a failed check must leave no directory behind
    except OSError:
        return None
    try:
        coordinator = _make_coordinator(cfg, output, None, listen=None, token_file=None)
    except BaseException:
        shutil.rmtree(output, ignore_errors=True)
        raise
    coordinator.start_local_agent()
    return coordinator


def _new_run_config(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """A new run (no ``--resume``): its config and output directory, which must not hold an
    earlier run's checkpoints."""
    cfg = resolve_config(args)
    output = Path(args.output or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    command = getattr(args, "command", None) or "train"
    # A coordinator restarted with the same --output over etcd takes its predecessor's
    # running job over (the job file says one did not end): the one reuse of a directory.
    takeover = (
        command == "coordinator"
        and cfg.spotline.recovery.store == "etcd"
        and (output / ETCD_JOB_NAME).is_file()
    )
    check_new_output(cfg, output, command=f"spotline {command}", takeover=takeover)
    return cfg, output


def check_new_output(
    cfg: RunConfig, output: Path, *, command: str = "spotline train", takeover: bool = False
) -> None:
    """A new run's ``--output``: usable, without an earlier run's checkpoints, and (unless
    ``takeover``) without any earlier run's output (``command``: the one that resumes)."""
    check_output(output)
    if not takeover and finished_summary(output) is not None:
        refuse_earlier_run(output, resume=f"{command} --resume {output}")  # says: finished
    shared = cfg.spotline.checkpoints.dir
    root = cfg.checkpoint_root(output)
    if root.is_dir() and any(root.iterdir()):
        # A restore must never read another job's checkpoint, and a rerun must never
        # destroy the checkpoints of the run it repeats.
        if shared:
            raise UserError(
                f"checkpoints.dir {shared} already holds files from another run; "
                "continue that run with --resume (its --output directory), empty "
                "checkpoints.dir or give this run its own directory"
            )
        raise UserError(
            f"--output {output} holds the checkpoints of an earlier run; continue it "
            f"with `{command} --resume {output}`, or pass another --output"
        )
    if not takeover:
        # A finished run's summary, model and wandb run would be overwritten or taken over.
        refuse_earlier_run(output, resume=f"{command} --resume {output}")


def _resume_step(cfg: RunConfig, output: Path) -> int | None:
    """The last committed checkpoint a resume continues from (None: step 0), said on stderr."""
    from spotline.checkpointing.manifest import latest_complete

    root = cfg.checkpoint_root(output)
    resume_from = latest_complete(root) if root.is_dir() else None
    if resume_from is None:
        print(
            f"spotline: {output} has no committed checkpoint; training from step 0",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(f"spotline: resuming from step {resume_from}", file=sys.stderr, flush=True)
    return resume_from


def _supervise(coordinator: Coordinator, output: Path, inputs: dict[str, Any]) -> int:
    """Run the job to its end with Ctrl-C handled (the first one stops at a checkpointed step
    boundary, a second at once), write and print its summary (``inputs``: what the inputs turned
    into); the exit code."""
    from spotline.atomic_files import write_json_atomic
    from spotline.launch.coordinator import Stopped
    from spotline.reports.tracking import SUMMARY_NAME

    interrupts = 0

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            coordinator.request_stop()  # the coordinator's loop picks the boundary
        else:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    resume_hint = f"resume with: spotline train --resume {output}"
    try:
        summary = coordinator.run()
    except Stopped as stop:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the workers have exited already
        # Before the store goes: what was committed goes to wandb, where --resume continues,
        # and the part's record (counters, events) to the output, which --resume goes on.
        coordinator.save_record("stopped", stop.stopped_at)
        coordinator.log_stopped_to_wandb(stop.step or 0)
        coordinator.shutdown()
        print(f"spotline: {_stopped_message(stop, resume_hint)}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        # A second Ctrl-C: stop at once (a third one must not interrupt the cleanup).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        coordinator.save_record("interrupted", coordinator.metrics.best_progress)
        coordinator.shutdown()
        step = coordinator.last_committed()
        since = "step 0" if step is None else f"step {step}"
        print(f"spotline: stopped at once; {resume_hint} (from {since})", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        coordinator.save_record("failed", coordinator.metrics.best_progress)
        coordinator.shutdown()
        print(f"spotline: error: {exc}; see {output}/logs", file=sys.stderr)
        return 1
    except BaseException:
        coordinator.shutdown()
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if summary.get("param_sha256") is None:
        print(
            f"spotline: error: the run ended without a result; see {output}/logs", file=sys.stderr
        )
        return 1
    summary.update(inputs)
    write_json_atomic(output / SUMMARY_NAME, summary)
    coordinator.finished()
    coordinator.log_to_wandb(summary)
    print(format_summary(summary, output))
    return 0


def _stopped_message(stop: Stopped, resume_hint: str) -> str:
    """What a stop requested by a first Ctrl-C says: where it stopped, how to resume."""
    if stop.step == stop.stopped_at:
        return f"stopped at step {stop.stopped_at}; {resume_hint}"
    since = "step 0" if stop.step is None else f"its last checkpoint, step {stop.step}"
    return f"stopped at step {stop.stopped_at} without its checkpoint; {resume_hint} (from {since})"


def validate_recovery(cfg: RunConfig, *, startup_s: float = 0.0) -> None:
    """Recovery inputs a user can get wrong: inject specs, trace files, rates, and a trace
    whose nodes (at ``time_scale``, on the wall clock) die before a worker can start
    (``startup_s``: a worker's start-up measured on this machine)."""
    from spotline.plan.chaos import (
        check_injections,
        check_node_lifetimes,
        check_rescales,
        parse_injections,
        parse_rescales,
        replay_trace,
    )
    from spotline.plan.traces import load_trace

    rec = cfg.spotline.recovery
    injections = parse_injections(rec.inject)
    check_injections(injections, num_workers=cfg.num_workers, num_steps=cfg.spotline.training.steps)
    check_rescales(
        parse_rescales(cfg.spotline.elasticity.rescale),
        num_steps=cfg.spotline.training.steps,
        num_stages=cfg.num_stages,
        max_workers=rec.max_workers or 64,
    )
    if rec.trace is not None:
        if not Path(rec.trace).is_file():
            raise UserError(
                f"--trace {rec.trace}: no such file; pass a trace file (formats and public traces: integration/assets/traces/README.md)"
            )
        try:
            trace = load_trace(rec.trace)
        except ValueError as exc:
            raise UserError(f"--trace {rec.trace}: {exc}") from None
        cap = rec.max_workers or cfg.num_workers
        need = cfg.num_stages * cfg.num_physical_pipelines
        # The smallest layout the planner runs (stages folded onto fewer workers) still
        # needs one worker per pipeline; a full one needs `need`. Ask for the full one: a
        # trace that never reaches it would train a degraded pipeline or wait forever.
        if rec.time_scale > 0:
            try:
                replay = replay_trace(
                    trace, max_workers=cap, time_scale=rec.time_scale, removal=rec.trace_removal
                )
            except ValueError as exc:
                raise UserError(f"--trace {rec.trace}: {exc}") from None
            peak = replay.peak_workers(cap)
            if peak < need:
                raise UserError(
                    f"--trace {rec.trace}: at most {peak} worker(s) are ever live (with "
                    f"--max-workers {cap}), fewer than the {need} that {cfg.num_stages} "
                    f"stage(s) x {cfg.num_physical_pipelines} pipeline(s) need; raise --max-workers or "
                    "use fewer stages or workers"
                )
            if rec.trace_clock == "wall":
                check_node_lifetimes(
                    trace,
                    max_workers=cap,
                    time_scale=rec.time_scale,
                    startup_s=startup_s,
                    name=rec.trace,
                )
    if rec.time_scale <= 0:
        raise UserError(
            f"--time-scale {rec.time_scale}: expected a positive number of trace seconds per second"
        )
    if rec.preempt_rate < 0:
        raise UserError(f"--preempt-rate {rec.preempt_rate}: expected a rate >= 0 per worker-hour")
