"""Load-only policies: round-robin, random, least-outstanding, vllm-dp, power-of-two.

- `round-robin`: the i-th request goes to candidate i mod n (candidates in id order).
  Vidur `vidur/scheduler/global_scheduler/round_robin_global_scheduler.py` (its default);
  production-stack `RoundRobinRouter` (endpoints sorted by URL).
- `random`: uniform over the candidates, from the seeded generator. Vidur
  `random_global_scheduler.py`, SGLang router `random`.
- `least-outstanding`: argmin of this router's in-flight requests, ties to the lowest id.
  Vidur `lor_global_scheduler.py`: `min` over the replicas' pending counts, +1 locally per
  assignment (here the in-flight count, incremented on dispatch, decremented on finish).
- `vllm-dp`: vLLM's DP load balancer, `v1/engine/core_client.py`
  `DPLBAsyncMPClient.get_core_engine_for_request` (stats every 100 ms from the DP
  coordinator, fleet.md §4). Its current form (vLLM PRs #47420 and #49204, July 2026; 0.32):
  argmin of `max(client_count * in_flight, waiting + running)`, plus
  `waiting * 6 * max(0, kv_usage - 0.5)` when anything waits, over the scraped stats with
  the client's speculative `+client_count` waiting per dispatch until the next scrape and
  its own exact in-flight count; the scan for the first minimum starts at `start_index` and
  moves on by one per dispatch. `formula=legacy`, the form before those PRs: argmin of
  `waiting * 4 + running`, the scan always from `start_index`.
- `power-of-two`: two distinct candidates drawn at random, the less loaded wins, the first
  drawn on a tie. SGLang model gateway (lightseekorg/smg `model_gateway/src/policies/
  power_of_two.rs`, 73da68c); load = the router's in-flight count (`load=in-flight`, SMG's
  worker load counter, what it falls back to without load reports) or the scraped KV usage
  (`load=snapshot`: SMG's load monitor polls each worker every 10 s, `--load-monitor-
  interval`, and compares the engines' token usage ratio, averaged over DP ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from runtime.router.policy import (
    RouterPolicy,
    SnapshotBlindPolicy,
    by_id,
    first_min,
    require,
    require_formula,
)
from runtime.router.snapshot import ReplicaSnapshot, RoutingDecision, RoutingRequest


class RoundRobin(SnapshotBlindPolicy):
    name: ClassVar[str] = "round-robin"

    @property
    def reads_token_ids(self) -> bool:
        return False

    def __init__(self, config: object | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self._counter = 0

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        ids = self.candidate_ids(replicas)
        replica = ids[self._counter % len(ids)]
        self._counter += 1
        return RoutingDecision(replica, "next in turn")


class Random(SnapshotBlindPolicy):
    name: ClassVar[str] = "random"

    @property
    def reads_token_ids(self) -> bool:
        return False

    def __init__(self, config: object | None = None, seed: int = 0) -> None:
        super().__init__(seed)

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        return RoutingDecision(self.rng.choice(self.candidate_ids(replicas)), "uniform draw")


class LeastOutstanding(RouterPolicy):
    name: ClassVar[str] = "least-outstanding"

    @property
    def reads_token_ids(self) -> bool:
        return False

    def __init__(self, config: object | None = None, seed: int = 0) -> None:
        super().__init__(seed)

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        ids = self.candidate_ids(replicas)
        count = self.local.count
        load = {r: float(count.get(r, 0)) for r in ids}
        return RoutingDecision(first_min(ids, load), "fewest in flight", load)

    @property
    def snapshot_blind(self) -> bool:
        return True  # its own in-flight counts only


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmDPConfig:
    """vLLM's DP load balancer.

    Attributes:
        start_index: where the first scan for the minimum starts (vLLM's `eng_start_index`,
            `num_engines * client_index // client_count`; 0 for one client).
        client_count: how much a dispatch adds to the chosen engine's waiting count until
            the next stats update, and what the in-flight floor scales by (vLLM's API-server
            client count).
        formula: "current" (vLLM since July 2026: in-flight floor, KV-pressure penalty on
            waiting, rotating scan start) or "legacy" (`waiting * 4 + running`).
    """

    start_index: int = 0
    client_count: int = 1
    formula: str = "current"

    def __post_init__(self) -> None:
        require(self.start_index >= 0, f"start_index must be >= 0, got {self.start_index}")
        require(self.client_count >= 1, f"client_count must be >= 1, got {self.client_count}")
        require_formula(self.formula)


class VllmDP(RouterPolicy):
    name: ClassVar[str] = "vllm-dp"
    config_type: ClassVar[type[VllmDPConfig]] = VllmDPConfig

    @property
    def reads_token_ids(self) -> bool:
        return False

    def __init__(self, config: VllmDPConfig | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or VllmDPConfig()
        self._legacy = self.config.formula == "legacy"
        # replica -> (taken_at_s of the snapshot the extra counts apply to, extra waiting)
        self._extra: dict[int, tuple[float, int]] = {}
        self._chosen: ReplicaSnapshot | None = None  # the last choice's snapshot
        self._start = self.config.start_index  # the next scan's start (current formula)

    def _waiting(self, snap: ReplicaSnapshot) -> int:
        taken_at, extra = self._extra.get(snap.replica_id, (snap.taken_at_s, 0))
        return snap.num_waiting + (extra if taken_at == snap.taken_at_s else 0)

    @property
    def completion_blind(self) -> bool:
        return self._legacy  # the current formula reads its own in-flight counts

    def _score(self, snap: ReplicaSnapshot) -> float:
        waiting, running = self._waiting(snap), snap.num_running
        if self._legacy:
            return float(waiting * 4 + running)
        in_flight = self.local.count.get(snap.replica_id, 0)
        score = float(max(self.config.client_count * in_flight, waiting + running))
        if waiting:  # a queue on a KV-bound engine drains slowly: 0 at <= 50% usage
            score += waiting * 6.0 * max(0.0, snap.kv_usage - 0.5)
        return score

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        snaps = by_id(replicas)
        ids = sorted(snaps)
        start = self._start % len(ids)
        scan = ids[start:] + ids[:start]
        score = {r: self._score(snaps[r]) for r in ids}
        self._chosen = snaps[first_min(scan, score)]
        reason = ("min waiting*4 + running" if self._legacy else
                  "min max(in flight, waiting + running) + KV-pressure waiting penalty")
        return RoutingDecision(self._chosen.replica_id, reason, score)

    def on_routed(self, request: RoutingRequest, replica: int) -> None:
        super().on_routed(request, replica)
        if not self._legacy:
            self._start += 1  # vLLM rotates the scan's start after every dispatch
        snap = self._chosen
        if snap is None or snap.replica_id != replica:
            return
        taken_at, extra = self._extra.get(replica, (snap.taken_at_s, 0))
        if taken_at != snap.taken_at_s:
            extra = 0  # a fresh scrape replaced the speculative counts
        self._extra[replica] = (snap.taken_at_s, extra + self.config.client_count)


@dataclass(frozen=True, slots=True, kw_only=True)
class PowerOfTwoConfig:
    """Attributes:
    load: "in-flight" (this router's count) or "snapshot" (the scraped KV usage).
    """

    load: str = "in-flight"

    def __post_init__(self) -> None:
        require(
            self.load in ("in-flight", "snapshot"),
            f"load must be 'in-flight' or 'snapshot', got {self.load!r}",
        )


class PowerOfTwo(RouterPolicy):
    name: ClassVar[str] = "power-of-two"
    config_type: ClassVar[type[PowerOfTwoConfig]] = PowerOfTwoConfig

    @property
    def reads_token_ids(self) -> bool:
        return False

    def __init__(self, config: PowerOfTwoConfig | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or PowerOfTwoConfig()

    def _load(self, replica: int, replicas: Sequence[ReplicaSnapshot]) -> float:
        if self.config.load == "snapshot":
            snap = next(r for r in replicas if r.replica_id == replica)
            return snap.kv_usage
        return float(self.local.count.get(replica, 0))

    @property
    def completion_blind(self) -> bool:
        return self.config.load == "snapshot"

    @property
    def snapshot_blind(self) -> bool:
        return self.config.load != "snapshot"  # in flight: its own counts only

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        ids = self.candidate_ids(replicas)
        if len(ids) == 1:
            return RoutingDecision(ids[0], "only candidate")
        first, second = self.rng.sample_two(ids)
        load = {first: self._load(first, replicas), second: self._load(second, replicas)}
        replica = first if load[first] <= load[second] else second
        return RoutingDecision(replica, f"less loaded of {first} and {second}", load)
