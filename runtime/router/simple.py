"""Load-only policies: round-robin, random, least-outstanding, vllm-dp, power-of-two.

- `round-robin`: the i-th request goes to candidate i mod n (candidates in id order).
  Vidur `vidur/scheduler/global_scheduler/round_robin_global_scheduler.py` (its default);
  production-stack `RoundRobinRouter` (endpoints sorted by URL).
- `random`: uniform over the candidates, from the seeded generator. Vidur
  `random_global_scheduler.py`, SGLang router `random`.
- `least-outstanding`: argmin of this router's in-flight requests, ties to the lowest id.
  Vidur `lor_global_scheduler.py`: `min` over the replicas' pending counts, +1 locally per
  assignment (here the in-flight count, incremented on dispatch, decremented on finish).
- `vllm-dp`: argmin of `waiting * 4 + running` over the scraped engine stats, plus the
  client's speculative `+client_count` waiting per dispatch until the next scrape; ties to
  the first candidate scanned from `start_index`. vLLM `v1/engine/core_client.py`
  `DPLBAsyncMPClient.get_core_engine_for_request` (stats every 100 ms from the DP
  coordinator, fleet.md §4).
- `power-of-two`: two distinct candidates drawn at random, the less loaded wins, the first
  drawn on a tie. SGLang router `sgl-router/src/policies/power_of_two.rs`; load = the
  router's in-flight count (`load=in-flight`, SGLang's worker load counter) or the scraped
  `running + waiting` (`load=snapshot`, the periodic load check of newer SMG versions).
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
        start_index: where the scan for the minimum starts (vLLM's `eng_start_index`,
            `num_engines * client_index // client_count`; 0 for one client).
        client_count: how much a dispatch adds to the chosen engine's waiting count until
            the next stats update (vLLM's API-server client count).
    """

    start_index: int = 0
    client_count: int = 1

    def __post_init__(self) -> None:
        require(self.start_index >= 0, f"start_index must be >= 0, got {self.start_index}")
        require(self.client_count >= 1, f"client_count must be >= 1, got {self.client_count}")


class VllmDP(RouterPolicy):
    name: ClassVar[str] = "vllm-dp"
    config_type: ClassVar[type[VllmDPConfig]] = VllmDPConfig

    @property
    def reads_token_ids(self) -> bool:
        return False

    def __init__(self, config: VllmDPConfig | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or VllmDPConfig()
        # replica -> (taken_at_s of the snapshot the extra counts apply to, extra waiting)
        self._extra: dict[int, tuple[float, int]] = {}
        self._chosen: ReplicaSnapshot | None = None  # the last choice's snapshot

    def _waiting(self, snap: ReplicaSnapshot) -> int:
        taken_at, extra = self._extra.get(snap.replica_id, (snap.taken_at_s, 0))
        return snap.num_waiting + (extra if taken_at == snap.taken_at_s else 0)

    @property
    def completion_blind(self) -> bool:
        return True

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        snaps = by_id(replicas)
        ids = sorted(snaps)
        start = self.config.start_index % len(ids)
        scan = ids[start:] + ids[:start]
        score = {r: float(self._waiting(snaps[r]) * 4 + snaps[r].num_running) for r in ids}
        self._chosen = snaps[first_min(scan, score)]
        return RoutingDecision(self._chosen.replica_id, "min waiting*4 + running", score)

    def on_routed(self, request: RoutingRequest, replica: int) -> None:
        super().on_routed(request, replica)
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
    load: "in-flight" (this router's count) or "snapshot" (scraped running + waiting).
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
            return float(snap.num_running + snap.num_waiting)
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
