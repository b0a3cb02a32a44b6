"""The trace as a job sees it: when its nodes are ready and gone (:func:`membership_batches`),
what they cost (:func:`spot_cost_usd`), and the :class:`Cluster` a policy runs on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spotline.plan.traces import Trace

Batches = Sequence[tuple[float, list[str], list[str]]]
"""A trace as the job sees it (:func:`membership_batches`)."""


def membership_batches(
    trace: Trace, node_ready_s: float, *, warm_pool: int = 0, initial_ready: bool = False
) -> list[tuple[float, list[str], list[str]]]:
    """The trace as the job sees it: ``(t_s, removed, ready)`` batches in time order.

    A node added at t becomes ready at ``t + node_ready_s`` unless it is removed first (then
    its removal is invisible to the job, except in the bill); within one instant removals
    come before arrivals. Only batches before the end of the trace are kept.

    ``warm_pool`` processes started ahead (AWS calls them warm pools; the local launcher's
    ``recovery.warm_workers``) make an arrival ready as soon as one of them has started; each
    one taken is replaced by a new one that needs ``node_ready_s``. With ``initial_ready``
    the nodes of the trace's first instant are ready at once (a local replay's clock starts
    when its first workers have started).
    """
    # When each warm process will have started (all of them at the start).
    pool = [0.0] * warm_pool
    first_t = trace.events[0].t_s if trace.events else 0.0
    removed_at: dict[tuple[str, int], float] = {}
    occurrence: dict[str, int] = {}
    adds: list[tuple[float, str, int]] = []
    for event in trace.events:
        if event.kind == "add":
            occurrence[event.node] = occurrence.get(event.node, -1) + 1
            adds.append((event.t_s, event.node, occurrence[event.node]))
        else:
            removed_at[(event.node, occurrence[event.node])] = event.t_s
    # (time, 0 = remove / 1 = ready, sequence, node): sorting gives removals first.
    items: list[tuple[float, int, int, str]] = []
    for sequence, (t_s, node, nth) in enumerate(adds):
        if initial_ready and t_s == first_t:
            ready_t = t_s
        elif pool:
            soonest = min(range(len(pool)), key=pool.__getitem__)
            ready_t = max(t_s, pool[soonest])
            pool[soonest] = t_s + node_ready_s  # its replacement starts now
        else:
            ready_t = t_s + node_ready_s
        removed_t = removed_at.get((node, nth), math.inf)
        if ready_t < removed_t and ready_t < trace.duration_s:
            items.append((ready_t, 1, sequence, node))
            if removed_t < trace.duration_s:
                items.append((removed_t, 0, sequence, node))
    items.sort()
    batches: list[tuple[float, list[str], list[str]]] = []
    for t_s, kind, _, node in items:
        if not batches or batches[-1][0] != t_s:
            batches.append((t_s, [], []))
        (batches[-1][2] if kind else batches[-1][1]).append(node)
    return batches


def spot_cost_usd(trace: Trace, price_per_node_hour: float) -> float:
    """What the trace's nodes cost: every node from its add to its removal (or the end)."""
    added: dict[str, float] = {}
    node_seconds = 0.0
    for event in trace.events:
        if event.kind == "add":
            added[event.node] = event.t_s
        else:
            node_seconds += event.t_s - added.pop(event.node)
    node_seconds += sum(trace.duration_s - t_s for t_s in added.values())
    cost_usd: float = node_seconds / 3600.0 * price_per_node_hour
    return cost_usd


@dataclass(frozen=True)
class Cluster:
    """The nodes a policy runs on: the trace it replays, that trace's membership batches,
    and what its nodes cost."""

    trace: Trace
    batches: Batches
    cost_usd: float
