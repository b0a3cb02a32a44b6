"""The user's model and corpus, checked in a child process before any worker starts.

Resolving them (:func:`spotline.inputs.prepare_inputs`: the model's config, the tokenizer,
a corpus large enough for a step) imports transformers' config and tokenizer code and
datasets: seconds of imports that the coordinator, the process that never trains, must not
hold. So ``spotline train`` runs the check in a short-lived child (``python -m
spotline.launch.control.inputs``, the resolved config as JSON on stdin) that exits with
:data:`USER_ERROR_EXIT` and the user error's one line on stdout, or 0 and what the data
turned into (``spotline.inputs.Inputs.summary``: the corpus's ``summary()`` and the eval
set's, for ``summary.json``'s ``data``) as the last line
of its stdout; what the data's loading has to tell the user once (records truncated to
``--seq-len``) it prints on stderr, which reaches the user's terminal. The child does what a
worker does before it can join (an interpreter, these imports, the corpus), so its wall time
is a lower bound of a worker's start-up, which the trace checks use. Meanwhile the parent
imports torch for the store it hosts next, so the check costs about what it did in process.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from spotline.config import RunConfig, parse_config
from spotline.errors import UserError

USER_ERROR_EXIT = 2


@dataclass(frozen=True)
class CheckedInputs:
    """What checking the inputs measured and found."""

    # The child's wall time: a lower bound of a worker's start-up.
    startup_s: float
    # What the data became (spotline.inputs.Inputs.summary): summary.json's "data".
    data: dict[str, Any]


def check_inputs(cfg: RunConfig) -> CheckedInputs:
    """Resolve ``cfg``'s model and corpus in a child process; raise :class:`UserError` with its
    one line if the user got one wrong."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "spotline.launch.control.inputs", cfg.source],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # While the child imports the training stack, this process imports the torch it
        # needs anyway for the job store (spotline.stores): the two imports overlap
        # instead of adding up.
        importlib.import_module("spotline.stores")
        out, err = proc.communicate(json.dumps(cfg.to_json()))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    seconds = time.perf_counter() - t0
    # What the libraries print (warnings, a download's progress) reaches the user as before.
    sys.stderr.write(err)
    if proc.returncode == USER_ERROR_EXIT:
        raise UserError(out.strip())
    if proc.returncode != 0:
        raise RuntimeError(
            f"checking the model and corpus failed (exit {proc.returncode}); its error is above"
        )
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines, "the input check printed no data summary"
    return CheckedInputs(startup_s=seconds, data=json.loads(lines[-1]))


def main() -> int:
    """The child: read the config from stdin, resolve the model and corpus."""
    # Here, not at the top: the coordinator's process imports this module for check_inputs.
    from spotline.inputs import prepare_inputs

    cfg = parse_config(json.loads(sys.stdin.read()), source=sys.argv[1])
    try:
        inputs = prepare_inputs(cfg)
    except UserError as exc:
        print(str(exc), flush=True)
        return USER_ERROR_EXIT
    for note in inputs.data.notes():
        print(f"spotline: {note}", file=sys.stderr, flush=True)
    print(json.dumps(inputs.summary()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
