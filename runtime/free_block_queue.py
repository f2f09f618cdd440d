"""Free KV blocks and the queue that orders them (head = next to allocate).

Never-used blocks are an id range in the queue, not objects: a pool is tens of thousands of
blocks, and a fleet simulator holds one per replica, most of whose blocks a replica that never
fills its pool never touches. They are consumed only from the front of their range, and only
once the linked blocks before them are, so a block object is made when a pop takes its id
(`FreeBlockQueue.take_made`, `popleft`), never linked; lookups and results are as if every
block were linked in. A released pool's block objects (`BlockPool.release_blocks`) may be made the
next never-used blocks of another pool (`FreeBlockQueue.reuse`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from types import FunctionType

from runtime.block_hash import BlockHash
from runtime.block_pieces import PieceEntry


class KVCacheBlock:
    """One block of `block_size` token slots. `prev`/`next` link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "own_seq", "piece", "j", "prev", "next")

    def __init__(self, block_id: int, ref_cnt: int = 0) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
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


# Pure Python, a `KVCacheBlock(...)` call is a Python frame for `__init__` (~0.7 k
# instructions of ~1.9 k a block); blocks made in bulk from the never-used range are made
# without it: `_BareBlock()` runs object's C `__init__`, and `make_blocks` sets every slot.
# Compiled (mypyc), the native constructor is a direct call, and an interpreted class cannot
# subclass the native one: there is no `_BareBlock`.
_BareBlock: Callable[[], KVCacheBlock] | None = type(
    "_BareBlock", (KVCacheBlock,), {"__slots__": (), "__init__": object.__init__}
) if isinstance(KVCacheBlock.__init__, FunctionType) else None  # pure: a Python frame


def make_blocks(block_ids: range, ref_cnt: int) -> list[KVCacheBlock]:
    """`[KVCacheBlock(block_id, ref_cnt) for block_id in block_ids]`: equal blocks (a
    `KVCacheBlock` each; pure Python, of a subclass that only skips `__init__`'s call)."""
    bare = _BareBlock
    if bare is None:
        return [KVCacheBlock(block_id, ref_cnt) for block_id in block_ids]
    blocks = []
    for block_id in block_ids:  # `KVCacheBlock.__init__`, inlined
        block = bare()
        block.block_id = block_id
        block.ref_cnt = ref_cnt
        block.block_hash = block.own_seq = block.piece = block.prev = block.next = None
        block.j = 0
        blocks.append(block)
    return blocks


