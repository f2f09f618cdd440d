"""The router side of a fleet run: K router replicas, each with private state, and the KV
events the replicas' block pools publish to them.

- `RouterReplica`: one router process, as llm-d's EPP, Dynamo's router or production-stack's
  run several behind a load balancer: its own policy instance (in-flight counts, prefix
  indexes, seeded draws), its own metrics scrapes (ticks at phase + k * refresh; router r of
  K scrapes at phase r * refresh / K, tickers started apart) and its own KV-event
  subscription. Requests are spread over the routers round-robin by arrival (request i
  goes to router i mod K, a plain L4 load balancer in front of them; sessions are not
  sticky to a router).
- `KvEventBus`: each replica's pool events (`runtime.kv_events`), stamped with the end of
  the step (or decode run, `sim.fleet_kv`) that produced them (vLLM publishes a step's
  batch after `update_from_output`),
  go to every subscribed router's queue, where they become visible `kv_event_delay_s`
  later. Only routers whose policy scores with a precise index subscribe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from runtime.block_hash import BlockHash
from runtime.config import CacheConfig
from runtime.kv_events import PoolEvent, prompt_block_hashes
from runtime.router import (
    KvEvent,
    KvEventQueue,
    MetricsRefresh,
    PrefixKeys,
    RouterPolicy,
    RoutingRequest,
)
from sim.cost.api_server import ApiServerCost
from sim.simulator import SimConfig
from workloads import TraceRequest


class RouterReplica:
    """One router replica: its policy, scrape schedule and KV-event queue (if it wants one)."""

    def __init__(self, index: int, policy: RouterPolicy, refresh_s: float, phase_s: float,
                 kv_event_delay_s: float) -> None:
        self.index = index
        self.policy = policy
        self.refresh = MetricsRefresh(refresh_s, phase_s)
        self.kv_events = KvEventQueue(kv_event_delay_s) if policy.wants_kv_events else None

    def deliver_kv_events(self, now_s: float) -> None:
        """Hand the policy the KV events visible at `now_s`."""
        if self.kv_events is not None:
            events = self.kv_events.drain(now_s)
            if events:
                self.policy.on_kv_events(events)


def make_routers(policies: RouterPolicy | Sequence[RouterPolicy], refresh_s: float,
                 kv_event_delay_s: float) -> list[RouterReplica]:
    """One `RouterReplica` per policy (distinct instances: state is private); router r of K
    scrapes at phase r * refresh_s / K."""
    if isinstance(policies, RouterPolicy):
        policies = [policies]
    if not policies:
        raise ValueError("a fleet needs at least one router, got 0")
    if len({id(p) for p in policies}) != len(policies):
        raise ValueError("each router replica needs its own policy instance")
    if not (kv_event_delay_s >= 0.0 and math.isfinite(kv_event_delay_s)):
        raise ValueError(f"kv_event_delay_s must be a finite number >= 0, got {kv_event_delay_s}")
    count = len(policies)
    return [RouterReplica(r, policy, refresh_s, r * refresh_s / count, kv_event_delay_s)
            for r, policy in enumerate(policies)]


class KvEventBus:
    """Replicas' pool events to the subscribed routers' queues."""

    def __init__(self, queues: Sequence[KvEventQueue]) -> None:
        self.queues = list(queues)

    def __bool__(self) -> bool:
        return bool(self.queues)

    def publish(self, replica: int, events: Sequence[PoolEvent], at_s: float) -> None:
        """`replica`'s pool events, emitted at `at_s` (seconds), in order."""
        for event in events:
            stamped = KvEvent(replica, event.kind, event.block_hashes, at_s)
            for queue in self.queues:
                queue.publish(stamped)


def routing_request(req: TraceRequest, prompt: Sequence[int], block_size: int | None,
                    known: Sequence[BlockHash] = (),
                    prefix_keys: PrefixKeys | None = None) -> RoutingRequest:
    """What a router is given about `req` (its prompt's engine block hashes when
    `block_size` is given: the key of a KV-event index; `known`: the leading blocks' given
    identities, `sim.block_ids`; `prefix_keys`: its router block keys, `sim.router_keys`)."""
    hashes = () if block_size is None else prompt_block_hashes(prompt, block_size,
                                                                req.cache_salt, known)
    return RoutingRequest(request_id=req.request_id, now_s=req.arrival_s,
                          prompt_len=req.prompt_len, token_ids=prompt, block_hashes=hashes,
                          session_id=req.session_id, prefix_keys=prefix_keys)


def earliest_handovers(trace: Sequence[TraceRequest], latency_s: float,
                       api: ApiServerCost) -> list[float]:
    """bounds[i]: the earliest time request i or a later one could be handed over to a core
    whose API server costs `api` (seconds; inf past the last)."""
    bounds = [math.inf] * (len(trace) + 1)
    for i in range(len(trace) - 1, -1, -1):
        req = trace[i]
        bounds[i] = min(bounds[i + 1], req.arrival_s + latency_s + api.time(req.prompt_len))
    return bounds


def common_block_size(caches: Sequence[CacheConfig]) -> int:
    """The replicas' common KV block size (a KV-event index keys blocks by it); ValueError
    (one line) when they differ."""
    sizes = sorted({cache.block_size for cache in caches})
    if len(sizes) > 1:
        raise ValueError(f"a router fed by KV events needs one block size across the "
                         f"replicas, got block_size {sizes}")
    return sizes[0]


def max_prompt_len(config: SimConfig) -> int:
    """The longest prompt the replica's scheduler takes in (`Scheduler.add_request` ignores
    one that leaves no room under max_model_len or outgrows the whole KV pool)."""
    cache = config.cache
    return min(config.scheduler.max_model_len - 1, cache.num_usable_blocks * cache.block_size)


def can_ever_fit(config: SimConfig, prompt_len: int) -> bool:
    """Whether a replica of `config` can ever take in a prompt of `prompt_len` tokens."""
    return 0 < prompt_len <= max_prompt_len(config)
