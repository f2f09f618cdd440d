"""Routers in the shared core: policies over per-replica snapshots, clock-free.

Modules: `snapshot` (RoutingRequest, ReplicaSnapshot, RoutingDecision, PromptBlocking,
PrefixKeys), `state` (what a router knows and when: RouterLocal, MetricsRefresh, KvEvent,
KvEventQueue), `policy` (the RouterPolicy interface), `prefix_index` (router-side prefix
indexes), one module per policy family (`simple`, `session`, `llmd`, `dynamo`, `sglang`,
`production_stack`), `registry` (CLI names -> policies), `rng` (the seeded generator).
"""

from runtime.router.policy import RouterPolicy
from runtime.router.registry import POLICIES, make_policy, policy_names
from runtime.router.snapshot import (
    PrefixKeys,
    PromptBlocking,
    ReplicaSnapshot,
    RoutingDecision,
    RoutingRequest,
)
from runtime.router.state import KvEvent, KvEventQueue, MetricsRefresh, RouterLocal

__all__ = [
    "POLICIES",
    "KvEvent",
    "KvEventQueue",
    "MetricsRefresh",
    "PrefixKeys",
    "PromptBlocking",
    "ReplicaSnapshot",
    "RouterLocal",
    "RouterPolicy",
    "RoutingDecision",
    "RoutingRequest",
    "make_policy",
    "policy_names",
]
