"""The router's settings (`RouterConfig`) and how `rt route`'s flags become them
(`router_config`: the policy built once to check its name and arguments, every backend
checked before anything is served). Times are seconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.route.backends import check_backends
from runtime.router import make_policy


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The router's settings.

    Attributes:
        backends: base URLs (normalized: no trailing / or /v1); backend i is replica i.
        policy, policy_args, seed: the policy (`runtime.router.make_policy`).
        refresh_s: seconds between /metrics scrapes of each backend (0: scrape all before
            each decision).
        max_failures: consecutive failures that take a backend out.
        health_check_s: how often a backend taken out is probed on /health.
        backend_timeout_s: the longest a backend may stay silent within one request.
        api_key: the Bearer token /v1/* requires (None: none), also sent on the router's own
            calls to the backends' /v1/models.
        max_request_bytes: longer request bodies get 413.
    """

    backends: tuple[str, ...]
    policy: str = "round-robin"
    policy_args: tuple[str, ...] = ()
    seed: int = 0
    refresh_s: float = 0.05
    max_failures: int = 3
    health_check_s: float = 0.5
    backend_timeout_s: float = 300.0
    api_key: str | None = dataclasses.field(default=None, repr=False)
    max_request_bytes: int = 1 << 20


def bearer(api_key: str | None) -> dict[str, str]:
    """The header that carries `api_key` (none without one)."""
    return {} if api_key is None else {"authorization": f"Bearer {api_key}"}


def router_config(urls: Sequence[str], policy: Any, route: Any, guard: Any, seed: int
                  ) -> RouterConfig:
    """The router's settings from its flags (`FleetFlags` as `policy`: router, router_arg,
    router_refresh_ms; `RouteFlags` as `route`; `ServeFlags` as `guard`: api_key,
    max_request_bytes); ValueError (one line) on an unknown policy, a bad argument, or a
    backend that is unreachable, not OpenAI-compatible (or refuses the key) or lacks a
    metric the policy reads."""
    args = list(policy.router_arg or [])
    bases = check_backends(list(urls), make_policy(policy.router, args, seed),
                           bearer(guard.api_key))
    return RouterConfig(tuple(bases), policy.router, tuple(args), seed,
                        policy.router_refresh_ms / 1000.0, route.max_failures,
                        route.health_check_ms / 1000.0, route.backend_timeout,
                        guard.api_key, guard.max_request_bytes)
