"""The typed objects crossing the router boundary: what is routed, what a router sees of a
replica, and what it decides.

A router sees a replica through two kinds of state (see `state.py`): its own bookkeeping
(in-flight requests, its prefix index), always fresh, kept inside the policy; and the
replica's engine metrics, a `ReplicaSnapshot` that may be stale (`taken_at_s` says how old).
Times are floats in seconds on the driver's clock (simulated or wall); nothing here reads one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from runtime.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class PromptBlocking:
    """How a router cuts a prompt into chained blocks (`prefix_index.prompt_block_hashes`):
    blocks of `block_size` tokens over the prompt's first `max_blocks * block_size` tokens,
    a partial tail block included."""

    block_size: int  # tokens per block
    max_blocks: int  # blocks hashed at most

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")

    def num_blocks(self, prompt_len: int) -> int:
        """The blocks (hashes) a prompt of `prompt_len` tokens gets: none under one block,
        else every block, the partial tail's included, up to `max_blocks`."""
        if prompt_len < self.block_size:
            return 0
        return min(-(-prompt_len // self.block_size), self.max_blocks)


@dataclass(frozen=True, slots=True)
class PrefixKeys:
    """Keys a driver computed in place of a router's chained prompt block hashes.

    `keys[i]` stands for hash i of `prompt_block_hashes(token_ids, blocking.block_size,
    blocking.max_blocks)` (as many keys as hashes): keys are equal exactly when the chained
    hashes of the token prefix are equal, i.e. same block index and same tokens up to the
    block's end. A router may only compare them for equality (dict keys, set members), and
    a driver gives them to every request of a run or to none: keys and hashes of token ids
    are unrelated values and must never meet in one index. The simulator makes them from
    its trace's block structure (`sim.router_keys`); a real router has no such keys.
    """

    blocking: PromptBlocking
    keys: list[int]

    def __post_init__(self) -> None:
        if len(self.keys) > self.blocking.max_blocks:
            raise ValueError(f"{len(self.keys)} keys exceed max_blocks "
                             f"{self.blocking.max_blocks}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingRequest:
    """One request to place on a replica.

    Attributes:
        request_id: unique per run; hooks (`on_routed`, `on_finished`) refer to it.
        now_s: the driver's time of the routing decision, seconds.
        prompt_len: prompt tokens.
        token_ids: the prompt's token ids (any sequence, not copied: the simulator passes
            the prompt's `array`; a policy must not keep or modify it), or None when the
            trace has lengths only (then every prefix-aware policy sees no match).
        block_hashes: the engine's chained hashes of the prompt's full KV blocks
            (`runtime.block_hash`, engine block size), for the precise, KV-event-fed index;
            empty when unknown.
        session_id: conversation key for `session-hash` (and production-stack's kv-aware
            fallback); None when the trace has none. The trace model has no session id yet,
            so a driver fills this field from wherever it has one.
        prefix_keys: stand-ins for the router's chained prompt block hashes, equal exactly
            when the chained hashes of the token prefix are equal (`PrefixKeys`), for a
            policy whose `prompt_blocking` is theirs; None: the policy hashes `token_ids`.
    """

    request_id: str
    now_s: float
    prompt_len: int
    token_ids: Sequence[int] | None = None
    block_hashes: tuple[BlockHash, ...] = ()
    session_id: str | None = None
    prefix_keys: PrefixKeys | None = None

    def __post_init__(self) -> None:
        # messages formatted on failure only: a simulator builds one request per routed
        # request (and a snapshot per replica per scrape); formatting them up front cost
        # more than building the object
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len}")
        if self.token_ids is not None and len(self.token_ids) != self.prompt_len:
            raise ValueError(f"token_ids has {len(self.token_ids)} tokens, "
                             f"prompt_len is {self.prompt_len}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaSnapshot:
    """A replica's engine metrics as last scraped (vLLM's /metrics gauges).

    Attributes:
        replica_id: the replica's index in the fleet.
        taken_at_s: when the metrics were read, seconds; a router acting at `now_s` sees
            state `now_s - taken_at_s` old.
        num_waiting: requests in the engine's waiting queue (vllm:num_requests_waiting).
        num_running: requests running (vllm:num_requests_running).
        kv_usage: fraction of KV blocks in use, in [0, 1] (vllm:kv_cache_usage_perc).
        num_gpu_blocks: the replica's KV pool size in blocks (static), or None if unknown;
            llm-d's autoTune sizes its per-replica prefix LRU from it.
    """

    replica_id: int
    taken_at_s: float
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    num_gpu_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.replica_id < 0:
            raise ValueError(f"replica_id must be >= 0, got {self.replica_id}")
        for name in ("num_waiting", "num_running"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Where a request goes and why.

    Attributes:
        replica: the chosen replica id (one of the candidates passed to `choose`).
        reason: a short phrase naming the branch taken ("argmin cost", "imbalanced: ...").
        scores: each candidate's score or cost as the policy's formula computed it
            (higher-better or lower-better per policy, see its docstring); empty for
            policies without one (round-robin, random).
    """

    replica: int
    reason: str
    scores: Mapping[int, float] = field(default_factory=dict)
