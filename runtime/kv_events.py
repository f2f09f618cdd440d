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

Zero cost when nobody listens: `BlockPool` itself is untouched; observing switches that one
pool's class to `ObservedBlockPool`, whose overrides record and then call the base methods.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from runtime.block_hash import NONE_HASH, BlockHash, block_extra_keys, hash_block_tokens
from runtime.block_pieces import BlockPieces
from runtime.block_pool import BlockPool, KVCacheBlock

PoolEventKind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True, slots=True)
class PoolEvent:
    """One event of a pool: its kind and the block hashes concerned (none for "cleared")."""

    kind: PoolEventKind
    block_hashes: tuple[BlockHash, ...] = ()


@dataclass(slots=True)
class KvEventLog:
    """The events a pool emitted since the last `take`, oldest first."""

    events: list[PoolEvent] = field(default_factory=list)

    def take(self) -> list[PoolEvent]:
        events, self.events = self.events, []
        return events

    def __len__(self) -> int:
        return len(self.events)


class ObservedBlockPool(BlockPool):
    """A `BlockPool` that records its KV events into `kv_event_log` (see the module
    docstring); its state and results are exactly the base class's."""

    kv_event_log: KvEventLog

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks <= self.free_block_queue.num_free_blocks:
            self._record_evictions(num_blocks)
        return super().get_new_blocks(num_blocks)

    def get_new_block(self) -> KVCacheBlock:
        if self.free_block_queue.num_free_blocks:
            self._record_evictions(1)
        return super().get_new_block()

    def extend_table(self, table: list[KVCacheBlock], num_blocks: int, start: int,
                     block_hashes: Sequence[BlockHash], own_from: int | None = None,
                     pieces: BlockPieces | None = None) -> list[KVCacheBlock]:
        """The two calls it stands for, one after the other: the evictions' events, then
        one stored event for the registration."""
        blocks = self.get_new_blocks(num_blocks)
        table += blocks
        self.cache_blocks(table[start:start + len(block_hashes)], block_hashes,
                          None if own_from is None else max(own_from - start, 0), pieces, start)
        return blocks

    def _record_evictions(self, count: int) -> None:
        """The cached blocks among the next `count` the queue hands out (a walk from its
        head; never-used blocks, built first if need be, carry no hash)."""
        queue = self.free_block_queue
        queue.ensure(count)
        append = self.kv_event_log.events.append
        block = queue._head.next
        for _ in range(count):
            assert block is not None
            if block.block_hash is not None:
                append(PoolEvent("removed", (block.block_hash,)))
            block = block.next

    def cache_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                     num_shared: int | None = None, pieces: BlockPieces | None = None,
                     first: int = 0) -> None:
        self._record_stored(blocks, block_hashes)
        super().cache_blocks(blocks, block_hashes, num_shared, pieces, first)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash,
                         own: bool = False) -> None:
        self._record_stored((block,), (block_hash,))
        super().cache_full_block(block, block_hash, own)

    def cache_each(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                   own: bool = False) -> None:
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            self.cache_full_block(block, block_hash, own)  # one event per block, in order

    def _record_stored(self, blocks: Sequence[KVCacheBlock],
                       block_hashes: Sequence[BlockHash]) -> None:
        null = self.null_block
        new = tuple(h for block, h in zip(blocks, block_hashes, strict=True)
                    if block.block_hash is None and block is not null)
        if new:
            self.kv_event_log.events.append(PoolEvent("stored", new))

    def reset_prefix_cache(self) -> bool:
        done = super().reset_prefix_cache()
        if done:
            self.kv_event_log.events.append(PoolEvent("cleared"))
        return done


def observe_kv_events(pool: BlockPool) -> KvEventLog:
    """Start recording `pool`'s KV events (idempotent); returns its log."""
    if not isinstance(pool, ObservedBlockPool):
        pool.__class__ = ObservedBlockPool
        pool.kv_event_log = KvEventLog()  # type: ignore[attr-defined]
    assert isinstance(pool, ObservedBlockPool)
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
