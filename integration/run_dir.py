"""A run's output directory: the names of what a run writes there, and the rules that keep
one directory one run's record.

A directory holds one run. A new run into a directory that holds any earlier run's output
is refused (its summary, model and wandb run would be overwritten or taken over); a
stopped run is continued with ``--resume``, a finished one is left as it is. The bottom
floor: nothing here imports torch, DeepSpeed or another spotline module but the errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spotline.errors import UserError

SUMMARY_NAME = "summary.json"  # written once, when the run finishes
RESOLVED_NAME = "config.resolved.json"  # the config the run trains, written at its start
# The run's wandb id and how far it was logged: the one wandb run a --resume continues.
WANDB_RUN_NAME = "wandb-run.json"
WANDB_DIR = "wandb"
# What a part of a run that ended without finishing (a stop, a second Ctrl-C, an error)
# had recorded: counters, events, timeline, step times; a --resume starts from it.
RECORD_NAME = "run-record.json"
MODEL_DIR = "model"
BEST_MODEL = "best"  # the link to the best evaluation's model
EVAL_MODELS = "eval-models"  # the best models' directories (the one `best` names)
TIMELINE_CSV = "timeline.csv"
TIMELINE_PNG = "timeline.png"
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"
TOKEN_NAME = "job-token"  # the coordinator's generated job token
ETCD_JOB_NAME = "job.json"  # the running etcd job's store, for a restarted coordinator
HF_JOB_DIR = "hf-job"  # the job a Hugging Face script's Trainer described

# Every name above: a directory holding any of them holds (part of) a run.
RUN_OUTPUTS = (
    SUMMARY_NAME,
    RESOLVED_NAME,
    WANDB_RUN_NAME,
    WANDB_DIR,
    RECORD_NAME,
    MODEL_DIR,
    BEST_MODEL,
    EVAL_MODELS,
    TIMELINE_CSV,
    TIMELINE_PNG,
    LOGS_DIR,
    CHECKPOINTS_DIR,
    TOKEN_NAME,
    ETCD_JOB_NAME,
    HF_JOB_DIR,
)


def earlier_run_outputs(output: Path) -> list[str]:
    """The names in ``output`` that an earlier run wrote (an empty list: none; an empty
    directory or one holding only other files is free). ``checkpoints`` counts only when it
    holds something."""
    found = []
    for name in RUN_OUTPUTS:
        path = output / name
        if not (path.exists() or path.is_symlink()):
            continue
        if name == CHECKPOINTS_DIR and path.is_dir() and not any(path.iterdir()):
            continue
        found.append(f"{name}/" if path.is_dir() else name)
    return found


def finished_summary(output: Path) -> dict[str, Any] | None:
    """The summary of the run that finished in ``output`` (None: none finished there)."""
    path = output / SUMMARY_NAME
    if not path.is_file():
        return None
    try:
        summary: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # unreadable, but a run wrote it: still a finished run's directory
    return summary


def refuse_earlier_run(output: Path, *, flag: str = "--output", resume: str | None) -> None:
    """A new run's output directory must hold no earlier run's output: a UserError naming
    what is there, how to continue it (``resume``: the command, for a stopped run; None:
    this entry point cannot) and the fresh directory to pass otherwise."""
    found = earlier_run_outputs(output)
    if not found:
        return
    listed = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
    if finished_summary(output) is not None:
        # Nothing to continue either: a finished run's directory stays its record.
        nothing = "" if resume is None else " (a finished run has nothing to --resume)"
        raise UserError(
            f"{flag} {output} holds a finished run ({listed}), kept as it is{nothing}; pass "
            f"a fresh {flag} for this run"
        )
    if resume is None:
        raise UserError(f"{flag} {output} holds an earlier run ({listed}); pass a fresh {flag}")
    raise UserError(
        f"{flag} {output} holds an earlier run ({listed}); continue a stopped run with "
        f"`{resume}`, or pass a fresh {flag}"
    )


def refuse_finished_resume(output: Path) -> None:
    """``--resume`` of a run that finished: a UserError saying so (nothing to continue)."""
    summary = finished_summary(output)
    if summary is None:
        return
    steps = summary.get("steps")
    done = f" all {steps} steps" if isinstance(steps, int) else ""
    raise UserError(
        f"--resume {output}: that run finished{done} ({output / SUMMARY_NAME}); nothing to "
        "continue: to train further, start a new run with a fresh --output"
    )
