"""The user's model and corpus, checked in a child process before any worker starts.

Resolving them (:func:`spotline.data.inputs.prepare_inputs`: the model's config, the tokenizer,
a corpus large enough for a step) imports transformers' config and tokenizer code and
datasets: seconds of imports that the coordinator, the process that never trains, must not
hold. So ``spotline train`` runs the check in a short-lived child (``python -m
spotline.launch.control.input_check``, the resolved config as JSON on stdin) that exits with
:data:`USER_ERROR_EXIT` and the user error's one line on stdout, or 0 and what the data
turned into (``spotline.data.inputs.Inputs.summary``: the corpus's ``summary()`` and the eval
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spotline.config import RunConfig, parse_config
from spotline.config_precision import host_precision_refusal
from spotline.errors import UserError

USER_ERROR_EXIT = 2


@dataclass(frozen=True)
class CheckedInputs:
    """What checking the inputs measured and found."""

    # The child's wall time: a lower bound of a worker's start-up.
    startup_s: float
    # What the data became (spotline.data.inputs.Inputs.summary): summary.json's "data".
    data: dict[str, Any]
    # Each logical stage's worker's estimated bytes (spotline.plan.memory_estimate).
    memory_estimate_per_stage: list[dict[str, int]]

    def summary_fields(self) -> dict[str, Any]:
        """What summary.json records of the inputs."""
        return {"data": self.data, "memory_estimate_per_stage": self.memory_estimate_per_stage}


class PendingCheck:
    """The check's child, started (:func:`start_check`); :meth:`result` waits for it."""

    def __init__(self, cfg: RunConfig) -> None:
        self._t0 = time.perf_counter()
        self._config = json.dumps(cfg.to_json())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "spotline.launch.control.input_check", cfg.source],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def result(self, while_waiting: Callable[[], object] | None = None) -> CheckedInputs:
        """Wait for the child, calling ``while_waiting`` every few hundredths of a second
        meanwhile; raise :class:`UserError` with its one line if the user got the model or
        corpus wrong."""
        proc = self._proc
        try:
            # While the child imports the training stack, this process imports the torch it
            # needs anyway for the job store (spotline.wire.stores): the two imports overlap
            # instead of adding up.
            importlib.import_module("spotline.wire.stores")
            given: str | None = self._config
            while True:
                try:
                    # The input goes on the first call only (communicate keeps the rest).
                    out, err = proc.communicate(
                        given, timeout=None if while_waiting is None else 0.05
                    )
                    break
                except subprocess.TimeoutExpired:
                    given = None
                    assert while_waiting is not None
                    while_waiting()
        except BaseException:
            self.kill()
            raise
        seconds = time.perf_counter() - self._t0
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
        found = json.loads(lines[-1])
        return CheckedInputs(
            startup_s=seconds,
            data=found["data"],
            memory_estimate_per_stage=found["memory_estimate_per_stage"],
        )

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


def start_check(cfg: RunConfig) -> PendingCheck:
    """Start resolving ``cfg``'s model and corpus in a child process (what the caller does
    meanwhile overlaps with its imports)."""
    return PendingCheck(cfg)


def check_inputs(cfg: RunConfig) -> CheckedInputs:
    """Resolve ``cfg``'s model and corpus in a child process; raise :class:`UserError` with its
    one line if the user got one wrong."""
    return start_check(cfg).result()


def check_host_precision(cfg: RunConfig) -> None:
    """Refuse a precision this machine's accelerator does not have (DeepSpeed's answer)."""
    if cfg.precision == "fp32":
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    refusal = host_precision_refusal(
        cfg.precision,
        fp16_supported=bool(accelerator.is_fp16_supported()),
        bf16_supported=bool(accelerator.is_bf16_supported()),
    )
    if refusal is not None:
        raise UserError(refusal)


def main() -> int:
    """The child: read the config from stdin, resolve the model and corpus."""
    # Here, not at the top: the coordinator's process imports this module for check_inputs.
    from spotline.data.inputs import prepare_inputs
    from spotline.plan.memory_estimate import describe, over_limit
    from spotline.reports.memory_report import estimate_run

    cfg = parse_config(json.loads(sys.stdin.read()), source=sys.argv[1])
    try:
        check_host_precision(cfg)
        inputs = prepare_inputs(cfg)
        memory = estimate_run(cfg, inputs.hf_config)
        limit = cfg.spotline.topology.memory_per_slot_gb
        too_big = None if limit is None else over_limit(memory, limit)
        if too_big is not None:
            raise UserError(too_big)
    except UserError as exc:
        print(str(exc), flush=True)
        return USER_ERROR_EXIT
    for note in inputs.data.notes():
        print(f"spotline: {note}", file=sys.stderr, flush=True)
    print(f"spotline: {describe(memory)}", file=sys.stderr, flush=True)
    found = {"data": inputs.summary(), "memory_estimate_per_stage": [m.to_json() for m in memory]}
    print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
