"""A block pool's KV events, as vLLM's BlockStored, BlockRemoved and AllBlocksCleared
(`runtime.kv_events` says when each is emitted). The pool records them only when it holds a
log (`BlockPool.kv_event_log`, set by `runtime.kv_events.observe_kv_events`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from runtime.block_hash import BlockHash
from runtime.free_block_queue import FreeBlockQueue, KVCacheBlock

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


def record_evictions(log: KvEventLog, queue: FreeBlockQueue, count: int) -> None:
    """The removed events of the cached blocks among the next `count` that `queue` hands
    out (never-used blocks carry no hash)."""
    append = log.events.append
    for block in queue.next_linked(count):
        if block.block_hash is not None:
            append(PoolEvent("removed", (block.block_hash,)))


def record_stored(log: KvEventLog, null_block: KVCacheBlock, blocks: Sequence[KVCacheBlock],
                  block_hashes: Sequence[BlockHash]) -> None:
    """One stored event for a registration call: the hashes of the blocks it newly
    registers (not yet hashed, not the null block), in order; none if there are none."""
    new = tuple(h for block, h in zip(blocks, block_hashes, strict=True)
                if block.block_hash is None and block is not null_block)
    if new:
        log.events.append(PoolEvent("stored", new))
