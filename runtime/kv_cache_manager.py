"""Per-request block tables on top of the block pool: prefix lookup, allocation, freeing.

One full-attention KV group (vLLM's core case). A request's block table is append-only while
it holds blocks: block `i` holds the KV of tokens `[i * block_size, (i + 1) * block_size)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from runtime.block_hash import BlockHash
from runtime.block_pool import BlockPool, KVCacheBlock
from runtime.config import CacheConfig
from runtime.request import Request, RequestStatus


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _own_hits(tables: list[list[KVCacheBlock]], names: list[BlockHash], start: int,
              stop: int) -> list[KVCacheBlock]:
    """The hits of own names `names[start:stop]` (blocks `start..stop-1` of their request)
    up to the first miss. Name i hits, of the blocks at i in the request's old tables still
    cached under it, the first one registered (every block ever registered under it is at
    i in one of them)."""
    hits = []
    if len(tables) == 1:  # preempted once (most): its one candidate per name
        table = tables[0]
        for index in range(start, min(stop, len(names), len(table))):
            block = table[index]
            if block.own_seq is None or block.block_hash != names[index]:
                break
            hits.append(block)
        return hits
    for index in range(start, min(stop, len(names))):
        best = None
        for table in tables:
            if index < len(table):
                block = table[index]
                seq = block.own_seq
                if (seq is not None and block.block_hash == names[index]
                        and (best is None or seq < (best.own_seq or 0))):
                    best = block
        if best is None:
            break
        hits.append(best)
    return hits


class KVCacheManager:
    """Allocates KV blocks to requests and registers full blocks in the prefix cache."""

    def __init__(self, cache_config: CacheConfig, max_model_len: int, watermark: float) -> None:
        self.block_size = cache_config.block_size
        self.enable_caching = cache_config.enable_prefix_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(cache_config.num_blocks, self.enable_caching)
        # Blocks kept free when admitting a waiting request while others run.
        self.watermark_blocks = int(watermark * cache_config.num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each table already registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # The block tables a request held when it was preempted, oldest first: its blocks
        # registered under its own names (`Request.own_from`) are looked up there, not in
        # the pool's map (`BlockPool` docstring). Dropped when it finishes.
        self._own_tables: dict[str, list[list[KVCacheBlock]]] = {}

    @property
    def usage(self) -> float:
        """KV usage, 0..1; cached blocks nobody references count as free."""
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks, and its length in tokens.

        At most `num_tokens - 1` tokens can hit: the last token must run through the model to
        produce logits, so a block-aligned prompt recomputes its whole last block. No side
        effects: references are taken by `allocate_slots`.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        own_from = request.own_from
        num_shared = max_hit_blocks if own_from is None else min(own_from, max_hit_blocks)
        pieces = request.block_pieces
        hits: list[KVCacheBlock] = []
        start = 0
        if pieces is not None:  # piece names: looked up piece by piece
            start = min(pieces.num_blocks, num_shared)
            hits = self.block_pool.piece_hits(pieces, start)
            if len(hits) < start:
                return hits, len(hits) * self.block_size
        lookup = self.block_pool.cached_blocks.get  # `BlockPool.get_cached_block`, inlined
        for block_hash in islice(request.block_hashes, start, num_shared):
            block = lookup(block_hash)
            if block is None:  # chained hashes: every later block misses too
                return hits, len(hits) * self.block_size
            hits.append(block)
        tables = self._own_tables.get(request.request_id)
        if tables is not None:
            hits += _own_hits(tables, request.block_hashes, num_shared, max_hit_blocks)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus the cache
        hits `new_computed_blocks`, covering `num_new_computed_tokens` tokens).

        Returns the newly popped blocks, or None when they do not fit; then nothing changed.
        """
        table = self.req_to_blocks.get(request.request_id)
        if table is not None and not new_computed_blocks and not full_sequence_must_fit:
            # Fast path, most decodes: the slots are already allocated.
            num_slots = request.num_computed_tokens + num_new_tokens
            if num_slots <= len(table) * self.block_size:
                if (self.enable_caching and num_slots // self.block_size
                        > self.num_cached_block.get(request.request_id, 0)):
                    self.cache_full_blocks(request, table, min(num_slots, request.num_tokens))
                return []
        if table is None:
            table = []
        fit = self._blocks_needed(request, num_new_tokens, num_new_computed_tokens,
                                  new_computed_blocks, len(table), full_sequence_must_fit,
                                  has_scheduled_reqs)
        if fit is None:
            return None
        self.req_to_blocks.setdefault(request.request_id, table)
        return self._grow(request, table, new_computed_blocks, *fit)

    def _blocks_needed(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int, new_computed_blocks: Sequence[KVCacheBlock],
                       num_in_table: int, full_sequence_must_fit: bool,
                       has_scheduled_reqs: bool) -> tuple[int, int] | None:
        """(blocks to pop, slots the table must cover), or None when they do not fit.
        Free cache hits count against the free blocks, since touching consumes them."""
        num_held = num_in_table + len(new_computed_blocks)
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        free = self.block_pool.num_free_blocks
        if has_scheduled_reqs and request.status != RequestStatus.RUNNING:
            free -= self.watermark_blocks
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if max(cdiv(full, self.block_size) - num_held, 0) + num_free_hits > free:
                return None
        total_computed = min(request.num_computed_tokens + num_new_computed_tokens,
                             self.max_model_len)
        num_slots = min(total_computed + num_new_tokens, self.max_model_len)
        num_needed = cdiv(num_slots, self.block_size) - num_held
        if max(num_needed, 0) + num_free_hits > free:
            return None
        return num_needed, num_slots

    def _grow(self, request: Request, table: list[KVCacheBlock],
              new_computed_blocks: Sequence[KVCacheBlock], num_needed: int,
              num_slots: int) -> list[KVCacheBlock]:
        """Touch the cache hits onto `table`, then pop `num_needed` blocks (<= 0: none) and
        cache the full ones; returns the popped blocks."""
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            table.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(table)
        if num_needed <= 0:
            if self.enable_caching:
                self.cache_full_blocks(request, table, min(num_slots, request.num_tokens))
            return []
        if not self.enable_caching:
            new_blocks = self.block_pool.get_new_blocks(num_needed)
            table.extend(new_blocks)
            return new_blocks
        # `get_new_blocks` + `cache_full_blocks` in one walk (`BlockPool.extend_table`)
        start = self.num_cached_block.get(request.request_id, 0)
        num_full = min(min(num_slots, request.num_tokens) // self.block_size,
                       len(request.block_hashes))
        block_hashes = request.block_hashes[start:num_full] if num_full > start else []
        new_blocks = self.block_pool.extend_table(table, num_needed, start, block_hashes,
                                                  request.own_from, request.block_pieces)
        if num_full > start:
            self.num_cached_block[request.request_id] = num_full
        return new_blocks

    def allocate_decode_slots(
        self, requests: Sequence[Request]
    ) -> list[list[KVCacheBlock]] | None:
        """`allocate_slots(request, 1)` for each request in order, each a running request
        with one token left to compute (a decode): the same block pops and registrations,
        in bulk. Returns each request's new blocks, or None when the free blocks do not
        cover them all; then nothing changed (stepping one by one would preempt)."""
        block_size = self.block_size
        tables = [self.req_to_blocks[request.request_id] for request in requests]
        # A decode takes a new block iff its token's slot lies past the end of its table.
        needs_block = [request.num_computed_tokens >= len(table) * block_size
                       for request, table in zip(requests, tables, strict=True)]
        if sum(needs_block) > self.block_pool.num_free_blocks:
            return None
        num_cached_block = self.num_cached_block
        all_new: list[list[KVCacheBlock]] = []
        for request, table, needs in zip(requests, tables, needs_block, strict=True):
            new_blocks = self.block_pool.get_new_blocks(1) if needs else []
            table += new_blocks
            all_new.append(new_blocks)
            num_slots = request.num_computed_tokens + 1
            if (self.enable_caching and num_slots // block_size
                    > num_cached_block.get(request.request_id, 0)):
                self.cache_full_blocks(request, table, min(num_slots, request.num_tokens))
        return all_new

    def cache_full_blocks(
        self, request: Request, table: list[KVCacheBlock], num_tokens: int
    ) -> None:
        """Register the blocks that `num_tokens` computed tokens fill, before the model runs,
        so a request admitted later in the same step can already hit them."""
        block_hashes = request.block_hashes
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        req_id = request.request_id
        start = self.num_cached_block.get(req_id, 0)
        if num_full <= start:
            return
        own_from = request.own_from
        pieces = request.block_pieces
        if num_full == start + 1 and (pieces is None or start >= pieces.num_blocks):
            # the usual case: a decode filled one block
            self.block_pool.cache_full_block(table[start], block_hashes[start],
                                             own_from is not None and start >= own_from)
        else:
            self.block_pool.cache_blocks(table[start:num_full], block_hashes[start:num_full],
                                         None if own_from is None else own_from - start,
                                         pieces, start)
        self.num_cached_block[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (see `BlockPool.free_blocks`); keep
        the table of a request with own names that is not finished (preempted) to look
        them up in."""
        table = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(table))
        if request.is_finished():
            self._own_tables.pop(request.request_id, None)
        elif request.own_from is not None and table:
            self._own_tables.setdefault(request.request_id, []).append(table)

    def reset_prefix_cache(self) -> bool:
        done = self.block_pool.reset_prefix_cache()
        if done:
            self._own_tables.clear()
        return done

    def release_blocks(self) -> list[KVCacheBlock]:
        """`BlockPool.release_blocks` (ValueError while a block is in use), the old tables
        of preempted requests dropped with them: the manager is left as new."""
        released = self.block_pool.release_blocks()
        self._own_tables.clear()
        return released

    def check_invariants(self) -> None:
        """Pool invariants, plus: every reference count equals the tables holding the block."""
        self.block_pool.check_invariants()
        holders = [0] * self.block_pool.num_blocks
        for req_id, table in self.req_to_blocks.items():
            assert len({b.block_id for b in table}) == len(table), f"{req_id}: duplicate block"
            assert self.num_cached_block.get(req_id, 0) <= len(table), req_id
            for block in table:
                holders[block.block_id] += 1
        for block in self.block_pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
