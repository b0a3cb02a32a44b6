"""Placement of logical data-parallel workers (EasyScale ESTs) on live processes.

The number of logical workers is part of the logical topology and never changes in a run;
this module only decides which live process runs which of them. A process runs its logical
workers one after another, so a faster process gets proportionally more. The math does not
depend on this choice (the sampler and the exact reduction are per logical worker); it only
decides throughput and how much state moves on a rescale. Pairs with
``spotline.plan.sampler.GlobalSampler`` (what each logical worker reads).

An assignment maps every process id to the sorted tuple of logical-worker ids it runs; a
process with no logical worker (more processes than logical workers) maps to ``()``.

``step_work`` joins the two: what each process reads in one step. ``plan_run`` walks a
whole run through a sequence of rescales and rollbacks (``Rescale``, ``Rollback``) and says
which assignment ran each step attempt and which attempt counts; ``samples_by_epoch`` turns
that into the samples the final model was trained on. ``rebalanced`` is the move an elastic
worker's generation makes from each rank's measured seconds (``rebalance`` gated by
``worth_moving``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType

from spotline.plan.grid import pipeline_name
from spotline.plan.sampler import GlobalSampler

Assignment = dict[str, tuple[int, ...]]

# One micro-batch of work: (logical worker, micro-batch, sample indices).
WorkItem = tuple[int, int, tuple[int, ...]]


def _check_speeds(process_speeds: Mapping[str, float]) -> None:
    if not process_speeds:
        raise ValueError("at least one process is needed to run the logical workers")
    for process_id, speed in process_speeds.items():
        if not isinstance(process_id, str):
            raise ValueError(f"process ids must be strings, got {process_id!r}")
        if isinstance(speed, bool) or not isinstance(speed, (int, float)):
            raise ValueError(f"speed of process {process_id!r} must be a number, got {speed!r}")
        if not (math.isfinite(speed) and speed > 0):
            raise ValueError(
                f"speed of process {process_id!r} must be finite and > 0, got {speed!r}"
            )


def _target_counts(num_logical_workers: int, process_speeds: Mapping[str, float]) -> dict[str, int]:
    """How many logical workers each process should run: largest remainder, at least one each."""
    if isinstance(num_logical_workers, bool) or not isinstance(num_logical_workers, int):
        raise ValueError(f"num_logical_workers must be an integer, got {num_logical_workers!r}")
    if num_logical_workers < 1:
        raise ValueError(f"num_logical_workers must be >= 1, got {num_logical_workers}")
    _check_speeds(process_speeds)
    process_ids = sorted(process_speeds)
    # Fractions make the quotas exact, so ties between equal remainders really are ties and
    # are broken by process id, not by float rounding.
    speeds = {p: Fraction(process_speeds[p]) for p in process_ids}
    total_speed = sum(speeds.values(), Fraction(0))
    quotas = {p: num_logical_workers * speeds[p] / total_speed for p in process_ids}
    counts = {p: math.floor(quotas[p]) for p in process_ids}
    left = num_logical_workers - sum(counts.values())
    by_remainder = sorted(process_ids, key=lambda p: (-(quotas[p] - counts[p]), p))
    for p in by_remainder[:left]:
        counts[p] += 1
    if num_logical_workers >= len(process_ids):
        # A live process that runs nothing is wasted capacity: give each idle process one
        # logical worker from the process furthest above its quota.
        for p in process_ids:
            if counts[p] == 0:
                donor = min(
                    (q for q in process_ids if counts[q] >= 2),
                    key=lambda q: (-(counts[q] - quotas[q]), q),
                )
                counts[donor] -= 1
                counts[p] = 1
    assert sum(counts.values()) == num_logical_workers
    return counts


def assign_logical_workers(
    num_logical_workers: int, process_speeds: Mapping[str, float]
) -> Assignment:
    """A fresh assignment: counts proportional to speed, contiguous ids in process-id order.

    Counts use largest-remainder rounding of ``num_logical_workers * speed / total speed``
    (ties to the smaller process id); when there are at least as many logical workers as
    processes every process gets at least one. Use ``rebalance`` instead when an assignment
    already exists, so that as few logical workers as possible move.
    """
    counts = _target_counts(num_logical_workers, process_speeds)
    assignment: Assignment = {}
    next_id = 0
    for p in sorted(counts):
        assignment[p] = tuple(range(next_id, next_id + counts[p]))
        next_id += counts[p]
    return assignment


def _owners(assignment: Mapping[str, tuple[int, ...]]) -> dict[int, str]:
    owners: dict[int, str] = {}
    for process_id, logical_workers in assignment.items():
        for w in logical_workers:
            if isinstance(w, bool) or not isinstance(w, int) or w < 0:
                raise ValueError(f"logical worker ids must be integers >= 0, got {w!r}")
            if w in owners:
                raise ValueError(
                    f"logical worker {w} is assigned to both {owners[w]!r} and {process_id!r}"
                )
            owners[w] = process_id
    return owners


def rebalance(
    current: Mapping[str, tuple[int, ...]], process_speeds: Mapping[str, float]
) -> Assignment:
    """Move to the counts ``assign_logical_workers`` would pick, moving as few workers as possible.

    ``current`` must hold every logical worker ``0..N-1`` exactly once; its processes that are
    missing from ``process_speeds`` are gone, and their logical workers are reassigned. A
    surviving process keeps its lowest-numbered logical workers up to its new count; the freed
    ones, in id order, fill the processes below their count in process-id order. Each process
    keeps ``min(old count, new count)`` workers, which is the fewest moves any assignment
    with these counts allows. Same speeds and same counts: nothing moves.
    """
    owners = _owners(current)
    num_logical_workers = len(owners)
    if sorted(owners) != list(range(num_logical_workers)):
        raise ValueError(
            "current assignment must hold logical workers 0..N-1 exactly once, "
            f"got {sorted(owners)}"
        )
    counts = _target_counts(num_logical_workers, process_speeds)
    kept: dict[str, list[int]] = {}
    freed: list[int] = []
    for p in sorted(counts):
        old = sorted(current.get(p, ()))
        kept[p] = old[: counts[p]]
        freed.extend(old[counts[p] :])
    for p, old_workers in current.items():
        if p not in counts:
            freed.extend(old_workers)
    freed.sort()
    for p in sorted(counts):
        missing = counts[p] - len(kept[p])
        kept[p].extend(freed[:missing])
        del freed[:missing]
    assert not freed
    return {p: tuple(sorted(kept[p])) for p in sorted(counts)}


def moves(
    old: Mapping[str, tuple[int, ...]], new: Mapping[str, tuple[int, ...]]
) -> list[tuple[int, str | None, str]]:
    """The logical workers whose process changes: ``(logical worker, from, to)`` in id order.

    ``from`` is None for a logical worker that ``old`` did not place. A logical worker that
    ``old`` placed but ``new`` does not is an error: every logical worker must keep running.
    """
    old_owners = _owners(old)
    new_owners = _owners(new)
    dropped = sorted(set(old_owners) - set(new_owners))
    if dropped:
        raise ValueError(f"logical workers {dropped} are placed before but not after the change")
    return [
        (w, old_owners.get(w), new_owners[w])
        for w in sorted(new_owners)
        if old_owners.get(w) != new_owners[w]
    ]


# --- what each process reads, over a whole run ---------------------------------------------


def _check_complete(assignment: Mapping[str, tuple[int, ...]], num_logical_workers: int) -> None:
    owners = _owners(assignment)
    if sorted(owners) != list(range(num_logical_workers)):
        raise ValueError(
            f"assignment must hold logical workers 0..{num_logical_workers - 1} exactly once, "
            f"got {sorted(owners)}"
        )


def step_work(
    sampler: GlobalSampler, step: int, assignment: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[WorkItem, ...]]:
    """What every process of ``assignment`` reads in step ``step``, in the order it runs it.

    A process runs its logical workers in id order and each one's micro-batches in order;
    each item is ``(logical worker, micro-batch, sample indices)`` with the indices from
    ``sampler.indices``. A process with no logical worker maps to ``()``. ``assignment``
    must hold the sampler's logical workers ``0..N-1`` exactly once (ValueError otherwise), so
    the items of all processes together are the whole step, each micro-batch once.
    """
    _check_complete(assignment, sampler.num_logical_workers)
    return {
        process_id: tuple(
            (w, mb, sampler.indices(step, w, mb))
            for w in sorted(assignment[process_id])
            for mb in range(sampler.num_micro_batches)
        )
        for process_id in sorted(assignment)
    }


def _check_step_number(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True)
class Rescale:
    """From step ``step`` on (before it runs), exactly these processes exist, at these speeds.

    Processes of the previous assignment that are missing here are gone; new ones join.
    ``plan_run`` applies it with ``rebalance``. The speeds are copied into a read-only mapping.
    """

    step: int
    process_speeds: Mapping[str, float]

    def __post_init__(self) -> None:
        _check_step_number("Rescale step", self.step)
        _check_speeds(self.process_speeds)
        object.__setattr__(self, "process_speeds", MappingProxyType(dict(self.process_speeds)))

    def __repr__(self) -> str:
        return f"Rescale(step={self.step}, process_speeds={dict(self.process_speeds)!r})"


@dataclass(frozen=True)
class Rollback:
    """A failure during step ``step``, before its commit: training resumes at ``to_step``.

    ``to_step <= step`` (equal: retry the step; less: fall back to an older checkpoint).
    The failed attempt at ``step`` never counts, and steps ``to_step..step-1`` run again;
    only the last execution of a step counts, and a step never partially counts. The set of
    processes does not change; a failure that loses a process is a Rollback followed by a
    ``Rescale`` at ``to_step``.
    """

    step: int
    to_step: int

    def __post_init__(self) -> None:
        _check_step_number("Rollback step", self.step)
        _check_step_number("Rollback to_step", self.to_step)
        if self.to_step > self.step:
            raise ValueError(
                f"Rollback(step={self.step}, to_step={self.to_step}): "
                "cannot resume after the step that failed (to_step must be <= step)"
            )


Event = Rescale | Rollback


@dataclass(frozen=True)
class StepAttempt:
    """One execution of step ``step`` by ``assignment`` (read-only).

    ``committed`` is True for the last execution of each step: its update is the one the
    trained model holds. Executions that failed or were undone by a later rollback are False.
    """

    step: int
    assignment: Mapping[str, tuple[int, ...]]
    committed: bool


@dataclass(frozen=True)
class RunPlan:
    """Every step attempt of a run, in the order they ran; made by ``plan_run``.

    Each step ``0..num_steps-1`` has exactly one committed attempt.
    """

    num_steps: int
    num_logical_workers: int
    attempts: tuple[StepAttempt, ...]

    def committed(self) -> tuple[StepAttempt, ...]:
        """The committed attempt of each step, in step order."""
        return tuple(sorted((a for a in self.attempts if a.committed), key=lambda a: a.step))


def plan_run(
    sampler: GlobalSampler,
    num_steps: int,
    events: Sequence[Event],
    initial_speeds: Mapping[str, float],
) -> RunPlan:
    """Walk steps ``0..num_steps-1`` through ``events``; which assignment ran each attempt.

    The run starts with ``assign_logical_workers(sampler.num_logical_workers,
    initial_speeds)``. ``events`` is the timeline, in the order things happen: each event's
    step must be in ``[0, num_steps)`` and not before the step the run has reached (after a
    ``Rollback`` that is its ``to_step``, so a later event may revisit earlier steps). A
    ``Rescale`` applies ``rebalance`` before its step runs; a ``Rollback`` records the failed
    attempt of its step (uncommitted) and resumes at ``to_step``. After the last event the
    run goes on to ``num_steps``. Bad events raise ValueError naming the event. Pairs with
    ``samples_by_epoch`` (what the committed attempts trained on) and ``step_work``.
    """
    _check_step_number("num_steps", num_steps)
    num_logical_workers = sampler.num_logical_workers
    assignment: Mapping[str, tuple[int, ...]] = MappingProxyType(
        assign_logical_workers(num_logical_workers, initial_speeds)
    )
    runs: list[tuple[int, Mapping[str, tuple[int, ...]], bool]] = []  # (step, who, failed)
    position = 0  # the next step to run
    for index, event in enumerate(events):
        if not isinstance(event, (Rescale, Rollback)):
            raise ValueError(f"event {index} must be a Rescale or a Rollback, got {event!r}")
        if event.step >= num_steps:
            raise ValueError(
                f"event {index} {event!r} is at or after the end of the run "
                f"(steps 0..{num_steps - 1})"
            )
        if event.step < position:
            raise ValueError(
                f"event {index} {event!r} is out of order: the run has already reached "
                f"step {position} (events are listed in the order they happen)"
            )
        runs.extend((s, assignment, False) for s in range(position, event.step))
        if isinstance(event, Rescale):
            assignment = MappingProxyType(rebalance(assignment, event.process_speeds))
            position = event.step
        else:
            runs.append((event.step, assignment, True))
            position = event.to_step
    runs.extend((s, assignment, False) for s in range(position, num_steps))
    last_run = {step: i for i, (step, _, _) in enumerate(runs)}
    assert sorted(last_run) == list(range(num_steps))
    assert not any(runs[i][2] for i in last_run.values()), "a failed attempt cannot commit"
    committed = set(last_run.values())
    return RunPlan(
        num_steps=num_steps,
        num_logical_workers=num_logical_workers,
        attempts=tuple(
            StepAttempt(step, who, i in committed) for i, (step, who, _) in enumerate(runs)
        ),
    )


def samples_by_epoch(sampler: GlobalSampler, run_plan: RunPlan) -> dict[int, list[int]]:
    """The sample indices the committed attempts of ``run_plan`` trained on, per epoch.

    Within an epoch the samples are in step order, then logical-worker and micro-batch order
    (the order of ``sampler.epoch_permutation``, whatever processes ran them). Failed and
    undone attempts are left out. ``sampler`` must be the one the plan was made with.
    """
    if sampler.num_logical_workers != run_plan.num_logical_workers:
        raise ValueError(
            f"the plan is for {run_plan.num_logical_workers} logical workers, the sampler "
            f"has {sampler.num_logical_workers}"
        )
    out: dict[int, list[int]] = {}
    for attempt in run_plan.committed():
        work = step_work(sampler, attempt.step, attempt.assignment)
        items = sorted(item for process_items in work.values() for item in process_items)
        samples = out.setdefault(sampler.epoch_of(attempt.step), [])
        for _, _, indices in items:
            samples.extend(indices)
    return out


def makespan(
    assignment: Mapping[str, tuple[int, ...]], process_speeds: Mapping[str, float]
) -> float:
    """The step time an assignment predicts, in units of one logical worker's time on a
    speed-1 process: the slowest process's ``count / speed`` (they run in parallel)."""
    _check_speeds(process_speeds)
    return max(len(assignment.get(p, ())) / s for p, s in process_speeds.items())