class FreeBlockQueue:
    """Doubly linked list of free blocks; O(1) pop from the head, push at either end, and
    removal from the middle (a cache hit takes a free block out of the queue).

    Never-used blocks, the ids `unbuilt` in order, are not in the list: they follow its
    first `_ahead` entries (0 once none is left) and count as free. Invariant: those
    entries are unhashed (freed unhashed blocks go to the head, hashed ones to the tail),
    so `remove`, which takes out cached blocks only, never touches them. A block made from
    the range is appended to `built`, which so stays in id order.
    """

    num_free_blocks: int  # linked blocks and never-used ids
    _unbuilt: range  # the never-used ids, in pop order
    _ahead: int  # linked entries before the never-used ones (0 once none is left)
    _spares: list[KVCacheBlock]  # released blocks to make never-used ones of (`reuse`)

    def __init__(self, blocks: Iterable[KVCacheBlock] = (), unbuilt: range = range(0),
                 built: list[KVCacheBlock] | None = None) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: real blocks lie strictly between them
        self._tail = KVCacheBlock(-1)
        self._built = built if built is not None else []
        self.restart(unbuilt)
        self.append_n(blocks)
        if unbuilt:
            self._ahead = self.num_free_blocks - len(unbuilt)

    def restart(self, unbuilt: range, built: list[KVCacheBlock] | None = None) -> None:
        """Hold the never-used ids `unbuilt` only, forgetting every linked block (the
        caller released them: `BlockPool.release_blocks`) and any spares (`reuse` again to
        take some); `built`: the list to append made blocks to from now on."""
        if unbuilt.step != 1:
            raise ValueError(f"never-used block ids must be consecutive, got {unbuilt}")
        self._head.next, self._tail.prev = self._tail, self._head
        if built is not None:
            self._built = built
        self._spares = []
        self._unbuilt = unbuilt
        self._ahead = 0
        self.num_free_blocks = len(unbuilt)

    def reuse(self, spares: list[KVCacheBlock]) -> None:
        """Make never-used blocks of the blocks in `spares`, by id (`spares[i]` has id
        i + 1: a released pool's blocks, reset as a pop leaves them, in use,
        `BlockPool.release_blocks`), while it holds one of the id: taken as they are, not
        touched (1.64M blocks at 64 replicas on the Azure excerpt). The list is shared, not
        copied: one pool at a time makes blocks of it, and it gives them back as its own
        release (a fleet's replicas run one after another, `sim.fleet_replica.
        PreRoutedReplica`); two at once would share blocks, unnoticed. A spare keeps its
        id: no renaming (1.645M renames at 64 replicas, 0.89 G instructions)."""
        self._spares = spares

    def _make(self, count: int, ref_cnt: int = 0) -> list[KVCacheBlock]:
        """The next `count` never-used blocks, out of the range (the spare of the id, or
        new), each with `ref_cnt` references (1: popped, in use; set as it is made)."""
        if count == 1:  # a steady decode crossing a block boundary
            return [self._make_one(ref_cnt)]
        unbuilt = self._unbuilt
        ids, self._unbuilt = unbuilt[:count], unbuilt[count:]
        new = self._spares[ids.start - 1:ids.stop - 1]  # `reuse`: spares[i] has id i + 1
        if ref_cnt != 1:  # a released spare has one reference, as a pop leaves it
            for block in new:
                block.ref_cnt = ref_cnt
        if len(new) < count:
            new += make_blocks(ids[len(new):], ref_cnt)
        self._built += new
        return new

    def _make_one(self, ref_cnt: int = 0) -> KVCacheBlock:
        """`_make(1, ref_cnt)[0]` without the lists (a steady decode crossing a block
        boundary pops one block at a time: 1.0 -> 0.6 us a pop of a never-used block)."""
        unbuilt = self._unbuilt
        block_id = unbuilt.start  # a step-1 range (`restart`): cheaper than slicing it
        self._unbuilt = range(block_id + 1, unbuilt.stop)
        spares = self._spares
        if block_id <= len(spares):  # `reuse`: spares[i] has id i + 1, reset
            block = spares[block_id - 1]
            block.ref_cnt = ref_cnt
        else:
            block = KVCacheBlock(block_id, ref_cnt)
        self._built.append(block)
        return block

    def build_all(self) -> None:
        """Make every never-used block and link them in at their place (for walks)."""
        if not self._unbuilt:
            return
        prev = self._head
        for _ in range(self._ahead):
            assert prev.next is not None
            prev = prev.next
        following = prev.next
        assert following is not None
        for block in self._make(len(self._unbuilt)):
            block.prev, prev.next = prev, block
            prev = block
        prev.next, following.prev = following, prev
        self._ahead = 0

    def popleft(self) -> KVCacheBlock:
        """Pop the head block (ValueError when none is free)."""
        if self.num_free_blocks < 1:
            raise ValueError("no free block to pop")
        if self._unbuilt:
            if not self._ahead:
                self.num_free_blocks -= 1
                return self._make_one()
            self._ahead -= 1
        block = self._head.next
        assert block is not None
        self.remove(block)
        return block

    def popleft_n(self, count: int) -> list[KVCacheBlock]:
        """Pop `count` blocks from the head at once (the caller checked there are enough):
        linked ones unlinked (`ref_cnt` as they were: 0), never-used ones made in use
        (`ref_cnt` 1, `take_made`); the caller sets every block's count. Only a test's
        reference path pops so: `BlockPool` takes blocks through `take_made`."""
        before, made = self.take_made(count)
        blocks = self._unlink_n(before)
        if made:  # then the linked ones after the range
            blocks += made
            blocks += self._unlink_n(count - before - len(made))
        self.num_free_blocks -= count - len(made)
        return blocks

    def take_made(self, count: int) -> tuple[int, list[KVCacheBlock]]:
        """The never-used blocks a pop of `count` takes, made in use (`ref_cnt` 1) and
        counted out of the queue, and how many linked blocks it takes before them (all
        `count` when it takes none); the caller then takes the linked ones from the head
        (`BlockPool._take_linked`)."""
        ahead = self._ahead
        if not self._unbuilt:
            return count, []
        if count <= ahead:
            self._ahead = ahead - count
            return count, []
        self._ahead = 0
        wanted, left = count - ahead, len(self._unbuilt)
        made = self._make(wanted if wanted < left else left, 1)
        self.num_free_blocks -= len(made)
        return ahead, made

    def _unlink_n(self, count: int) -> list[KVCacheBlock]:
        """Unlink the first `count` linked blocks (the count is not updated)."""
        blocks = []
        head, tail = self._head, self._tail
        block = head.next
        for _ in range(count):
            assert block is not None and block is not tail, "free queue exhausted"
            blocks.append(block)
            following = block.next
            block.prev = block.next = None
            block = following
        assert block is not None
        head.next, block.prev = block, head
        return blocks

    def next_linked(self, count: int) -> Iterator[KVCacheBlock]:
        """The linked blocks among the next `count` pops, in pop order (the never-used
        ones between them are not objects yet, and carry no hash)."""
        if self._unbuilt:
            count -= min(max(count - self._ahead, 0), len(self._unbuilt))
        block = self._head.next
        for _ in range(count):
            assert block is not None and block is not self._tail, "free queue exhausted"
            yield block
            block = block.next

    def remove(self, block: KVCacheBlock) -> None:
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
        if self._unbuilt:
            self._ahead += len(blocks)
        for block in reversed(blocks):
            first = self._head.next
            assert first is not None
            block.prev, block.next = self._head, first
            first.prev = self._head.next = block
            self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """The free blocks' ids, head first (never-used ones not made)."""
        ids = []
        block = self._head.next
        for _ in range(self._ahead):  # the linked ones before the range
            assert block is not None
            ids.append(block.block_id)
            block = block.next
        ids += self._unbuilt
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next
        return ids

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Head first (every never-used block is made first)."""
        self.build_all()
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self)
