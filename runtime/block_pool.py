"""The pool of KV blocks: free queue, reference counts and the prefix-cache hash map.

Block 0 is the null block: taken at start-up, never freed, cached or counted. Every other block
is either in use (`ref_cnt > 0`, in one or more block tables) or free (`ref_cnt == 0`, in the
free queue). A free block may still carry a block hash: its KV stays reusable until the block
reaches the head of the free queue and an allocation pops it (lazy eviction).

Free-queue order (head = next to allocate): unhashed blocks freed most recently, then
never-used blocks in id order, then hashed blocks in LRU order.

Never-used blocks are built lazily (a pool is tens of thousands of blocks, ~18 ms to build,
and a fleet simulator builds one per replica): they are consumed only from the front of
their run, and only once the blocks before them are, so the queue builds them in chunks as
allocations reach them (`FreeBlockQueue.ensure`); lookups and results are as if built.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, repeat

from runtime.block_hash import BlockHash
from runtime.pool_invariants import check_pool_invariants


class KVCacheBlock:
    """One block of `block_size` token slots. `prev`/`next` link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while registered in the prefix cache
        self.prev: KVCacheBlock | None = None
        self.next: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = ", cached" if self.block_hash is not None else ""
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


_BUILD_CHUNK = 256  # never-used blocks built at once


class FreeBlockQueue:
    """Doubly linked list of free blocks; O(1) pop from the head, push at either end, and
    removal from the middle (a cache hit takes a free block out of the queue).

    With `unbuilt` ids, never-used blocks not built yet follow the first `_ahead` linked
    entries (the last of which is `_before_unbuilt`, the head sentinel when none), in id
    order; they count as free. Invariant: the entries before them are unhashed (freed
    unhashed blocks go to the head, hashed ones to the tail), so `remove`, which takes out
    cached blocks only, never touches them. Built blocks are appended to `built`.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock], unbuilt: range = range(0),
                 built: list[KVCacheBlock] | None = None) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: real blocks lie strictly between them
        self._tail = KVCacheBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free_blocks = 0
        self.append_n(blocks)
        self._unbuilt = unbuilt
        self._built = built if built is not None else []
        self._ahead = self.num_free_blocks
        self._before_unbuilt = self._tail.prev
        self.num_free_blocks += len(unbuilt)

    def ensure(self, count: int) -> None:
        """Build never-used blocks until the first `count` entries are linked."""
        if count > self._ahead and self._unbuilt:
            self._build(count - self._ahead)

    def _build(self, count: int) -> None:
        unbuilt = self._unbuilt
        take = min(len(unbuilt), max(count, _BUILD_CHUNK))
        ids, self._unbuilt = unbuilt[:take], unbuilt[take:]
        new = [KVCacheBlock(block_id) for block_id in ids]
        self._built.extend(new)
        prev = self._before_unbuilt
        following = prev.next
        assert following is not None
        for block in new:
            block.prev, prev.next = prev, block
            prev = block
        prev.next, following.prev = following, prev
        self._before_unbuilt = prev
        self._ahead += take

    def build_all(self) -> None:
        if self._unbuilt:
            self._build(len(self._unbuilt))

    def _taken(self, count: int) -> None:
        """`count` entries were popped from the head (after `ensure(count)`)."""
        if self._unbuilt:
            self._ahead -= count
            if not self._ahead:
                self._before_unbuilt = self._head

    def popleft(self) -> KVCacheBlock:
        self.ensure(1)
        block = self._head.next
        if block is self._tail or block is None:
            raise ValueError("no free block to pop")
        self.remove(block)
        self._taken(1)
        return block

    def popleft_n(self, count: int) -> list[KVCacheBlock]:
        """Pop `count` blocks from the head at once (the caller checked there are enough)."""
        self.ensure(count)
        self._taken(count)
        blocks = []
        block = self._head.next
        for _ in range(count):
            assert block is not None and block is not self._tail, "free queue exhausted"
            blocks.append(block)
            following = block.next
            block.prev = block.next = None
            block = following
        assert block is not None
        self._head.next, block.prev = block, self._head
        self.num_free_blocks -= count
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        assert block is not self._before_unbuilt or not self._unbuilt, "removing before unbuilt"
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Push blocks at the tail, in the given order."""
        for block in blocks:
            last = self._tail.prev
            assert last is not None
            block.prev, block.next = last, self._tail
            last.next = self._tail.prev = block
            self.num_free_blocks += 1

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Push blocks at the head so that `blocks[0]` becomes the new head."""
        if self._unbuilt and blocks:
            if not self._ahead:
                self._before_unbuilt = blocks[-1]
            self._ahead += len(blocks)
        for block in reversed(blocks):
            first = self._head.next
            assert first is not None
            block.prev, block.next = self._head, first
            first.prev = self._head.next = block
            self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head first; never-used blocks are built when the walk reaches them."""
        if not self._ahead:
            self.build_all()
        seen = 0
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            seen += 1
            if seen == self._ahead:
                self.build_all()
            block = block.next

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self)


