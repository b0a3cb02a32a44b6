"""The simulator's entry: every simulated policy by name (:data:`POLICY_MODELS`), and
:func:`simulate` / :func:`simulate_policies`, which replay a trace under them (the rules in
:mod:`spotline.sim.replay`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from spotline.plan.traces import Trace
from spotline.sim.membership import Batches, membership_batches
from spotline.sim.recovery_policies import RECOVERY_POLICIES
from spotline.sim.replay import SimPolicy
from spotline.sim.results import PolicyResult
from spotline.sim.sim_config import POLICIES, PolicyName, SimConfig
from spotline.sim.sim_only_policies import IdealPolicy, OnDemandPolicy, RigidSpotlinePolicy

POLICY_MODELS: Mapping[PolicyName, SimPolicy] = MappingProxyType(
    {
        policy.name: policy
        for policy in (
            # The runtime's own policy objects: the simulator replays what the coordinator runs.
            RECOVERY_POLICIES["failover"],
            RigidSpotlinePolicy(),
            RECOVERY_POLICIES["checkpoint-restart"],
            OnDemandPolicy(),
            IdealPolicy(),
        )
    }
)
"""The simulated policies by name, in :data:`~spotline.sim.sim_config.POLICIES` order."""


def simulate(
    trace: Trace,
    policy: PolicyName,
    config: SimConfig,
    *,
    batches: Batches | None = None,
) -> PolicyResult:
    """Replay ``trace`` under ``policy`` (rules in :mod:`spotline.sim.replay`).

    ``batches`` may pass :func:`membership_batches` of the trace, computed once for several
    policies. ``on-demand`` ignores the trace's nodes and uses only its duration.
    """
    model = POLICY_MODELS.get(policy)
    if model is None:
        raise ValueError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")
    return model.simulate(trace, config, batches)


def simulate_policies(
    trace: Trace, policies: Sequence[PolicyName], config: SimConfig
) -> dict[PolicyName, PolicyResult]:
    """Run several policies on the same trace (the membership timeline computed once)."""
    batches = membership_batches(trace, config.calibration.node_ready_s)
    return {policy: simulate(trace, policy, config, batches=batches) for policy in policies}
