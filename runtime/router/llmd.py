"""`llm-d`: the llm-d inference scheduler's weighted scorers and max-score picker.

Each enabled scorer maps every candidate to [0, 1]; the total is sum(weight * score) and the
highest total wins, ties drawn from the seeded generator (llm-d's `max-score-picker`
shuffles before sorting). Default profile (helm `config/charts/epplib/templates/
_config.yaml`): queue 2, kv-cache-utilization 2, prefix-cache 3. Scorers (llm-d/llm-d-
inference-scheduler `pkg/epp/framework/plugins/scheduling/scorer/*`, read at 520af47,
2026-05-17; fleet.md §2a):

- `queue`: (maxQ - q) / (maxQ - minQ) over the scraped waiting counts; all equal -> 1.
- `kv_cache_utilization`: 1 - scraped KV usage.
- `prefix_cache`: matched blocks / prompt blocks from the router's approximate index
  (`BlockLRUIndex`: 16-token blocks, at most 256 matched, 31,250 blocks per replica or the
  replica's pool size under autoTune); 0 for a prompt shorter than a block.
- `precise_prefix_cache`: leading blocks held per the (delayed) KV events / the request's
  blocks, clipped to [0, 1] (`absoluteScoredPods`, llm-d #1107); no blocks -> 0.
- `load_aware`: empty queue 0.5, else 0.5 * (1 - min(q, T) / T), T = 128.
- `active_request`: this router's in-flight count c; c <= idle_threshold (0) -> 1, else
  (maxC - c) / maxC * max_busy_score (1.0), maxC over the candidates (llm-d #931).
- `token_load`: 1 - min(1, in-flight tokens / T), T = 4,194,304; a request counts its
  input plus an output estimate, p + round(1.5 p) (`SimpleTokenEstimator`, OutputRatio 1.5;
  p = the prompt's tokens, where llm-d estimates them from the body's bytes / 4).
- `no_hit_lru`: for a cold request (no candidate matches a block) candidates never used for
  a cold request score 1 - i/(n-1) in id order, used ones 1 - (never_used + lru_rank)/(n-1)
  (oldest rank 0), floored at 0; warm requests 0.5 for all. LRU of 1,024 replicas.

`formula=legacy` is llm-d up to v0.8.0: the precise scorer min-max normalises the leading
blocks held (all equal -> 1; BLIS `sim/routing_scorers.go` documents it), and the active-
request scorer takes maxC over every replica the router has requests on.

Not modelled: the latency scorer (needs a TTFT/TPOT predictor), lora-affinity, session
affinity, running-requests and context-length scorers, the active-request scorer's request
timeout, and llm-d's characters-per-token approximation (rt hashes the token ids; autoTune's
block size from the engine is `block_size` here, 16 as vLLM's default).

The simulator may give `RoutingRequest.prefix_keys` instead (`prompt_blocking`: the index's
blocks), keys equal exactly when the chained hashes are (`sim.router_keys`); the index only
compares them for equality (dict keys, owner masks, LRU order by touch), so the decisions are
the same.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from runtime.router.policy import RouterPolicy, by_id, pick_max, require, require_formula, tie_note
from runtime.router.prefix_index import (
    BlockLRUIndex,
    PreciseIndex,
    RouterHash,
    prompt_block_hashes,
)
from runtime.router.snapshot import (
    PrefixKeys,
    PromptBlocking,
    ReplicaSnapshot,
    RoutingDecision,
    RoutingRequest,
)
from runtime.router.state import KvEvent

SCORERS = (
    "queue", "kv_cache_utilization", "prefix_cache", "precise_prefix_cache",
    "load_aware", "active_request", "token_load", "no_hit_lru",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class LlmdConfig:
    """Scorer weights (0 = off) and scorer parameters, llm-d's defaults."""

    queue: float = 2.0
    kv_cache_utilization: float = 2.0
    prefix_cache: float = 3.0
    precise_prefix_cache: float = 0.0
    load_aware: float = 0.0
    active_request: float = 0.0
    token_load: float = 0.0
    no_hit_lru: float = 0.0
    block_size: int = 16  # tokens per router-side block (blockSizeTokens)
    max_prefix_blocks: int = 256  # maxPrefixBlocksToMatch
    lru_capacity_per_server: int = 31_250  # blocks per replica without autoTune
    auto_tune: bool = True  # LRU capacity from the replica's KV pool size when known
    load_aware_threshold: int = 128
    idle_threshold: int = 0
    max_busy_score: float = 1.0
    token_load_threshold: int = 4_194_304
    no_hit_lru_size: int = 1024
    formula: str = "current"  # "legacy": llm-d <= v0.8.0 (see the module docstring)

    def __post_init__(self) -> None:
        require_formula(self.formula)
        for name in SCORERS:
            weight = getattr(self, name)
            require(weight >= 0, f"{name} weight must be >= 0, got {weight}")
        require(any(getattr(self, n) > 0 for n in SCORERS), "llm-d needs a scorer weight > 0")
        for name in ("block_size", "max_prefix_blocks", "lru_capacity_per_server",
                     "load_aware_threshold", "token_load_threshold", "no_hit_lru_size"):
            value = getattr(self, name)
            require(value >= 1, f"{name} must be >= 1, got {value}")
        require(self.idle_threshold >= 0, f"idle_threshold must be >= 0, got {self.idle_threshold}")
        require(0.0 <= self.max_busy_score <= 1.0,
                f"max_busy_score must be in [0, 1], got {self.max_busy_score}")


