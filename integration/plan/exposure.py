"""Exposure-triggered checkpoints: when a plan leaves a stage few copies, save at once.

In-memory failover (Bamboo's replicas) survives a loss as long as some copy of every stage
survives it. A stage's copies are the members that hold its state
(:func:`spotline.plan.placement.copies`: the physical stage that runs it and, with replicas,
the one before it); the *failure domains* they sit on are what a preemption takes at once
(the machines of a cluster; in the simulator with one slot per machine, and in a local
``spotline train`` whose trace removes single workers, each worker).

A plan is *exposed* when some stage's copies sit on at most :data:`EXPOSED_DOMAINS` (2)
domains. Why two: that is exactly one physical pipeline plus its replicas (each stage on
its worker and its predecessor's), the shape a job shrinks to when it is down to its last
pipeline; a single batch of preemptions then needs to hit only two domains to lose the
stage and roll back to the last checkpoint, and spot preemptions come in bursts (the g4dn
trace drops 27 -> 16 -> 12 -> 8 -> 5 nodes in minutes). With three domains or more a
batch must take three given domains, and the planner re-plans between batches (each a
new generation) so the job gets there only through an exposed plan first. One domain is
exposed too (a machine holding every copy: :mod:`spotline.plan.placement`'s stronger
sense, where one loss suffices).

The policy (the coordinator's and the simulator's ``spotline`` alike):

- the first generation of an exposure (an in-memory generation whose plan is exposed
  while the one before it was not) checkpoints at its first committed step: the moment the
  job becomes exposed is the moment a burst is under way. A (re)start is never a first
  exposure: its state is the checkpoint it read (or the initial weights);
- while exposed, checkpoints come every :func:`exposed_interval_s` (Young/Daly with the
  rate of *bursts* observed so far, never longer than the usual interval) instead of the
  long interval that suits a job far from a fatal loss.

A burst (:func:`is_burst`) is a batch of preemptions that took members on two domains or
more at once: the only kind of event that can take every copy of an exposed stage (its
copies on two domains; a batch of one domain leaves the other). Young/Daly wants the mean
time between the failures a checkpoint guards against: every preemption counted instead
(the first version of this rule) checkpointed too often where single losses dominate, and
lost throughput to it on the p3 trace at 16 to 48 nodes; counted by bursts the rule was as
good or better on every shipped-trace case measured (BENCHMARKS.md, issue 14). Before the
first burst no rate is known: the usual interval, after the first exposure's checkpoint.

Pure code (no torch).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from spotline.plan.checkpoint_interval import young_daly_interval_s
from spotline.plan.grid import Layout
from spotline.plan.placement import copies, copy_sets

EXPOSED_DOMAINS = 2
"""A plan is exposed when some stage's copies sit on at most this many failure domains."""


def exposed_stages(
    layout: Layout,
    domain_of: Callable[[str], str],
    *,
    replicas: bool = True,
    sharded: bool = False,
) -> tuple[int, ...]:
    """The logical stages of ``layout`` whose copies sit on at most :data:`EXPOSED_DOMAINS`
    failure domains (``domain_of``: a member's machine, or the member itself), stage
    order. ``replicas``: members hold their successor's replica (Bamboo's redundancy; off:
    a stage's copies are only the members that run it). ``sharded``: the replica holders
    of a stage hold one shard each, one copy between them
    (:func:`spotline.plan.placement.copy_sets`): the stage is lost with the domains of its
    owners and any one of its shard holders', so it counts the fewest domains whose loss
    takes every copy."""
    if replicas and sharded:
        found = []
        for stage, sets in copy_sets(layout, sharded=True).items():
            single = {domain_of(c[0]) for c in sets if len(c) == 1}
            shared = [c for c in sets if len(c) > 1]
            # One shard set at most: the replica holders of the one physical stage before.
            assert len(shared) <= 1, sets
            extra = any(not any(domain_of(w) in single for w in c) for c in shared)
            if len(single) + extra <= EXPOSED_DOMAINS:
                found.append(stage)
        return tuple(found)
    if replicas:
        held = copies(layout)
    else:
        held = {s: () for s in range(layout.num_stages)}
        for worker in layout.members:
            for stage in layout.stages_of(worker):
                held[stage] += (worker,)
    return tuple(
        stage
        for stage, holders in held.items()
        if len({domain_of(w) for w in holders}) <= EXPOSED_DOMAINS
    )


def is_burst(lost_domains: Collection[str]) -> bool:
    """Whether one batch of preemptions, the domains of the members it took, was a burst:
    two domains or more, enough to take every copy of an exposed stage."""
    return len(set(lost_domains)) >= EXPOSED_DOMAINS


def observed_mtbf_s(elapsed_s: float, bursts: int) -> float | None:
    """Seconds between the bursts seen so far (:func:`is_burst`); None before the first:
    no rate observed yet."""
    if bursts <= 0 or elapsed_s <= 0:
        return None
    return elapsed_s / bursts


def exposed_interval_s(
    base_interval_s: float, checkpoint_cost_s: float, elapsed_s: float, bursts: int
) -> float:
    """Seconds of training between checkpoints while exposed: Young/Daly's
    ``sqrt(2 * cost * MTBF)`` with the MTBF of bursts observed so far
    (:func:`observed_mtbf_s`), never longer than ``base_interval_s`` (the interval far from
    a fatal loss); the base interval before the first burst."""
    mtbf_s = observed_mtbf_s(elapsed_s, bursts)
    if mtbf_s is None:
        return base_interval_s
    return min(base_interval_s, young_daly_interval_s(checkpoint_cost_s, mtbf_s))


def first_exposure(exposed_now: bool, exposed_before: bool, *, restarted: bool) -> bool:
    """Whether this generation checkpoints at its first committed step: exposed now, not
    before, and holding its state in memory (a restart's state is the checkpoint it read,
    or the initial weights)."""
    return exposed_now and not exposed_before and not restarted
