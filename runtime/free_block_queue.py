"""Free KV blocks and the queue that orders them (head = next to allocate).

Never-used blocks are built lazily (a pool is tens of thousands of blocks, ~18 ms to build,
and a fleet simulator builds one per replica): they are consumed only from the front of
their run, and only once the blocks before them are, so the queue builds them in chunks as
allocations reach them (`FreeBlockQueue.ensure`); lookups and results are as if built.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from runtime.block_hash import BlockHash
from runtime.block_pieces import PieceEntry


class KVCacheBlock:
    """One block of `block_size` token slots. `prev`/`next` link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "own_seq", "piece", "j", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while registered in the prefix cache
        # Set while registered under its request's own name (`BlockPool` docstring): the
        # registration's order among the pool's own registrations, for duplicate names.
        self.own_seq: int | None = None
        # Set while registered under a piece name (`runtime.block_pieces`): its piece's
        # entry, where it sits at `j` or waits as a duplicate.
        self.piece: PieceEntry | None = None
        self.j = 0
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
