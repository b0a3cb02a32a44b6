"""Placement of logical data-parallel workers (EasyScale ESTs) on live processes.

The number of logical workers is part of the logical topology and never changes in a run;
this module only decides which live process runs which of them. A process runs its logical
workers one after another, so a faster process gets proportionally more. The math does not
depend on this choice (the sampler and the exact reduction are per logical worker); it only
decides throughput and how much state moves on a rescale. Pairs with
``spotline.plan.sampler.GlobalSampler`` (what each logical worker reads).

An assignment maps every process id to the sorted tuple of logical-worker ids it runs; a
process with no logical worker (more processes than logical workers) maps to ``()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction

Assignment = dict[str, tuple[int, ...]]


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
