"""The prefix cache's map from block names to cached blocks: registering full blocks and
evicting a reused one (vLLM's `BlockHashToBlockMap` and `cache_full_blocks`). `BlockPool`
adds the blocks themselves: the free queue, reference counts, pops and frees.

A block is cached while it carries a name (`block_hash`); it stays cached while free until a
pop reuses it (lazy eviction: `_evict`, or `BlockPool._take_linked` inlined). Several blocks
may be cached under one name (the same prefix computed twice before either was cached); a
lookup returns the first one registered that is still cached. It is the one in
`cached_blocks`; the later ones wait in `_more_cached` (rare), in registration order.

**Own names.** A block registered under a name only its own request can look up (the
simulator's `Request.block_key` names: `own=True` / `num_shared` below) is cached without an
entry in the map: it carries its name and `own_seq`, the order of its registration call, and
its request finds it in its own old block tables (`KVCacheManager`): a dict insert and delete
(~0.5 µs, cold) less per such block. Its queue order, eviction and KV events are those of
any cached block.

**Piece names** (`runtime.block_pieces`): a block registered under one is filed in its
piece's entry in `_pieces` (at j; a duplicate waits in `_more_cached` as any other), not in
`cached_blocks`; its request looks it up piece by piece (`piece_hits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from runtime.block_hash import BlockHash
from runtime.block_pieces import BlockPieces, PieceEntry, piece_hits, register_pieces
from runtime.free_block_queue import KVCacheBlock
from runtime.pool_events import KvEventLog, PoolEvent, record_stored


class CachedBlockMap:
    """Which cached block each name hits, and the registrations and evictions that change
    it (see the module docstring). The null block is never registered."""

    def __init__(self, null_block: KVCacheBlock) -> None:
        self.null_block = null_block
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}  # hash -> the block it hits
        self._more_cached: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self._pieces: dict[bytes, PieceEntry] = {}  # piece base -> its entry
        self._own_seq = 0  # own registration calls so far
        self.kv_event_log: KvEventLog | None = None  # set: KV events recorded (kv_events)

    def piece_hits(self, pieces: BlockPieces, stop: int) -> list[KVCacheBlock]:
        """The blocks a lookup of the request's first `stop` piece names hits, up to the
        first miss (`KVCacheManager.get_computed_blocks`)."""
        return piece_hits(self._pieces, pieces, stop)

    def cache_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                     num_shared: int | None = None, pieces: BlockPieces | None = None,
                     first: int = 0) -> None:
        """Register full blocks under their hashes, in order (see `cache_full_block`); the
        blocks from index `num_shared` on under own names (None: none); `blocks[0]` at
        table position `first`, those before `pieces.num_blocks` under piece names."""
        if self.kv_event_log is not None:
            record_stored(self.kv_event_log, self.null_block, blocks, block_hashes)
        self._register(blocks, block_hashes,
                       len(block_hashes) if num_shared is None else num_shared, pieces, first)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash,
                         own: bool = False) -> None:
        """Register a full block under its hash (`own`: an own name). A block is never
        re-hashed."""
        if block.block_hash is not None or block is self.null_block:
            return
        if self.kv_event_log is not None:
            self.kv_event_log.events.append(PoolEvent("stored", (block_hash,)))
        block.block_hash = block_hash
        if own:
            self._own_seq += 1
            block.own_seq = self._own_seq
        elif self.cached_blocks.setdefault(block_hash, block) is not block:
            self._more_cached.setdefault(block_hash, {})[block.block_id] = block

    def cache_each(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                   own: bool = False) -> None:
        """`cache_full_block(block, block_hash, own)` for each pair, in order: one
        registration per block (one KV event each when observed), in one call.
        Eager steady decodes filling a block each in a step register them so
        (`SteadyDecodes._fill_steps`)."""
        if self.kv_event_log is not None:
            for block, block_hash in zip(blocks, block_hashes, strict=True):
                self.cache_full_block(block, block_hash, own)
            return
        self._register(blocks, block_hashes, 0 if own else len(block_hashes))

    def _register(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                  num_shared: int, pieces: BlockPieces | None = None, first: int = 0) -> None:
        """`cache_full_block` for each pair in order, without KV events; the blocks from
        index `num_shared` on under own names, as one registration (one `own_seq`); those
        at table positions `first + i < pieces.num_blocks` under piece names."""
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks for {len(block_hashes)} hashes")
        if pieces is not None and first < pieces.num_blocks:
            num_pieces = min(pieces.num_blocks - first, len(blocks))
            self._register_pieces(blocks[:num_pieces], block_hashes[:num_pieces], pieces, first)
            if num_pieces == len(blocks):
                return
            blocks, block_hashes = blocks[num_pieces:], block_hashes[num_pieces:]
            num_shared = max(num_shared - num_pieces, 0)
        null_block = self.null_block
        if num_shared > 0:
            cached_blocks = self.cached_blocks
            for block, block_hash in zip(blocks, islice(block_hashes, num_shared), strict=False):
                if block.block_hash is not None or block is null_block:
                    continue
                block.block_hash = block_hash
                if cached_blocks.setdefault(block_hash, block) is not block:
                    self._more_cached.setdefault(block_hash, {})[block.block_id] = block
            if num_shared >= len(blocks):  # all shared (most calls but the own fills)
                return
            blocks, block_hashes = blocks[num_shared:], block_hashes[num_shared:]
        self._own_seq += 1
        seq = self._own_seq
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is None and block is not null_block:
                block.block_hash = block_hash
                block.own_seq = seq

    def _register_pieces(self, blocks: Sequence[KVCacheBlock],
                         block_hashes: Sequence[BlockHash], pieces: BlockPieces,
                         first: int, fresh: bool = False) -> None:
        """`_register` of blocks at table positions `first..` < `pieces.num_blocks`
        (`fresh`: just popped, none cached)."""
        register_pieces(self._pieces, self._more_cached, blocks, block_hashes, pieces, first,
                        self.null_block, fresh)

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a free block's hash from the prefix cache (the block is being reused)."""
        block_hash = block.block_hash
        assert block_hash is not None
        block.block_hash = None
        if block.own_seq is not None:  # no map entry
            block.own_seq = None
            return
        more = self._more_cached.get(block_hash)
        entry = block.piece
        if entry is not None:
            block.piece = None
            slots = entry.blocks
            if slots[block.j] is not block:
                assert more is not None
                del more[block.block_id]
            elif more is not None:  # the next one registered takes over
                slots[block.j] = more.pop(next(iter(more)))
            else:
                slots[block.j] = None
                entry.held -= 1
                if not entry.held:
                    del self._pieces[entry.base]
        elif self.cached_blocks[block_hash] is block:
            if more is None:
                del self.cached_blocks[block_hash]
            else:  # the next one registered takes over
                self.cached_blocks[block_hash] = more.pop(next(iter(more)))
        else:
            assert more is not None
            del more[block.block_id]
        if more is not None and not more:
            del self._more_cached[block_hash]
