"""The pool of KV blocks: free queue, reference counts, pops and frees, on the prefix
cache's map of names to cached blocks (`runtime.cached_blocks`).

Block 0 is the null block: taken at start-up, never freed, cached or counted. Every other block
is either in use (`ref_cnt > 0`, in one or more block tables) or free (`ref_cnt == 0`, in the
free queue). A free block may still carry a block hash: its KV stays reusable until the block
reaches the head of the free queue and an allocation pops it (lazy eviction).

Free-queue order (head = next to allocate): unhashed blocks freed most recently, then
never-used blocks in id order, then hashed blocks in LRU order.
Never-used blocks are an id range until popped (`runtime.free_block_queue`); a pool whose
work is done can hand its block objects to another (`release_blocks`, `reuse`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain, islice, repeat

from runtime.block_hash import BlockHash
from runtime.block_pieces import BlockPieces
from runtime.cached_blocks import CachedBlockMap
from runtime.free_block_queue import FreeBlockQueue, KVCacheBlock
from runtime.pool_events import PoolEvent, record_evictions
from runtime.pool_invariants import check_pool_invariants, own_cached, piece_heads

__all__ = ["BlockPool", "FreeBlockQueue", "KVCacheBlock"]


class BlockPool(CachedBlockMap):
    """Owns every block and the free queue; the map from names to cached blocks, and the
    registrations and evictions that change it, are `CachedBlockMap`'s (a pop evicts, so
    the pop's walks below update the map inline)."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        super().__init__(KVCacheBlock(0))  # the null block: never in the free queue
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._blocks = [self.null_block]  # by id, as far as built (see FreeBlockQueue)
        self.free_block_queue = FreeBlockQueue((), range(1, num_blocks), self._blocks)

    @property
    def blocks(self) -> list[KVCacheBlock]:
        """Every block by id (making the never-used ones not made yet)."""
        self.free_block_queue.build_all()
        return self._blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, counting cached blocks nobody references."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_in_use(self) -> int:
        """Blocks referenced by some request (the null block excluded)."""
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, 0..1 (the null block excluded)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def free_block_ids(self) -> list[int]:
        """Ids in the free queue, head (next to be allocated or evicted) first."""
        return self.free_block_queue.block_ids()

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block a lookup of `block_hash` hits (own names: a scan of every block)."""
        block = self.cached_blocks.get(block_hash)
        if block is None:
            block = piece_heads(self).get(block_hash)
        if block is None:
            own = own_cached(self).get(block_hash)
            block = own[0] if own else None
        return block

    def cached_block_ids(self) -> dict[BlockHash, list[int]]:
        """Every cached hash's block ids, in the order they were registered (a lookup hits
        the first)."""
        more = self._more_cached
        heads = {**self.cached_blocks, **piece_heads(self)}
        ids = {block_hash: [block.block_id, *more.get(block_hash, ())]
               for block_hash, block in heads.items()}
        for block_hash, blocks in own_cached(self).items():
            ids[block_hash] = [block.block_id for block in blocks]
        return ids

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the head of the free queue, evicting any cached hash they carry."""
        if self.kv_event_log is not None and num_blocks <= self.num_free_blocks:
            record_evictions(self.kv_event_log, self.free_block_queue, num_blocks)
        return self._pop(num_blocks, (), ())

    def extend_table(self, table: list[KVCacheBlock], num_blocks: int, start: int,
                     block_hashes: Sequence[BlockHash], own_from: int | None = None,
                     pieces: BlockPieces | None = None) -> list[KVCacheBlock]:
        """Append `num_blocks` new blocks to `table` (`get_new_blocks`), then register
        `table[start:start + len(block_hashes)]` under `block_hashes` (`cache_blocks`),
        those at table positions >= `own_from` as own names, those before
        `pieces.num_blocks` as piece names; returns the new blocks. A new block is popped
        and registered in one touch; the state is the two calls' (registering a block and
        evicting another commute). Observed: the two calls, for their events."""
        num_shared = len(block_hashes) if own_from is None else max(own_from - start, 0)
        if self.kv_event_log is not None:
            blocks = self.get_new_blocks(num_blocks)
            table += blocks
            self.cache_blocks(table[start:start + len(block_hashes)], block_hashes, num_shared,
                              pieces, start)
            return blocks
        num_old = max(len(table) - start, 0)  # registered first, in table order
        if num_old > 0:
            self._register(table[start:start + len(block_hashes)], block_hashes[:num_old],
                           num_shared, pieces, start)
        new_hashes = block_hashes[num_old:]
        first = len(table)  # the table position of the first new block
        skip = 0 if pieces is None else min(max(pieces.num_blocks - first, 0), len(new_hashes))
        split = max(num_shared - num_old, skip)
        blocks = self._pop(num_blocks, new_hashes[skip:split], new_hashes[split:], skip)
        if skip:
            assert pieces is not None
            self._register_pieces(blocks[:skip], new_hashes[:skip], pieces, first, fresh=True)
        table += blocks
        return blocks

    def _pop(self, num_blocks: int, shared: Sequence[BlockHash],
             own: Sequence[BlockHash], skip: int = 0) -> list[KVCacheBlock]:
        """`get_new_blocks`, the first `skip` blocks left to the caller (piece names),
        the next ones then registered under `shared`, then the next ones under `own` (own
        names); the shared ones as they are popped (a popped block carries no hash;
        registering one block and evicting another commute)."""
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        if not shared and not own:
            return self._pop_unnamed(num_blocks)
        before, made = queue.take_made(num_blocks)
        if not made and not shared and not skip:  # own names only (a plain trace's prompt)
            self._own_seq += 1
            return self._take_own(num_blocks, own, self._own_seq)
        names = chain(repeat(None, skip), shared, repeat(None, num_blocks - skip - len(shared)))
        if not made:  # linked blocks only (all of them once every block was used)
            blocks = self._take_linked(names)
        else:  # linked ones before the never-used ones, these, then linked ones after
            blocks = self._take_linked(islice(names, before)) if before else made
            if shared:  # else no name to register: skip the made ones (1.4M at 64 replicas)
                cached_blocks = self.cached_blocks
                for block, name in zip(made, names, strict=False):  # in use, no hash
                    if name is not None:  # `_register`, inlined
                        block.block_hash = name
                        if cached_blocks.setdefault(name, block) is not block:
                            self._more_cached.setdefault(name, {})[block.block_id] = block
            if before:
                blocks += made
            if len(blocks) < num_blocks:
                blocks += self._take_linked(names if shared
                                            else repeat(None, num_blocks - len(blocks)))
        if own:  # the popped blocks are at hand: a second pass costs ~20 ns a block
            self._own_seq += 1
            seq = self._own_seq
            for block, name in zip(islice(blocks, skip + len(shared), None), own,
                                   strict=False):
                block.block_hash = name
                block.own_seq = seq
        return blocks

    def _pop_unnamed(self, num_blocks: int) -> list[KVCacheBlock]:
        """`_pop` with no name to register (a decode's next block, `get_new_blocks`): the
        same blocks, without the names' iterators (~0.9 us a call of one block)."""
        before, made = self.free_block_queue.take_made(num_blocks)
        if not made:
            return self._take_own(num_blocks, (), 0)
        if not before:  # `made`, a list of its own: no copy
            blocks = made
        else:
            blocks = self._take_own(before, (), 0)
            blocks += made  # made in use
        if len(blocks) < num_blocks:
            blocks += self._take_own(num_blocks - len(blocks), (), 0)
        return blocks

    def _take_own(self, count: int, own: Sequence[BlockHash], seq: int) -> list[KVCacheBlock]:
        """`_take_linked` of `count` blocks without shared names, the first `len(own)`
        registered under the own names `own` (registration `seq`) in the same walk: a
        popped block's old own name is overwritten, not cleared first, and no second pass
        names them (a plain trace's prompts, a decode's next blocks). A block cached under a
        shared name is evicted inline as `_take_linked` does (a decode's next blocks on a
        hash-id trace pop such blocks: a call each cost 13% of
        Mooncake conversation's instructions, docs/results.md)."""
        queue = self.free_block_queue
        cached_blocks = self.cached_blocks
        more = self._more_cached
        pieces = self._pieces
        num_own = len(own)
        blocks = []
        head = queue._head
        block = head.next
        for index in range(count):
            assert block is not None
            blocks.append(block)
            following = block.next
            block.prev = block.next = None
            block_hash = block.block_hash
            if block_hash is not None:
                if block.own_seq is not None:  # no map entry
                    if index >= num_own:
                        block.own_seq = block.block_hash = None
                elif more and block_hash in more:
                    self._evict(block)
                elif (entry := block.piece) is not None:  # the only one at its piece's j
                    entry.blocks[block.j] = None
                    entry.held -= 1
                    if not entry.held:
                        del pieces[entry.base]
                    block.piece = None
                    block.block_hash = None
                else:  # the only block under its hash
                    del cached_blocks[block_hash]
                    block.block_hash = None
            block.ref_cnt = 1
            if index < num_own:
                block.block_hash = own[index]
                block.own_seq = seq
            block = following
        assert block is not None
        head.next, block.prev = block, head
        queue.num_free_blocks -= count
        return blocks

    def _take_linked(self, names: Iterable[BlockHash | None]) -> list[KVCacheBlock]:
        """Pop one linked block from the head of the free queue per name, evicting its hash
        and registering it under the name if not None (`popleft_n`, `_evict` and `_register`
        in one walk, inlined: a call per block costs ~60-100 ns, this being the prefill
        path)."""
        queue = self.free_block_queue
        cached_blocks = self.cached_blocks
        more = self._more_cached
        pieces = self._pieces
        blocks = []
        head = queue._head
        block = head.next
        for name in names:
            assert block is not None
            blocks.append(block)
            following = block.next
            block.prev = block.next = None
            block_hash = block.block_hash
            if block_hash is not None:
                if block.own_seq is not None:  # no map entry
                    block.own_seq = None
                    block.block_hash = None
                elif more and block_hash in more:
                    self._evict(block)
                elif (entry := block.piece) is not None:  # the only one at its piece's j
                    entry.blocks[block.j] = None
                    entry.held -= 1
                    if not entry.held:
                        del pieces[entry.base]
                    block.piece = None
                    block.block_hash = None
                else:  # the only block under its hash
                    del cached_blocks[block_hash]
                    block.block_hash = None
            block.ref_cnt = 1
            if name is not None:  # `_register`, inlined
                block.block_hash = name
                if cached_blocks.setdefault(name, block) is not block:
                    more.setdefault(name, {})[block.block_id] = block
            block = following
        assert block is not None
        head.next, block.prev = block, head
        queue.num_free_blocks -= len(blocks)
        return blocks

    def get_new_block(self) -> KVCacheBlock:
        """`get_new_blocks(1)[0]`, without the list."""
        queue = self.free_block_queue
        if queue.num_free_blocks < 1:
            raise ValueError("cannot get a free block from the pool")
        if self.kv_event_log is not None:
            record_evictions(self.kv_event_log, queue, 1)
        block = queue.popleft()
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a free hit leaves the free queue (never evicted)."""
        for block in blocks:
            if block.ref_cnt == 0 and block is not self.null_block:
                # a hit is cached: never one of the unhashed blocks before the never-used
                # range, which `remove` must not take (`FreeBlockQueue`)
                assert block.block_hash is not None, block
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue.

        Unhashed blocks go to the head (reused first), hashed blocks to the tail (evicted
        last), each group in the given order. Callers pass a block table reversed, so a
        request's longest-prefix block is the first of its blocks to be evicted.
        """
        unhashed: list[KVCacheBlock] = []
        queue = self.free_block_queue
        null_block = self.null_block
        # hashed blocks are linked in at the tail as they come (`append_n`, inlined)
        tail = queue._tail
        last = tail.prev
        assert last is not None
        num_hashed = 0
        for block in ordered_blocks:
            if block is null_block:
                continue
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            if ref_cnt == 0:
                if block.block_hash is None:
                    unhashed.append(block)
                else:
                    block.prev = last
                    last.next = block
                    last = block
                    num_hashed += 1
        if num_hashed:
            last.next, tail.prev = tail, last
            queue.num_free_blocks += num_hashed
        if unhashed:
            queue.prepend_n(unhashed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_in_use:
            return False
        self.cached_blocks.clear()
        self._more_cached.clear()
        self._pieces.clear()
        for block in self._blocks:  # never-used blocks carry no hash
            block.block_hash = None
            block.own_seq = None
            block.piece = None
        if self.kv_event_log is not None:
            self.kv_event_log.events.append(PoolEvent("cleared"))
        return True

    def release_blocks(self) -> list[KVCacheBlock]:
        """Hand over every block object this pool made (not the null block), reset as a
        pop leaves a never-used block (one reference: in use; unhashed, unlinked), for
        another pool to make never-used blocks of as they are (`reuse`: touched here, where
        they are in the cache, not again there). This pool is left as new: every block
        never used, nothing cached. ValueError while a block is in use. (No KV event: a
        released pool is observed no more.)"""
        if self.num_in_use:
            raise ValueError(f"cannot release a pool with {self.num_in_use} blocks in use")
        released = self._blocks  # the list itself, not a copy: the pool takes a new one
        self._blocks = [released[0]]
        del released[0]  # the null block stays
        self.free_block_queue.restart(range(1, self.num_blocks), self._blocks)
        for block in released:  # drops the queue's links: no cycle is left to collect
            block.ref_cnt = 1
            block.prev = block.next = None
            block.block_hash = block.own_seq = block.piece = None  # `j`: read with a piece
        self.cached_blocks.clear()
        self._more_cached.clear()
        self._pieces.clear()
        return released

    def reuse(self, spares: list[KVCacheBlock]) -> None:
        """Make never-used blocks of released blocks (`release_blocks`), `spares[i]` for id
        i + 1 while it holds one, instead of new objects (`FreeBlockQueue.reuse`: one pool
        at a time); ids, order and results are unchanged."""
        self.free_block_queue.reuse(spares)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent. O(num_blocks)."""
        check_pool_invariants(self)
