"""Checkpoint commits: the coordinator's half of the job's checkpoints.

Workers write each stage's file of a checkpoint (pipeline 0, in a background thread); the
coordinator commits a step (writes its manifest, with the losses and learning rates of the
steps before it and the evaluations up to it, so that a resumed run's summary has every
step and a resumed run knows its best evaluation) once every stage's file is
there. Only the manifest half of the checkpoints is read here
(:mod:`spotline.checkpointing.manifest`, no torch): the workers wrote every file and its
sidecar already. A worker that cannot write a file says so in the store
(:class:`~spotline.wire.protocol.CheckpointWriteError` under ``checkpoint-error/<n>``); such a
step is never committed, and ``checkpoints.on_write_error`` decides whether the job stops
(:class:`~spotline.launch.control.supervisor.JobError`) or trains on without it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from spotline.checkpointing.manifest import MANIFEST, commit_manifest, latest_complete, step_dir
from spotline.config import RunConfig
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.supervisor import JobError
from spotline.wire.protocol import CheckpointWriteError, Store, checkpoint_error_key

# The manifest's metadata key of the evaluations up to its step (a resume reports them).
EVALUATIONS = "evaluations"
# ... and of the run's record as the step committed (RunMetrics.record).
RECORD = "record"


class CheckpointCommits:
    """Which checkpoints are due, written, committed or failed."""

    def __init__(
        self,
        cfg: RunConfig,
        store: Store,
        metrics: RunMetrics,
        output: Path,
        *,
        interval_steps: int,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.metrics = metrics
        self.root = cfg.checkpoint_root(output)
        self.interval_steps = interval_steps
        self.committed: set[int] = set()
        self.failed: set[int] = set()  # steps with a file that failed: never committed
        self.extra: set[int] = set()  # checkpoints written off the interval (a stop)
        # Each published plan's schedule, (resume step, checkpoint_from, interval, exposed),
        # in order: an exposed plan checkpoints off the interval (spotline.plan.exposure).
        self.windows: list[tuple[int, int, int, bool]] = []
        self.exposure_due: set[int] = set()  # the steps exposed plans checkpoint
        self.errors_seen = 0  # checkpoint-error/<n> keys read

    def poll_errors(self) -> None:
        """Report each checkpoint file a worker could not write, at once, on one line."""
        while self.store.check([checkpoint_error_key(self.errors_seen + 1)]):
            self.errors_seen += 1
            key = checkpoint_error_key(self.errors_seen)
            self.write_failed(CheckpointWriteError.decode(self.store.get(key)))

    def write_failed(self, entry: CheckpointWriteError) -> None:
        """Every failed file goes into the summary; the terminal hears once per step."""
        self.metrics.checkpoint_write_errors.append(entry)
        step = entry.step
        if step in self.failed:
            return
        self.failed.add(step)
        line = f"checkpoint of step {step} not written: {entry.path}: {entry.error}"
        if self.cfg.spotline.checkpoints.on_write_error == "stop":
            raise JobError(line)
        print(
            f"spotline: warning: {line}; training goes on without it "
            '(checkpoints.on_write_error "continue")',
            file=sys.stderr,
            flush=True,
        )

    def schedule(self, resume: int, start: int, interval: int, *, exposed: bool) -> None:
        """A plan resuming at ``resume`` was published with this schedule (``PlanMessage``'s
        ``checkpoint_from`` and ``checkpoint_interval``); ``exposed``: off the interval."""
        self.windows.append((resume, start, interval, exposed))

    def exposed_steps(self, last: int) -> set[int]:
        """The steps up to ``last`` that exposed plans checkpoint: ``start + k * interval``
        past each one's resume step, up to where the next plan resumes (its generation
        committed nothing later: a failover resumes at the last committed step, a fallback
        earlier, where the steps are redone under the next plan's schedule)."""
        steps: set[int] = set()
        for k, (resume, start, interval, exposed) in enumerate(self.windows):
            if not exposed or interval <= 0:
                continue
            end = last if k + 1 == len(self.windows) else min(last, self.windows[k + 1][0])
            first = (
                start if start > resume else start + -(-(resume + 1 - start) // interval) * interval
            )
            steps.update(range(first, end + 1, interval))
        return steps

    def exposure_checkpoints(self) -> int:
        """Committed checkpoints that exposed plans asked for."""
        return len(self.committed & self.exposure_due)

    def commit(self, last: int) -> None:
        """Commit every due checkpoint whose files are all there: the interval's up to step
        ``last``, the exposed plans' and any written off it."""
        interval = self.interval_steps
        due = set(self.extra)
        if interval > 0:
            due.update(range(interval, last + 1, interval))
        self.exposure_due |= self.exposed_steps(last)
        due |= self.exposure_due
        due -= self.committed | self.failed
        if not due:
            return
        keep = self.cfg.spotline.checkpoints.keep
        labels = [f"stage-{s}" for s in range(self.cfg.num_stages)]
        for step in sorted(due):
            directory = step_dir(self.root, step)
            if not all((directory / f"{label}.meta.json").exists() for label in labels):
                continue  # not written yet (commit would say so, after the losses' lookups)
            # Rank 0 stores a step's loss before its own checkpoint file: every loss before
            # ``step`` is in the store once the files are. Kept with the checkpoint, so
            # that a resumed run's summary has every step's loss.
            self.metrics.collect_step_values(step)
            metadata: dict[str, Any] = {
                name: {str(s): values[s] for s in range(step) if s in values}
                for name, (_, values) in self.metrics.step_series().items()
            }
            if self.cfg.spotline.evaluation.enabled:
                # Rank 0 reports the evaluation of a boundary before its checkpoint file too.
                self.metrics.collect_evaluations()
                metadata[EVALUATIONS] = {
                    str(s): r.to_json() for s, r in self.metrics.evaluations.items() if s <= step
                }
            # The run's record so far: a resume after a crash (no record of the stop) goes
            # on from it.
            metadata[RECORD] = self.metrics.record(reached_step=step, how="running")
            try:
                if commit_manifest(self.root, step, labels, keep=keep, metadata=metadata):
                    self.committed.add(step)
            except OSError as exc:
                path = step_dir(self.root, step) / MANIFEST
                self.write_failed(CheckpointWriteError(step, str(path), str(exc), "coordinator"))

    def latest(self) -> int | None:
        """The newest complete checkpoint on disk (None: none)."""
        if not self.root.exists():
            return None
        return latest_complete(self.root)
