"""`session-hash`: consistent hashing of a session id onto the replicas.

Each replica owns `virtual_nodes` points on a 64-bit ring (MD5 of "replica-i"); a session
goes to the owner of the first point at or after MD5(session id), so adding or removing a
replica moves only the sessions of the arcs it gains or loses. SGLang router
`consistent_hash` (160 virtual nodes); production-stack `SessionRouter`
(`src/vllm_router/routers/routing_logic.py`, uhashring's ring, whose point layout differs,
so the session -> replica map is not theirs byte for byte). A request without a session id
goes to the replica with the lowest recent QPS from this router (production-stack's
`_qps_routing`: the first replica never sent anything if there is one, else the first of
the lowest QPS over the last `qps_window_s`).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from runtime.router.policy import SnapshotBlindPolicy, first_min, require
from runtime.router.snapshot import ReplicaSnapshot, RoutingDecision, RoutingRequest
from runtime.router.state import RouterLocal

# Ring points per replica at most: 6x the 160 of SGLang and uhashring. The ring is built (MD5
# of each point, then sorted) whenever the candidate set changes: 4096 replicas x 1000 points
# take 12.5 s here; virtual_nodes=1e9 hung at the first request with a session id.
MAX_VIRTUAL_NODES = 1000


def _point(key: str) -> int:
    return int.from_bytes(hashlib.md5(key.encode()).digest()[:8], "big")


class HashRing:
    """A consistent-hash ring over a set of replica ids."""

    def __init__(self, replicas: Sequence[int], virtual_nodes: int) -> None:
        points = sorted(
            (_point(f"{replica}-{i}"), replica) for replica in replicas
            for i in range(virtual_nodes)
        )
        self._keys = [p for p, _ in points]
        self._owners = [r for _, r in points]

    def get(self, key: str) -> int:
        index = bisect.bisect_left(self._keys, _point(key)) % len(self._keys)
        return self._owners[index]


class RingCache:
    """The ring for the current candidate set, rebuilt only when the set changes."""

    def __init__(self, virtual_nodes: int) -> None:
        self.virtual_nodes = virtual_nodes
        self._ids: tuple[int, ...] = ()
        self._ring: HashRing | None = None

    def get(self, ids: Sequence[int], key: str) -> int:
        if self._ring is None or tuple(ids) != self._ids:
            self._ids = tuple(ids)
            self._ring = HashRing(ids, self.virtual_nodes)
        return self._ring.get(key)


def lowest_qps(local: RouterLocal, ids: Sequence[int], now_s: float, window_s: float) -> int:
    """production-stack's `_qps_routing` over this router's own dispatch counts: its scan
    returns the first endpoint without request stats (never sent to) as soon as it reaches
    it, so one such wins over any earlier endpoint; else the first of the lowest QPS."""
    for r in ids:
        if r not in local.routed_at:
            return r
    qps = {r: local.qps(r, now_s, window_s) for r in ids}
    return first_min(ids, qps)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionHashConfig:
    """Attributes:
    virtual_nodes: ring points per replica (SGLang's consistent_hash: 160).
    qps_window_s: window of the lowest-QPS fallback for requests without a session, s.
    """

    virtual_nodes: int = 160
    qps_window_s: float = 60.0

    def __post_init__(self) -> None:
        check_virtual_nodes(self.virtual_nodes)
        require(self.qps_window_s > 0, f"qps_window_s must be > 0, got {self.qps_window_s}")


def check_virtual_nodes(value: int) -> None:
    """ValueError unless 1 <= `value` <= MAX_VIRTUAL_NODES (ring points per replica)."""
    require(1 <= value <= MAX_VIRTUAL_NODES,
            f"virtual_nodes must be in [1, {MAX_VIRTUAL_NODES}], got {value}")


class SessionHash(SnapshotBlindPolicy):
    name: ClassVar[str] = "session-hash"
    config_type: ClassVar[type[SessionHashConfig]] = SessionHashConfig

    @property
    def reads_token_ids(self) -> bool:
        return False

    def __init__(self, config: SessionHashConfig | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or SessionHashConfig()
        self._rings = RingCache(self.config.virtual_nodes)

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        ids = self.candidate_ids(replicas)
        if request.session_id is None:
            replica = lowest_qps(self.local, ids, request.now_s, self.config.qps_window_s)
            return RoutingDecision(replica, "no session: lowest QPS")
        return RoutingDecision(self._rings.get(ids, request.session_id), "session ring")
