"""Router policies by their CLI name, built from `KEY=VALUE` arguments and a seed.

    policy = make_policy("llm-d", ["prefix-cache=5", "queue=1"], seed=7)

Unknown names and arguments, and bad values, raise ValueError with a one-line message naming
the field and the value (the CLI prints it and exits 2).
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.router.dynamo import DynamoKv
from runtime.router.llmd import Llmd
from runtime.router.policy import RouterPolicy, parse_config
from runtime.router.production_stack import KvAware, PrefixAware
from runtime.router.session import SessionHash
from runtime.router.sglang import SglangCacheAware
from runtime.router.simple import LeastOutstanding, PowerOfTwo, Random, RoundRobin, VllmDP

POLICIES: dict[str, type[RouterPolicy]] = {
    cls.name: cls
    for cls in (
        RoundRobin, Random, LeastOutstanding, VllmDP, Llmd, DynamoKv, SglangCacheAware,
        PrefixAware, KvAware, PowerOfTwo, SessionHash,
    )
}


def policy_names() -> list[str]:
    return list(POLICIES)


def make_policy(name: str, args: Sequence[str] = (), seed: int = 0) -> RouterPolicy:
    """A fresh policy instance (one per router replica: each keeps private state)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown router policy {name!r} (choose from {', '.join(POLICIES)})")
    config = parse_config(name, cls.config_type, args)
    # every registered policy takes (its config, seed); RouterPolicy's own __init__ does not
    return cls(config, seed)  # type: ignore[call-arg]
