"""`prefix-aware` and `kv-aware`: vLLM production-stack's prefix routers
(vllm-project/production-stack `src/vllm_router/routers/routing_logic.py`).

- `prefix-aware` (`PrefixAwareRouter` + `prefix/hashtrie.py`): a router-side trie of prompt
  chunks recording which endpoints were sent each chunk; no eviction. The longest prefix
  held by an available endpoint wins, drawn at random among the endpoints holding all of it
  (all endpoints when nothing matches); the prompt is then inserted for the choice. The
  chunks are 128 characters there, `chunk_tokens` = 32 tokens here (llm-d's 4 characters
  per token). `min_match_tokens` (`--prefix-min-match-length`, 0 = off): a shorter match
  falls back to the lowest-QPS endpoint.
- `kv-aware` (`KvawareRouter`): asks the LMCache controller which instance holds the
  longest cached prefix of the prompt; here the (delayed) KV-event index of the engines'
  prefix caches stands in for LMCache. If nothing matches, or the match is shorter than
  `prompt_len - kv_aware_threshold` (2000 tokens), it falls back to the session ring when
  the request has a session id, else to the lowest-QPS endpoint; otherwise it goes to the
  holder of the longest match (the first LMCache reports; ties drawn from the seed here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from runtime.router.policy import (
    RouterPolicy,
    SnapshotBlindPolicy,
    candidate_ids,
    pick_max,
    require,
    tie_note,
)
from runtime.router.prefix_index import PageTrie, PreciseIndex
from runtime.router.session import RingCache, check_virtual_nodes, lowest_qps
from runtime.router.snapshot import ReplicaSnapshot, RoutingDecision, RoutingRequest
from runtime.router.state import KvEvent


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixAwareConfig:
    chunk_tokens: int = 32
    min_match_tokens: int = 0
    qps_window_s: float = 60.0

    def __post_init__(self) -> None:
        require(self.chunk_tokens >= 1, f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        require(self.min_match_tokens >= 0,
                f"min_match_tokens must be >= 0, got {self.min_match_tokens}")
        require(self.qps_window_s > 0, f"qps_window_s must be > 0, got {self.qps_window_s}")


class PrefixAware(SnapshotBlindPolicy):
    name: ClassVar[str] = "prefix-aware"
    config_type: ClassVar[type[PrefixAwareConfig]] = PrefixAwareConfig

    def __init__(self, config: PrefixAwareConfig | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or PrefixAwareConfig()
        self.trie = PageTrie(self.config.chunk_tokens)

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        ids = self.candidate_ids(replicas)
        matched, holders = self.trie.match(request.token_ids or (), ids)
        scores = {r: float(matched if r in holders else 0) for r in ids}
        if matched < self.config.min_match_tokens:
            replica = lowest_qps(self.local, ids, request.now_s, self.config.qps_window_s)
            return RoutingDecision(replica, f"match {matched} < min: lowest QPS", scores)
        best = sorted(holders)
        replica = self.rng.choice(best)
        return RoutingDecision(
            replica, f"longest match {matched} tokens" + tie_note(len(best)), scores
        )

    def on_routed(self, request: RoutingRequest, replica: int) -> None:
        super().on_routed(request, replica)
        self.trie.insert(request.token_ids or (), replica, request.now_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class KvAwareConfig:
    kv_aware_threshold: int = 2000
    block_size: int = 16  # tokens per engine KV block (of RoutingRequest.block_hashes)
    virtual_nodes: int = 160
    qps_window_s: float = 60.0

    def __post_init__(self) -> None:
        require(self.kv_aware_threshold >= 0,
                f"kv_aware_threshold must be >= 0, got {self.kv_aware_threshold}")
        require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        check_virtual_nodes(self.virtual_nodes)
        require(self.qps_window_s > 0, f"qps_window_s must be > 0, got {self.qps_window_s}")


class KvAware(RouterPolicy):
    name: ClassVar[str] = "kv-aware"
    config_type: ClassVar[type[KvAwareConfig]] = KvAwareConfig

    @property
    def reads_token_ids(self) -> bool:
        return False

    def __init__(self, config: KvAwareConfig | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or KvAwareConfig()
        self.precise = PreciseIndex()
        self._rings = RingCache(self.config.virtual_nodes)

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        cfg = self.config
        ids = candidate_ids(replicas)
        overlap = self.precise.overlap_blocks(request.block_hashes)
        matched = {r: float(overlap.get(r, 0) * cfg.block_size) for r in ids}
        best = max(matched.values())
        if best > 0 and best >= request.prompt_len - cfg.kv_aware_threshold:
            replica, tied = pick_max(matched, self.rng)
            return RoutingDecision(
                replica, f"longest cached prefix {int(best)} tokens" + tie_note(tied), matched
            )
        if request.session_id is not None:
            replica = self._rings.get(ids, request.session_id)
            return RoutingDecision(replica, "short match: session ring", matched)
        replica = lowest_qps(self.local, ids, request.now_s, cfg.qps_window_s)
        return RoutingDecision(replica, "short match: lowest QPS", matched)

    @property
    def wants_kv_events(self) -> bool:
        return True

    def on_kv_events(self, events: Iterable[KvEvent]) -> None:
        self.precise.apply(events)