@dataclass(frozen=True, slots=True)
class _Pending:
    hashes: list[RouterHash]
    cold: bool
    snaps: dict[int, ReplicaSnapshot]  # the candidates: the chosen one's LRU capacity


def token_estimate(prompt_len: int) -> int:
    """llm-d's `SimpleTokenEstimator`: input + round(input * 1.5), Go's round (half away
    from zero; tokens are >= 0, so floor(x + 0.5), done in integers: (3p + 1) // 2)."""
    return prompt_len + (3 * prompt_len + 1) // 2


def min_max(values: dict[int, float], higher_better: bool) -> dict[int, float]:
    """(x - min) / (max - min), or (max - x) / (max - min); all equal -> 1 for all."""
    lo, hi = min(values.values()), max(values.values())
    if hi == lo:
        return dict.fromkeys(values, 1.0)
    if higher_better:
        return {r: (v - lo) / (hi - lo) for r, v in values.items()}
    return {r: (hi - v) / (hi - lo) for r, v in values.items()}


class Llmd(RouterPolicy):
    name: ClassVar[str] = "llm-d"
    config_type: ClassVar[type[LlmdConfig]] = LlmdConfig

    def __init__(self, config: LlmdConfig | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or LlmdConfig()
        self.index = BlockLRUIndex()
        self.precise = PreciseIndex()
        self._cold_lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._pending: dict[str, _Pending] = {}
        self._legacy = self.config.formula == "legacy"
        # token_load: replica -> `token_estimate` summed over this router's in-flight
        # requests there (`local.in_flight` holds each one's replica and prompt length)
        self._est_tokens: dict[int, int] = {}
        self._blocking = PromptBlocking(self.config.block_size, self.config.max_prefix_blocks)
        # whether the index holds driver keys (True) or hashes of token ids (False); None
        # before the first request. One index never holds both (`PrefixKeys`).
        self._keyed: bool | None = None

    @property
    def prompt_blocking(self) -> PromptBlocking:
        """The approximate index's blocks (`block_size`, `max_prefix_blocks`): llm-d reads
        token ids only to hash them."""
        return self._blocking

    @property
    def completion_blind(self) -> bool:
        cfg = self.config  # the in-flight and KV-event scorers read completions
        return cfg.active_request == cfg.token_load == cfg.precise_prefix_cache == 0

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        snaps = by_id(replicas)
        ids = sorted(snaps)
        cfg = self.config
        keys = request.prefix_keys
        if (keys is not None) is not self._keyed:
            self._key_space(keys is not None)
        hashes = (prompt_block_hashes(request.token_ids, cfg.block_size, cfg.max_prefix_blocks)
                  if keys is None else self._given_keys(keys, request.prompt_len))
        matched = self.index.match(hashes)
        cold = not any(matched.get(r, 0) > 0 for r in ids)
        total = dict.fromkeys(ids, 0.0)
        for name in SCORERS:
            weight = getattr(cfg, name)
            if weight > 0:
                for r, s in self._score(name, request, snaps, ids, hashes, matched, cold).items():
                    total[r] += weight * s
        replica, tied = pick_max(total, self.rng)
        self._pending[request.request_id] = _Pending(hashes, cold, snaps)
        return RoutingDecision(replica, "max weighted score" + tie_note(tied), total)

    def _key_space(self, keyed: bool) -> None:
        """Fix the index's key space at the first request; ValueError at a request keyed
        the other way (keys and hashes of token ids never meet in one index)."""
        if self._keyed is not None:
            raise ValueError("llm-d got prefix keys after hashing token ids" if keyed else
                             "llm-d got no prefix keys after keyed requests")
        self._keyed = keyed

    def _given_keys(self, keys: PrefixKeys, prompt_len: int) -> list[RouterHash]:
        """The driver's stand-ins for the prompt's block hashes (`PrefixKeys`); ValueError
        if they were cut other than this index's blocks or are not one per hash
        `prompt_block_hashes` would make of `prompt_len` tokens."""
        if keys.blocking != self._blocking:
            raise ValueError(f"prefix keys of {keys.blocking} given to llm-d with "
                             f"{self._blocking}")
        expected = self._blocking.num_blocks(prompt_len)
        if len(keys.keys) != expected:
            raise ValueError(f"{len(keys.keys)} prefix keys for a {prompt_len}-token prompt, "
                             f"expected {expected}")
        return keys.keys

    def _capacity(self, snap: ReplicaSnapshot) -> int:
        if self.config.auto_tune and snap.num_gpu_blocks is not None:
            return snap.num_gpu_blocks
        return self.config.lru_capacity_per_server

    def _score(
        self, name: str, request: RoutingRequest, snaps: dict[int, ReplicaSnapshot],
        ids: list[int], hashes: list[RouterHash], matched: dict[int, int], cold: bool,
    ) -> dict[int, float]:
        cfg = self.config
        if name == "queue":
            return min_max({r: float(snaps[r].num_waiting) for r in ids}, higher_better=False)
        if name == "kv_cache_utilization":
            return {r: 1.0 - snaps[r].kv_usage for r in ids}
        if name == "prefix_cache":
            return {r: matched.get(r, 0) / len(hashes) if hashes else 0.0 for r in ids}
        if name == "precise_prefix_cache":
            return self._precise_scores(request, ids)
        if name == "load_aware":
            t = cfg.load_aware_threshold
            return {r: 0.5 * (1.0 - min(snaps[r].num_waiting, t) / t) for r in ids}
        if name == "active_request":
            return self._active_request_scores(ids)
        if name == "token_load":
            t = cfg.token_load_threshold
            return {r: 1.0 - min(1.0, self._est_tokens.get(r, 0) / t) for r in ids}
        return self._no_hit_lru_scores(ids, cold)

    def _precise_scores(self, request: RoutingRequest, ids: list[int]) -> dict[int, float]:
        overlap = self.precise.overlap_blocks(request.block_hashes)
        if self._legacy:
            return min_max({r: float(overlap.get(r, 0)) for r in ids}, higher_better=True)
        total = len(request.block_hashes)  # overlap <= total: no clipping needed
        return {r: overlap.get(r, 0) / total if total else 0.0 for r in ids}

    def _active_request_scores(self, ids: list[int]) -> dict[int, float]:
        tracked = ids if not self._legacy else self.local.count  # maxC over these
        counts = {r: c for r in tracked if (c := self.local.count.get(r, 0)) > 0}
        max_count = max(counts.values(), default=0)
        scores = {}
        for r in ids:
            c = counts.get(r, 0)
            idle = c <= self.config.idle_threshold
            scores[r] = 1.0 if idle else (max_count - c) / max_count * self.config.max_busy_score
        return scores

    def _no_hit_lru_scores(self, ids: list[int], cold: bool) -> dict[int, float]:
        n = len(ids)
        if not cold:
            return dict.fromkeys(ids, 0.5)
        if n == 1:
            return {ids[0]: 1.0}
        rank = {r: i for i, r in enumerate(self._cold_lru)}
        never = [r for r in ids if r not in rank]
        scores = {r: 1.0 - i / (n - 1) for i, r in enumerate(never)}
        for r in ids:
            if r in rank:
                scores[r] = max(0.0, 1.0 - (len(never) + rank[r]) / (n - 1))
        return scores

    def on_routed(self, request: RoutingRequest, replica: int) -> None:
        super().on_routed(request, replica)
        self._est_tokens[replica] = (self._est_tokens.get(replica, 0)
                                     + token_estimate(request.prompt_len))
        pending = self._pending.pop(request.request_id, None)
        if pending is None:
            return
        snap = pending.snaps.get(replica)
        capacity = self.config.lru_capacity_per_server if snap is None else self._capacity(snap)
        self.index.add(pending.hashes, replica, capacity)
        if pending.cold:
            self._cold_lru.pop(replica, None)
            self._cold_lru[replica] = None
            if len(self._cold_lru) > self.config.no_hit_lru_size:
                self._cold_lru.popitem(last=False)

    def on_finished(self, request_id: str) -> None:
        entry = self.local.in_flight.get(request_id)
        if entry is not None:  # before `local` forgets it
            self._est_tokens[entry.replica] -= token_estimate(entry.prompt_len)
        super().on_finished(request_id)

    @property
    def wants_kv_events(self) -> bool:
        return self.config.precise_prefix_cache > 0

    def on_kv_events(self, events: Iterable[KvEvent]) -> None:
        self.precise.apply(events)