class BlockPool:
    """Owns every block, the free queue and the map from block hash to cached blocks.

    Several blocks may be cached under one hash (the same prefix computed twice before either
    was cached); a lookup returns the first one inserted that is still cached. It is the one
    in `cached_blocks`; the later ones wait in `_more_cached` (rare), in insertion order.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.null_block = KVCacheBlock(0)  # never in the free queue
        self._blocks = [self.null_block]  # by id, as far as built (see FreeBlockQueue)
        self.free_block_queue = FreeBlockQueue((), range(1, num_blocks), self._blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}  # hash -> the block it hits
        self._more_cached: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    @property
    def blocks(self) -> list[KVCacheBlock]:
        """Every block by id (building the never-used ones not built yet)."""
        self.free_block_queue.build_all()
        return self._blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, counting cached blocks nobody references."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, 0..1 (the null block excluded)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def free_block_ids(self) -> list[int]:
        """Ids in the free queue, head (next to be allocated or evicted) first."""
        return [block.block_id for block in self.free_block_queue]

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cached_block_ids(self) -> dict[BlockHash, list[int]]:
        """Every cached hash's block ids, in the order they were registered (a lookup hits
        the first)."""
        more = self._more_cached
        return {block_hash: [block.block_id, *more.get(block_hash, ())]
                for block_hash, block in self.cached_blocks.items()}

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the head of the free queue, evicting any cached hash they carry."""
        return self._pop(num_blocks, ())

    def extend_table(self, table: list[KVCacheBlock], num_blocks: int, start: int,
                     block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """Append `num_blocks` new blocks to `table` (`get_new_blocks`), then register
        `table[start:start + len(block_hashes)]` under `block_hashes` (`cache_blocks`);
        returns the new blocks. A new block is popped and registered in one touch; the
        state is the two calls' (registering a block and evicting another commute)."""
        num_old = len(table) - start  # registered first, in table order
        if num_old > 0:
            self._register(table[start:start + len(block_hashes)], block_hashes[:num_old])
        blocks = self._pop(num_blocks, block_hashes[max(num_old, 0):])
        table += blocks
        return blocks

    def _pop(self, num_blocks: int, block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """`get_new_blocks`, the first `len(block_hashes)` blocks then registered under them
        in the same walk (a popped block carries no hash)."""
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        # `popleft_n`, `_evict` and `_register` in one walk (evicting does not touch the
        # queue), inlined: a call per block costs ~60-100 ns, this being the prefill path
        queue.ensure(num_blocks)
        queue._taken(num_blocks)
        cached_blocks = self.cached_blocks
        more = self._more_cached
        blocks = []
        head = queue._head
        block = head.next
        for name in chain(block_hashes, repeat(None, num_blocks - len(block_hashes))):
            assert block is not None
            blocks.append(block)
            following = block.next
            block.prev = block.next = None
            block_hash = block.block_hash
            if block_hash is not None:
                if more and block_hash in more:
                    self._evict(block)
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
        queue.num_free_blocks -= num_blocks
        return blocks

    def get_new_block(self) -> KVCacheBlock:
        """`get_new_blocks(1)[0]`, without the list."""
        queue = self.free_block_queue
        if queue.num_free_blocks < 1:
            raise ValueError("cannot get a free block from the pool")
        queue.ensure(1)
        queue._taken(1)
        head = queue._head
        block = head.next
        assert block is not None
        following = block.next
        assert following is not None
        head.next, following.prev = following, head
        block.prev = block.next = None
        queue.num_free_blocks -= 1
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a free hit leaves the free queue (never evicted)."""
        for block in blocks:
            if block.ref_cnt == 0 and block is not self.null_block:
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

    def cache_blocks(self, blocks: Iterable[KVCacheBlock],
                     block_hashes: Iterable[BlockHash]) -> None:
        """Register full blocks under their hashes, in order (see `cache_full_block`)."""
        self._register(blocks, block_hashes)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash. A block is never re-hashed."""
        if block.block_hash is not None or block is self.null_block:
            return
        block.block_hash = block_hash
        if self.cached_blocks.setdefault(block_hash, block) is not block:
            self._more_cached.setdefault(block_hash, {})[block.block_id] = block

    def cache_each(self, blocks: Sequence[KVCacheBlock],
                   block_hashes: Sequence[BlockHash]) -> None:
        """`cache_full_block(block, block_hash)` for each pair, in order: one registration
        per block (one KV event each, `ObservedBlockPool`), in one call. Steady decodes
        filling a block each in a step register them so (`SteadyDecodes._fill`)."""
        self._register(blocks, block_hashes)

    def _register(self, blocks: Iterable[KVCacheBlock],
                  block_hashes: Iterable[BlockHash]) -> None:
        """`cache_full_block` for each pair in order, without KV events."""
        cached_blocks = self.cached_blocks
        null_block = self.null_block
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None or block is null_block:
                continue
            block.block_hash = block_hash
            if cached_blocks.setdefault(block_hash, block) is not block:
                self._more_cached.setdefault(block_hash, {})[block.block_id] = block

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a free block's hash from the prefix cache (the block is being reused)."""
        block_hash = block.block_hash
        assert block_hash is not None
        more = self._more_cached.get(block_hash)
        if self.cached_blocks[block_hash] is block:
            if more is None:
                del self.cached_blocks[block_hash]
            else:  # the next one registered takes over
                self.cached_blocks[block_hash] = more.pop(next(iter(more)))
        else:
            assert more is not None
            del more[block.block_id]
        if more is not None and not more:
            del self._more_cached[block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached_blocks.clear()
        self._more_cached.clear()
        for block in self._blocks:  # never-used blocks carry no hash
            block.block_hash = None
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent. O(num_blocks)."""
        check_pool_invariants(self)
