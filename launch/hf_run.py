"""``spotline run [spotline flags] SCRIPT.py [script args]``: a Hugging Face script's
``spotline.hf.Trainer`` under the coordinator.

1. The script runs once in a child (``python -m spotline.launch.hf_run SCRIPT ...`` with
   ``spotline.hf.MODE_ENV`` set): its Trainer's constructor writes the job (model, token
   rows, the config keys its TrainingArguments decide) into a temporary directory and ends
   the script. A script that ends without constructing the Trainer, or a value Spotline
   cannot honour, is one line and exit 2, with nothing written.
2. The job's config (``spotline.hf.build_config``: --config or the script's
   ``spotline_config``, the flags, then the script's keys) is checked like ``spotline
   train``'s (the input-check child), the job moves to ``OUTPUT/hf-job`` and the coordinator
   runs it as it runs ``spotline train``; every worker runs the script again, whose
   Trainer checks the job and whose ``train()`` is the worker's run (``spotline.hf``).

``--resume DIR`` continues a stopped ``spotline run`` (its job is in DIR) as ``spotline
train --resume DIR`` does; it takes no script.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from spotline.errors import UserError
from spotline.launch.flags import overrides_from_args
from spotline.launch.train_command import (
    build_train_parser,
    check_new_output,
    cmd_train,
    fail,
    start_run,
    validate_recovery,
)

USAGE = "spotline run [--config C --workers N ...] SCRIPT.py [script args]"


def _split(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """Spotline's flags, the script (the first argument ending in .py) and its arguments."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py") and not arg.startswith("-"):
            return argv[:i], arg, argv[i + 1 :]
    return argv, None, []


def _describe(script: str, script_args: list[str], job_dir: Path) -> int:
    """Run the describing child; its exit code (it said what went wrong, if anything)."""
    from spotline.hf import DESCRIBE, JOB_ENV, MODE_ENV

    env = dict(os.environ, **{MODE_ENV: DESCRIBE, JOB_ENV: str(job_dir)})
    cmd = [sys.executable, "-m", "spotline.launch.hf_run", script, *script_args]
    return subprocess.run(cmd, env=env, check=False).returncode


def _run(args: argparse.Namespace, script: str, script_args: list[str]) -> int:
    from spotline.hf import JOB_DIR, Job, build_config
    from spotline.launch.control.input_check import check_inputs

    if not Path(script).is_file():
        return fail(f"spotline run: {script}: no such file; pass the path of your script")
    staging = Path(tempfile.mkdtemp(prefix="spotline-job-"))
    try:
        code = _describe(script, script_args, staging / JOB_DIR)
        if code != 0:
            if code != 2:
                print(
                    f"spotline: error: {script} failed (exit {code}) before it constructed "
                    "spotline.hf.Trainer; its error is above",
                    file=sys.stderr,
                )
            return 2
        job = Job.read(staging / JOB_DIR)
        output = Path(args.output or job.output_dir)
        config_path = args.config or job.spotline_config
        flags = overrides_from_args(args)
        # Checked at the staged job's paths; the run's config names the job in the output.
        staged = build_config(
            job, staging / JOB_DIR, config_path=config_path, flags=flags, plain=False
        )
        check_new_output(staged, output, command="spotline run")
        checked = check_inputs(staged)
        validate_recovery(staged, startup_s=checked.startup_s)
        output.mkdir(parents=True, exist_ok=True)
        final = output / JOB_DIR  # not there: check_new_output refuses an earlier run's
        shutil.move(str(staging / JOB_DIR), str(final))
        cfg = build_config(job, final, config_path=config_path, flags=flags, plain=False)
    except UserError as exc:
        return fail(str(exc))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return start_run(cfg, output, None, checked.summary_fields())


def main(argv: list[str]) -> int:
    """``spotline run``'s arguments (after ``run``); the exit code."""
    ours, script, script_args = _split(argv)
    parser = argparse.ArgumentParser(prog="spotline run", usage=USAGE)
    build_train_parser(parser)
    args = parser.parse_args(ours)
    if args.resume is not None:
        if script is not None:
            return fail("spotline run --resume DIR continues DIR's job; give no script")
        return cmd_train(args)
    if script is None:
        return fail(f"spotline run: no script (a .py file); usage: {USAGE}")
    return _run(args, script, script_args)


def describe_main() -> int:
    """The describing child: run the script until its Trainer wrote the job."""
    from spotline.hf import JobDescribed, describe_script

    script, *script_args = sys.argv[1:]
    try:
        describe_script(script, script_args)
    except JobDescribed:
        return 0
    except UserError as exc:
        print(f"spotline: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(
        f"spotline: error: spotline run: {script} ended without constructing "
        "spotline.hf.Trainer; build the model and datasets, then pass them to "
        "spotline.hf.Trainer(model=..., args=..., train_dataset=...)",
        file=sys.stderr,
        flush=True,
    )
    return 2


if __name__ == "__main__":
    sys.exit(describe_main())
