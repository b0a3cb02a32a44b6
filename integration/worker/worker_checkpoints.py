"""An elastic worker's checkpoints: each logical stage's file at the steps the plan says, at a
stop, and every stage back from disk after a fatal loss.

Pipeline 0's members write (data-parallel peers hold identical state), one file per
logical stage (``stage-<s>``) through ``spotline.checkpointing.checkpoint.CheckpointWriter``'s
background thread; the coordinator commits a step (writes its manifest) once every stage's
file is there. A write that fails is told to the coordinator (``checkpoint-error/<n>``)
instead of stopping the run: the checkpoint is a fallback, the in-memory state is the
recovery.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spotline.checkpointing.checkpoint import CheckpointWriter, load_all
from spotline.pipeline.redundancy import RedundantPipelineEngine
from spotline.plan.loss_scale import NO_SCALING, LossScaleState
from spotline.wire.auth import AuthStore
from spotline.wire.protocol import (
    CHECKPOINT_ERRORS_COUNTER,
    CheckpointWriteError,
    checkpoint_error_key,
    stop_checkpoint_key,
)
from spotline.worker.holdings import Holdings, StageState, engine_stages

# A stage file's keys besides its tensors: its step, the loss scaler before it, and what a
# restore must agree with.
_META = ("version", "loss_scale", "logical_workers", "seed")


def stage_payload(st: StageState, *, logical_workers: int, seed: int) -> dict[str, Any]:
    """A stage's checkpoint file: its tensors by ``param/<name>`` and ``<opt key>/<name>``."""
    # What a restore must agree with: everything else a logical worker owns (its samples,
    # its dropout seeds) is a function of (seed, step, logical worker).
    payload: dict[str, Any] = {
        "version": st.version,
        "loss_scale": list(st.loss_scale.to_floats()),
        "logical_workers": logical_workers,
        "seed": seed,
    }
    for name in st.params:
        payload[f"param/{name}"] = st.params[name]
        for key, value in st.opt[name].items():
            payload[f"{key}/{name}"] = value
    return payload


def stage_of_payload(
    label: str, step: int, payload: dict[str, Any], *, logical_workers: int, seed: int
) -> StageState:
    """The stage :func:`stage_payload` wrote (file ``label`` of ``step``); another job's
    file (another seed or number of logical workers) is refused."""
    for key, expected in (("logical_workers", logical_workers), ("seed", seed)):
        if payload.get(key, expected) != expected:
            raise RuntimeError(
                f"checkpoint {label} of step {step} was written with {key} "
                f"{payload[key]}, this run has {expected}: it is another job's"
            )
    # A file without a scaler is an fp32 or bf16 run's from before fp16: no scaling.
    scale = payload.get("loss_scale")
    st = StageState(
        int(payload["version"]),
        {},
        {},
        loss_scale=NO_SCALING.initial() if scale is None else LossScaleState.from_floats(scale),
    )
    for key, value in payload.items():
        if key in _META:
            continue
        kind, name = key.split("/", 1)
        if kind == "param":
            st.params[name] = value
        else:
            st.opt.setdefault(name, {})[kind] = value
    return st


def restore_holdings(root: Path, step: int, *, logical_workers: int, seed: int) -> Holdings:
    """Fatal loss: every logical stage from the complete checkpoint of ``step`` on disk."""
    holdings = Holdings()
    for label, payload in load_all(root, step).items():
        stage = int(label.split("-")[1])
        holdings.stages[stage] = stage_of_payload(
            label, step, payload, logical_workers=logical_workers, seed=seed
        )
    return holdings


class WorkerCheckpoints:
    """Worker ``wid``'s checkpoint writes under ``root`` (``keep`` kept) and their failures."""

    def __init__(
        self,
        root: Path,
        keep: int,
        wid: str,
        note: Callable[[str], None],
        *,
        logical_workers: int,
        seed: int,
        interval: int,
    ) -> None:
        self.root = root
        self.keep = keep
        self.wid = wid
        self.note = note
        self.logical_workers = logical_workers
        self.seed = seed
        # Every plan says when (the coordinator decides: given, Young/Daly, or shorter
        # while the plan is exposed: spotline.plan.exposure): :meth:`follow`.
        self.interval = interval
        self.start = 0
        self._writer: CheckpointWriter | None = None
        # Writes that failed (from the writer's thread), not yet told to the store.
        self._errors: list[CheckpointWriteError] = []
        self._errors_lock = threading.Lock()

    def follow(self, interval: int, start: int) -> None:
        """A plan's schedule: steps ``start + k * interval`` (k >= 0); interval 0: none."""
        self.interval, self.start = interval, start

    def due(self, step: int) -> bool:
        """Whether the plan's schedule checkpoints committed step ``step`` (``PlanMessage``)."""
        interval, start = self.interval, self.start
        return interval > 0 and step >= start and (step - start) % interval == 0

    def maybe_write(
        self, engine: RedundantPipelineEngine, logical: Sequence[int], step: int
    ) -> None:
        if self.due(step):
            self.write(engine, logical, step)

    def write(self, engine: RedundantPipelineEngine, logical: Sequence[int], step: int) -> None:
        """Each own logical stage's file of committed step ``step`` (in the background)."""
        if self._writer is None:
            self._writer = CheckpointWriter(self.root, self.keep, on_error=self._failed)
        if engine.grid.data_parallel_id != 0:
            return  # data-parallel peers hold identical state: pipeline 0 writes it
        for stage, st in engine_stages(engine, logical).items():
            payload = stage_payload(st, logical_workers=self.logical_workers, seed=self.seed)
            # Written by a background thread; the coordinator commits the step (writes its
            # manifest) once every stage's file is there.
            self._writer.save_async(step, f"stage-{stage}", payload)

    def at_stop(
        self,
        engine: RedundantPipelineEngine,
        logical: Sequence[int],
        generation: int,
        step: int,
        store: AuthStore,
    ) -> None:
        """``stop-checkpoint/<g>``: the job stops at this boundary (a Ctrl-C) and resumes from
        a checkpoint of it. Written here unless the interval wrote it already; waited for, so
        that the coordinator can commit it once the members have reported."""
        key = stop_checkpoint_key(generation)
        if not store.check([key]) or int(store.get(key).decode()) != step:
            return
        if not self.due(step):
            self.write(engine, logical, step)
        if self._writer is not None:
            self._writer.wait()  # errors went to _failed, never raised here
        self.publish_errors(store)

    def _failed(self, step: int, path: Path, error: Exception) -> None:
        """The writer's thread: a file of ``step`` could not be written."""
        with self._errors_lock:
            self._errors.append(CheckpointWriteError(step, str(path), str(error), self.wid))
        self.note(f"checkpoint of step {step} not written: {path}: {error}")

    def publish_errors(self, store: AuthStore) -> None:
        """Tell the coordinator of failed writes: ``checkpoint-error/<n>`` (n from the
        ``checkpoint-errors`` counter, 1, 2, ...). ``store``: the main thread's client."""
        with self._errors_lock:
            errors, self._errors = self._errors, []
        for entry in errors:
            n = store.add(CHECKPOINT_ERRORS_COUNTER, 1)
            store.set(checkpoint_error_key(n), entry.encode())

    def restore(self, step: int) -> Holdings:
        """Fatal loss: every logical stage from this run's checkpoint of ``step``."""
        return restore_holdings(
            self.root, step, logical_workers=self.logical_workers, seed=self.seed
        )

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
