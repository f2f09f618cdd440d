"""KV-cache events of one engine's block pool: vLLM's BlockStored, BlockRemoved and
AllBlocksCleared (vllm `v1/core/block_pool.py` queues them, the engine core publishes the
batch after each step; routers with a precise prefix index consume them).

    log = observe_kv_events(scheduler.kv_cache_manager.block_pool)
    ... steps ...
    events = log.take()        # the pool's events since the last take, in order

Emitted as vLLM does:

    stored    one event per registration call (`cache_blocks`, `cache_full_block`; one per
              block of `cache_each`, which stands for that many `cache_full_block` calls) listing
              the hashes of the blocks it newly registers, in table order
    removed   one event per cached block evicted by an allocation, its hash
    cleared   `reset_prefix_cache` succeeded

Several blocks may hold one hash (the same prefix computed twice before either was cached);
each gets its own stored and removed event, so an index that counts references per hash
knows exactly which hashes the pool still holds.

Almost no cost when nobody listens: the pool's calls above test its `kv_event_log` once
each (as vLLM's pool tests its `enable_kv_cache_events`); observing gives that one pool a
log, and its state and results stay exactly those of an unobserved pool.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from runtime.block_hash import NONE_HASH, BlockHash, block_extra_keys, hash_block_tokens
from runtime.block_pool import BlockPool
from runtime.pool_events import KvEventLog, PoolEvent, PoolEventKind

__all__ = ["KvEventLog", "PoolEvent", "PoolEventKind", "observe_kv_events",
           "prompt_block_hashes"]


def observe_kv_events(pool: BlockPool) -> KvEventLog:
    """Start recording `pool`'s KV events (idempotent); returns its log."""
    if pool.kv_event_log is None:
        pool.kv_event_log = KvEventLog()
    return pool.kv_event_log


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None,
                        known: Sequence[BlockHash] = ()) -> tuple[BlockHash, ...]:
    """The engine's chained hashes of the prompt's full blocks (what `Request.block_hashes`
    holds once the scheduler has taken the request in, no LoRA): a router's key into a
    KV-event index. `known`: the leading blocks' given identities (`Request(block_hashes=)`),
    which the rest chain on from."""
    num_full = len(token_ids) // block_size
    if not num_full:
        return ()
    hashes = list(known)
    if not hashes:  # block 0 carries the salt's extra key; the rest hash as the fast path
        hashes.append(hash_block_tokens(NONE_HASH, token_ids[:block_size],
                                        block_extra_keys(0, None, None, cache_salt)))
    parent = hashes[-1]
    data = array("q", token_ids[len(hashes) * block_size : num_full * block_size]).tobytes()
    length_prefix = block_size.to_bytes(4, "little")
    block_bytes = 8 * block_size
    sha256 = hashlib.sha256
    for offset in range(0, len(data), block_bytes):
        parent = sha256(parent + length_prefix + data[offset : offset + block_bytes]).digest()
        hashes.append(parent)
    return tuple(hashes)
