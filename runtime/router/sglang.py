"""`sglang-cache-aware`: the SGLang model gateway's (SMG) cache-aware policy.

lightseekorg/smg `model_gateway/src/policies/cache_aware.rs` (`select_worker`, 73da68c,
2026-08-07; SMG continues sgl-project/sglang's `sgl-model-gateway`), with the token radix
tree of `crates/kv_index/src/token_tree.rs`; defaults from its CLI (`model_gateway/src/
main.rs`):

1. load = this router's in-flight requests per worker. If max - min > balance_abs_threshold
   (64) and max > balance_rel_threshold (1.5) * min, the fleet is imbalanced: go to the least
   loaded worker.
2. Else match the prompt in the tree: match rate = matched tokens / prompt tokens. Above
   cache_threshold (0.3) go to a worker holding the longest match; otherwise to the least
   loaded worker.
3. Either way the prompt is inserted into the tree for the chosen worker.

"Least loaded" is SMG's `(load, processed, index)` minimum: fewest in flight, then fewest
requests this router ever sent there, then the lowest id. The tree holds pages of
`page_size` (16) tokens and drops a prompt's partial last page (`align_to_page`), so a prompt
under one page never matches; the rate's denominator is the whole prompt. Every
`eviction_interval_s` (120) the tree is trimmed to `max_tree_size` (67,108,864) tokens per
worker by dropping least recently used leaves (done at the first decision after each
interval). Ties between equally good holders, which SMG leaves to its tree's cached "any
tenant", are drawn from the seeded generator.

Not modelled: SMG's KV-usage imbalance triggers (`balance_token_usage_threshold`,
`overload_token_usage_threshold`, off by default) and its KV-event-driven variant.

`formula=legacy`, the SGLang router before the gateway (sgl-project/sglang `sgl-router/src/
policies/cache_aware.rs`, `tree.get_smallest_tenant()`): the low-match branch goes to the
worker whose tree is smallest ("most free cache"; ties drawn from the seed), the imbalanced
branch to the first of the fewest in flight (Rust's `min_by_key`), and the partial last page
is matched and inserted (SGLang's tree held characters, not pages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from runtime.router.policy import RouterPolicy, first_min, require, require_formula, tie_note
from runtime.router.prefix_index import PageTrie
from runtime.router.snapshot import ReplicaSnapshot, RoutingDecision, RoutingRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class SglangConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    page_size: int = 16
    eviction_interval_s: float = 120.0
    max_tree_size: int = 67_108_864
    formula: str = "current"

    def __post_init__(self) -> None:
        require_formula(self.formula)
        require(0.0 <= self.cache_threshold <= 1.0,
                f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        require(self.balance_abs_threshold >= 0,
                f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        require(self.balance_rel_threshold >= 1.0,
                f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        require(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        require(self.eviction_interval_s > 0,
                f"eviction_interval_s must be > 0, got {self.eviction_interval_s}")
        require(self.max_tree_size >= 1, f"max_tree_size must be >= 1, got {self.max_tree_size}")


class SglangCacheAware(RouterPolicy):
    name: ClassVar[str] = "sglang-cache-aware"
    config_type: ClassVar[type[SglangConfig]] = SglangConfig

    def __init__(self, config: SglangConfig | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or SglangConfig()
        self.tree = PageTrie(self.config.page_size)
        self._next_eviction_s = self.config.eviction_interval_s
        self._legacy = self.config.formula == "legacy"
        self._routed: dict[int, int] = {}  # replica -> requests ever sent (SMG's `processed`)
        # the request `choose` last matched and its tree tokens (`_tree_tokens`)
        self._kept_tokens: tuple[RoutingRequest, tuple[int, ...]] | None = None

    @property
    def snapshot_blind(self) -> bool:
        return True  # its own in-flight counts and tree only

    def _maybe_evict(self, now_s: float) -> None:
        if now_s >= self._next_eviction_s:
            self.tree.evict_to(self.config.max_tree_size)
            interval = self.config.eviction_interval_s
            self._next_eviction_s = (now_s // interval + 1) * interval

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        cfg = self.config
        ids = self.candidate_ids(replicas)
        self._maybe_evict(request.now_s)
        count = self.local.count
        load = {r: float(count.get(r, 0)) for r in ids}
        hi, lo = max(load.values()), min(load.values())
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            return RoutingDecision(self._least_loaded(ids, load), "imbalanced: least loaded",
                                   load)
        tokens = self._tree_tokens(request)
        self._kept_tokens = (request, tokens)  # for `on_routed`
        matched, holders = self.tree.match(tokens, ids)
        rate = matched / request.prompt_len
        if rate > cfg.cache_threshold:
            best = sorted(holders)
            replica = best[0] if len(best) == 1 else self.rng.choice(best)
            return RoutingDecision(
                replica, f"match rate {rate:.3f} > {cfg.cache_threshold}" + tie_note(len(best)),
                {r: (rate if r in holders else 0.0) for r in ids},
            )
        if not self._legacy:
            return RoutingDecision(
                self._least_loaded(ids, load),
                f"match rate {rate:.3f} <= {cfg.cache_threshold}: least loaded", load)
        size = {r: float(self.tree.size(r)) for r in ids}
        least = min(size.values())
        smallest = [r for r in ids if size[r] == least]  # ids ascend
        replica = smallest[0] if len(smallest) == 1 else self.rng.choice(smallest)
        return RoutingDecision(
            replica, f"match rate {rate:.3f} <= {cfg.cache_threshold}: smallest tree"
            + tie_note(len(smallest)), size,
        )

    def _least_loaded(self, ids: list[int], load: dict[int, float]) -> int:
        """SMG's min of (in flight, routed, id); legacy: the first of the fewest in flight."""
        if self._legacy:
            return first_min(ids, load)
        routed = self._routed
        return min(ids, key=lambda r: (load[r], routed.get(r, 0)))  # ids ascend: id last

    def _tree_tokens(self, request: RoutingRequest) -> tuple[int, ...]:
        """The prompt as the tree sees it: whole pages only (legacy: every token), as the
        tuple the tree reads. Made once per request: `choose` keeps it for `on_routed` of
        the same request object (a tuple of ~1,100 tokens cost ~12 us)."""
        kept = self._kept_tokens
        if kept is not None and kept[0] is request:
            return kept[1]
        tokens = request.token_ids or ()
        if not self._legacy:
            page = self.config.page_size
            tokens = tokens[:len(tokens) // page * page]
        return tuple(tokens)

    def on_routed(self, request: RoutingRequest, replica: int) -> None:
        super().on_routed(request, replica)
        self._routed[replica] = self._routed.get(replica, 0) + 1
        self.tree.insert(self._tree_tokens(request), replica, request.now_s)
        self._kept_tokens = None  # a policy keeps no request's tokens past its routing
