"""`dynamo-kv`: NVIDIA Dynamo's KV router cost and worker selection.

Per candidate worker, in KV blocks of `block_size` tokens (ai-dynamo/dynamo
`lib/kv-router/src/scheduling/selector.rs`, `DefaultWorkerSelector::worker_logit`):

    overlap      = leading prompt blocks the worker holds (KV events, `PreciseIndex`)
    decode       = active_blocks + additional_blocks
                   (distinct full blocks of this router's in-flight prompts on the worker,
                   plus the request's full blocks not among them: `WorkerLoadProjection::
                   potential_decode_blocks`; a partial last block is prefill work only, as
                   Dynamo hashes full blocks, `chunks_exact`; without hashes, a trace of
                   lengths only, every full block is distinct, as Dynamo's random hashes
                   without KV reuse)
    overlap-load (current, default):
        raw_prefill = (active_prefill_tokens + prompt_len) / block_size
        cost = prefill_load_scale * max(0, raw_prefill - overlap_score_credit * overlap)
               + decode
    legacy (<= v1.0):
        cost = overlap_score_weight * (prompt_len - overlap * block_size) / block_size
               + decode

`active_prefill_tokens` = uncached prompt tokens of the worker's in-flight requests whose
prefill is not done (`on_prefill_done`; without it they count until `on_finished`).
Defaults: credit 1.0, prefill_load_scale 1.0, overlap_score_weight 1.0, temperature 0
(`scheduling/config.rs`; read at selector/default.rs 07a6c9c, sequences/prompt_registry.rs
and block_tracker.rs, the index's versions: the repository is over the fetch limit).
Selection: temperature 0 -> argmin, ties drawn uniformly (Dynamo's reservoir draw, here from
the seeded generator); temperature T > 0 -> costs min-max normalised, negated, divided by T,
softmax, one draw (`softmax_sample_entries`; all costs equal -> uniform).

Not modelled: host/disk tier credits, shared-cache credit, credit decay (off by default),
the active-request weight (0 by default), output-block tracking (off by default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from runtime.block_hash import BlockHash
from runtime.router.policy import (
    RouterPolicy,
    candidate_ids,
    pick_min,
    require,
    require_formula,
    tie_note,
)
from runtime.router.prefix_index import PreciseIndex
from runtime.router.snapshot import ReplicaSnapshot, RoutingDecision, RoutingRequest
from runtime.router.state import KvEvent


@dataclass(frozen=True, slots=True, kw_only=True)
class DynamoConfig:
    """Attributes:
    formula: "overlap-load" (current) or "legacy".
    overlap_score_credit: blocks of prefill credited per cached block (0 ignores the cache).
    prefill_load_scale: weight of the (credited) prefill blocks against decode blocks.
    overlap_score_weight: the legacy formula's weight of prefill blocks.
    temperature: 0 = argmin; > 0 = softmax sampling over normalised costs.
    block_size: tokens per KV block (the engines' block size; block_hashes use it too).
    """

    formula: str = "overlap-load"
    overlap_score_credit: float = 1.0
    prefill_load_scale: float = 1.0
    overlap_score_weight: float = 1.0
    temperature: float = 0.0
    block_size: int = 16

    def __post_init__(self) -> None:
        require_formula(self.formula, current="overlap-load")
        for name in ("overlap_score_credit", "prefill_load_scale", "overlap_score_weight",
                     "temperature"):
            value = getattr(self, name)
            require(value >= 0, f"{name} must be >= 0, got {value}")
        require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")


@dataclass(slots=True)
class _Active:
    replica: int
    prefill_tokens: int  # uncached prompt tokens, counted until prefill is done
    hashes: tuple[BlockHash, ...]
    unhashed_blocks: int  # full blocks without a hash (all of them if no hashes)


def softmax_pick(costs: dict[int, float], temperature: float, sample: float) -> int:
    """Dynamo's `softmax_sample_entries` over `costs` in id order with draw `sample`."""
    ids = sorted(costs)
    lo, hi = min(costs.values()), max(costs.values())
    if lo == hi:
        probs = [1.0] * len(ids)
    else:
        scale = -1.0 / ((hi - lo) * temperature)
        probs = [math.exp(costs[r] * scale - lo * scale) for r in ids]
    total = sum(probs)
    cumsum = 0.0
    for r, p in zip(ids, probs, strict=True):
        cumsum += p / total
        if sample <= cumsum:
            return r
    return ids[-1]


class DynamoKv(RouterPolicy):
    name: ClassVar[str] = "dynamo-kv"
    config_type: ClassVar[type[DynamoConfig]] = DynamoConfig

    @property
    def reads_token_ids(self) -> bool:
        return False

    def __init__(self, config: DynamoConfig | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or DynamoConfig()
        self.precise = PreciseIndex()
        self._active: dict[str, _Active] = {}
        self._blocks: dict[int, Counter[BlockHash]] = {}  # replica -> in-flight block refs
        self._unhashed: dict[int, int] = {}
        self._prefill_tokens: dict[int, int] = {}
        self._overlap: dict[str, dict[int, int]] = {}  # request id -> overlap, until routed

    def active_blocks(self, replica: int) -> int:
        return len(self._blocks.get(replica, ())) + self._unhashed.get(replica, 0)

    def costs(self, request: RoutingRequest, ids: Sequence[int]) -> dict[int, float]:
        """Each candidate's cost, in blocks (lower is better)."""
        cfg, bs = self.config, self.config.block_size
        overlap = self.precise.overlap_blocks(request.block_hashes)
        self._overlap[request.request_id] = overlap
        request_blocks = request.prompt_len // bs  # full blocks: a partial one is prefill only
        costs = {}
        for r in ids:
            held = self._blocks.get(r, Counter())
            shared = sum(1 for h in request.block_hashes if h in held)
            decode = self.active_blocks(r) + request_blocks - shared
            cached = overlap.get(r, 0)
            if cfg.formula == "legacy":
                prefill = cfg.overlap_score_weight * (request.prompt_len - cached * bs) / bs
            else:
                raw = (self._prefill_tokens.get(r, 0) + request.prompt_len) / bs
                prefill = cfg.prefill_load_scale * max(0.0, raw - cfg.overlap_score_credit * cached)
            costs[r] = prefill + decode
        return costs

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        costs = self.costs(request, candidate_ids(replicas))
        if self.config.temperature == 0.0:
            replica, tied = pick_min(costs, self.rng)
            return RoutingDecision(replica, "argmin cost" + tie_note(tied), costs)
        replica = softmax_pick(costs, self.config.temperature, self.rng.random())
        return RoutingDecision(replica, f"softmax draw, T={self.config.temperature}", costs)

    def on_routed(self, request: RoutingRequest, replica: int) -> None:
        super().on_routed(request, replica)
        overlap = self._overlap.pop(request.request_id, {})
        bs = self.config.block_size
        uncached = max(0, request.prompt_len - overlap.get(replica, 0) * bs)
        unhashed = request.prompt_len // bs - len(request.block_hashes)
        active = _Active(replica, uncached, request.block_hashes, max(0, unhashed))
        self._active[request.request_id] = active
        self._blocks.setdefault(replica, Counter()).update(active.hashes)
        self._unhashed[replica] = self._unhashed.get(replica, 0) + active.unhashed_blocks
        self._prefill_tokens[replica] = self._prefill_tokens.get(replica, 0) + uncached

    def on_prefill_done(self, request_id: str) -> None:
        active = self._active.get(request_id)
        if active is not None and active.prefill_tokens:
            self._prefill_tokens[active.replica] -= active.prefill_tokens
            active.prefill_tokens = 0

    def on_finished(self, request_id: str) -> None:
        super().on_finished(request_id)
        self.on_prefill_done(request_id)
        active = self._active.pop(request_id, None)
        if active is None:
            return
        held = self._blocks[active.replica]
        for h in active.hashes:
            held[h] -= 1
            if not held[h]:
                del held[h]
        self._unhashed[active.replica] -= active.unhashed_blocks

    @property
    def wants_kv_events(self) -> bool:
        return True

    def on_kv_events(self, events: Iterable[KvEvent]) -> None:
        self.precise.apply(events)
