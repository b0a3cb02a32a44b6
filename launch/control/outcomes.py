"""How a generation ended, from its members' reports.

:func:`take_reports` records a generation's reports and stops the job on one that redoing
the work cannot fix (a worker's error, a non-finite loss). :func:`classify` then tells how
the generation ended, a :class:`GenerationEnd`: the job is done, stopped as a Ctrl-C asked,
or a next generation is planned after a failure (the recovery policy's) or a change (an
arrival or a departure at a step boundary). :class:`FailureCount` stops a job whose
training itself fails: two failures in a row with no process lost.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum

from spotline.launch.control.checkpoints import CheckpointCommits
from spotline.launch.control.metrics import RunMetrics
from spotline.launch.control.supervisor import JobError, Supervisor
from spotline.wire.protocol import Outcome, Report


class GenerationEnd(Enum):
    """How a generation ended."""

    FINISHED = "finished"  # every member trained the last step: the job is done
    STOPPED = "stopped"  # every member stopped at the step a Ctrl-C chose
    FAILED = "failed"  # a worker failed (a member lost): the recovery policy plans next
    CHANGED = "changed"  # the members stopped at a boundary (an arrival, a departure)

    @property
    def ends_job(self) -> bool:
        return self in (GenerationEnd.FINISHED, GenerationEnd.STOPPED)


def classify(
    outcomes: Mapping[str, Outcome],
    members: Sequence[str],
    *,
    stop_target: int | None,
    progress: Callable[[], int],
) -> GenerationEnd:
    """How a generation ended, from each reporting worker's outcome (standby workers'
    too), its ``members`` and the stop a Ctrl-C chose (``stop_target``; ``progress``: the
    members' progress, read only where a stop may have been reached)."""
    if members and all(outcomes.get(w) == "done" for w in members):
        return GenerationEnd.FINISHED
    if (
        stop_target is not None
        and members
        and all(outcomes.get(w) == "boundary" for w in members)
        and progress() >= stop_target
    ):
        return GenerationEnd.STOPPED
    if any(o == "failed" for o in outcomes.values()):
        return GenerationEnd.FAILED
    return GenerationEnd.CHANGED


def take_reports(
    reports: Mapping[str, Report],
    supervisor: Supervisor,
    metrics: RunMetrics,
    checkpoints: CheckpointCommits,
) -> None:
    """Record a generation's reports; stop the job on one that redoing cannot fix."""
    for report in reports.values():
        metrics.take_report(report)
    for w, report in reports.items():
        worker = supervisor[w]
        if report.outcome == "leaving" and worker.fate in ("running", "exited"):
            # A notice that came while the generation failed: the worker reported and
            # exited before its heartbeat wrote leaving/<w>, so the watch never saw it
            # leave (found as a departure missing from the events and the count).
            metrics.preemptions += 1
            worker.fate = "left"
            metrics.event("leaving", worker=w)
    failed = sorted(f"worker {w}: {r.error}" for w, r in reports.items() if r.outcome == "error")
    if failed:
        # Not a lost process: a full disk, an export error, a bug. Redoing the work
        # would repeat it; stop with the cause.
        raise JobError(failed[0])
    checkpoints.poll_errors()
    errors = sorted({str(r.error) for r in reports.values() if r.outcome == "non-finite"})
    if errors:
        # Not a failure to recover from: the same step would give the same gradients.
        raise RuntimeError(
            f"{errors[0]}; the step was not applied. Lower the learning rate, enable "
            "gradient_clipping or check the data"
        )


class FailureCount:
    """Failures with no process lost since the last one that lost one: the second stops
    the job (every member failed with no process lost: an error in the training itself, a
    model or optimizer error, which redoing the step would only repeat)."""

    def __init__(self) -> None:
        self.without_loss = 0

    def count(self, reports: Mapping[str, Report], *, lost_process: bool) -> None:
        """A generation failed; ``lost_process``: a process was lost meanwhile (a recovery
        clock is running)."""
        if lost_process:
            self.without_loss = 0
            return
        self.without_loss += 1
        if self.without_loss >= 2:
            error = next((r.error for r in reports.values() if r.error), "unknown")
            raise RuntimeError(f"training failed twice with no process lost: {error}")