def worth_moving(
    current: Mapping[str, tuple[int, ...]],
    proposed: Mapping[str, tuple[int, ...]],
    process_speeds: Mapping[str, float],
    *,
    min_gain: float = 0.1,
) -> bool:
    """Whether ``proposed`` predicts a step at least ``min_gain`` (a fraction) shorter than
    ``current``: measured speeds are noisy, and without a margin two nearly equal processes
    would trade a logical worker back and forth at every measurement."""
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
    if dict(current) == dict(proposed):
        return False
    return makespan(proposed, process_speeds) < (1 - min_gain) * makespan(current, process_speeds)


def rebalanced(
    current: Mapping[str, tuple[int, ...]],
    seconds_by_rank: Sequence[float],
    num_pipelines: int,
    *,
    min_gain: float = 0.1,
) -> Assignment | None:
    """Where a measurement within a generation moves the logical workers: the new
    assignment of the physical pipelines (by ``spotline.plan.grid.pipeline_name``), or None
    to keep ``current``.

    ``seconds_by_rank``: each rank's seconds per logical worker since the last measurement,
    by rank (DeepSpeed's pipe-major order: rank = stage * pipelines + pipeline). A pipeline
    is as fast as its slowest rank. Nothing moves with one pipeline, while a pipeline has no
    measurement (0 seconds), or unless the move predicts a step ``min_gain`` shorter
    (:func:`worth_moving`). Every rank computes the same answer from the same numbers."""
    assert len(seconds_by_rank) % num_pipelines == 0, (len(seconds_by_rank), num_pipelines)
    slowest = [0.0] * num_pipelines
    for rank, seconds in enumerate(seconds_by_rank):
        pipeline = rank % num_pipelines
        slowest[pipeline] = max(slowest[pipeline], float(seconds))
    if num_pipelines == 1 or min(slowest) <= 0:
        return None
    speeds = {pipeline_name(p): 1.0 / slowest[p] for p in range(num_pipelines)}
    proposed = rebalance(current, speeds)
    return proposed if worth_moving(current, proposed, speeds, min_gain=min_gain) else None
