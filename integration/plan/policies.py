"""The names of the recovery policies: one vocabulary for the runtime and the simulator.

A recovery policy decides what the job does when a worker that trains is lost:

``failover``
    Bamboo's in-memory takeover: the survivors keep their state, the planner
    (:func:`spotline.plan.layout.plan_generation`) places the lost stages on the workers that
    hold their replicas, and only a fatal loss (a stage no survivor holds) reads the last
    checkpoint. The runtime's default (``spotline.recovery.mode``).
``checkpoint-restart``
    The baseline: every worker is replaced and the job restarts from the last checkpoint.

The runtime runs a policy by this name and the simulator replays the same object
(:mod:`spotline.sim.recovery_policies`); the simulator's ``POLICY_MODELS``
(:mod:`spotline.sim.simulator`, one ``SimPolicy`` per name, each
saying by ``recovery`` which of these it runs) names its policies after the system that
runs them: ``spotline``
(failover with elastic logical workers, what the runtime does), ``spotline-rigid`` (failover
with data parallelism fixed to the configured pipelines), ``checkpoint-restart``, and two
references that are no recovery policy: the ``on-demand`` baseline (never preempted) and
the ``ideal`` bound (an oracle that trains on every available worker at no cost of change,
:data:`SIMULATOR_ONLY`: the runtime has no such policy and its configuration refuses it).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal, get_args

Failover = Literal["failover"]
CheckpointRestart = Literal["checkpoint-restart"]
RecoveryMode = Literal[Failover, CheckpointRestart]
RECOVERY_MODES: tuple[RecoveryMode, ...] = get_args(RecoveryMode)

Ideal = Literal["ideal"]
SimPolicyName = Literal["spotline", "spotline-rigid", CheckpointRestart, "on-demand", Ideal]
"""The simulator's policies (see the module docstring)."""
SIM_POLICIES: tuple[SimPolicyName, ...] = (
    "spotline",
    "spotline-rigid",
    "checkpoint-restart",
    "on-demand",
    "ideal",
)
SIMULATOR_ONLY: tuple[SimPolicyName, ...] = ("on-demand", "ideal")
"""The simulated policies that run no runtime recovery policy (none in
:data:`SIMULATED_RECOVERY`): references a results table compares the others with."""

SIMULATED_RECOVERY: Mapping[SimPolicyName, RecoveryMode] = MappingProxyType(
    {
        "spotline": "failover",
        "spotline-rigid": "failover",
        "checkpoint-restart": "checkpoint-restart",
    }
)
"""The recovery policy each simulated policy runs (the :data:`SIMULATOR_ONLY` references run
none: ``on-demand`` is never preempted, ``ideal`` loses nothing by definition)."""
