"""Consistency checks of a `BlockPool` (tests and debugging): free queue, reference counts
and the hash map agree. O(num_blocks). And the pool's slow views of the names it caches
outside its map (its lookups and `cached_block_ids`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.block_hash import BlockHash
    from runtime.block_pool import BlockPool
    from runtime.free_block_queue import KVCacheBlock


def check_pool_invariants(pool: BlockPool) -> None:
    """Raise AssertionError if the pool's bookkeeping is inconsistent."""
    null = pool.null_block
    assert null.block_id == 0 and null.prev is None and null.block_hash is None, null
    check_free_queue(pool)
    queued = pool.free_block_queue.block_ids()  # never-used blocks are not made for this
    assert len(queued) == pool.num_free_blocks, (len(queued), pool.num_free_blocks)
    queued_ids = set(queued)
    assert len(queued_ids) == len(queued), "a block is queued twice"
    assert 0 not in queued_ids, "the null block is in the free queue"
    for block in pool._blocks[1:]:  # the blocks made so far (the rest are never used)
        assert block.ref_cnt >= 0, block
        assert (block.ref_cnt == 0) == (block.block_id in queued_ids), block
        if block.block_hash is None:
            assert block.own_seq is None and block.piece is None, block
            continue
        entry = block.piece
        if entry is not None:  # a piece name: filed in its entry, not in the map
            assert pool._pieces.get(entry.base) is entry, f"{block}: stray piece entry"
            assert block.block_hash not in pool.cached_blocks, f"{block}: piece name in the map"
            head = entry.blocks[block.j] is block
        else:
            head = pool.cached_blocks.get(block.block_hash) is block
        filed = head or pool._more_cached.get(block.block_hash, {}).get(block.block_id) is block
        if block.own_seq is not None:  # an own name: cached without a map entry
            assert not filed, f"{block}: own name in the hash map"
        else:
            assert filed, f"{block} missing from the hash map"
    for base, entry in pool._pieces.items():
        held = [(j, block) for j, block in enumerate(entry.blocks) if block is not None]
        assert entry.base == base and entry.held == len(held) > 0, entry
        for j, block in held:
            assert block.piece is entry and block.j == j, (entry, j, block)
    cached = pool.cached_block_ids()
    for block_hash, more in pool._more_cached.items():
        assert more and len(cached.get(block_hash, ())) > 1, "stray hash-map entry"
    for block_hash, ids in cached.items():
        for block_id in ids:
            block = pool._blocks[block_id]
            assert block.block_hash == block_hash, f"{block} filed under another hash"
        assert len(set(ids)) == len(ids), f"a block filed twice under {block_hash!r}"
    in_use = sum(1 for block in pool._blocks[1:] if block.ref_cnt > 0)
    assert in_use + pool.num_free_blocks == pool.num_blocks - 1


def check_free_queue(pool: BlockPool) -> None:
    """The never-used range's own rules (`FreeBlockQueue`): the blocks made so far are the
    ids before it, in id order, and the linked entries ahead of it are unhashed."""
    queue = pool.free_block_queue
    made = pool._blocks
    assert all(block.block_id == i for i, block in enumerate(made)), "made blocks out of order"
    unbuilt = queue._unbuilt
    assert not unbuilt or unbuilt == range(len(made), pool.num_blocks), (unbuilt, len(made))
    assert unbuilt or not queue._ahead, f"{queue._ahead} entries ahead of no range"
    block = queue._head.next
    for _ in range(queue._ahead):
        assert block is not None and block is not queue._tail, "fewer entries than ahead"
        assert block.block_hash is None, f"{block} (hashed) ahead of the never-used range"
        block = block.next


def piece_heads(pool: BlockPool) -> dict[BlockHash, KVCacheBlock]:
    """Piece names' blocks a lookup hits, by name. O(cached pieces)."""
    return {block.block_hash: block for entry in pool._pieces.values()
            for block in entry.blocks if block is not None and block.block_hash is not None}


def own_cached(pool: BlockPool) -> dict[BlockHash, list[KVCacheBlock]]:
    """Own names' blocks, each name's in registration order. O(num_blocks)."""
    own = sorted((block for block in pool._blocks if block.own_seq is not None),
                 key=lambda block: block.own_seq or 0)
    by_name: dict[BlockHash, list[KVCacheBlock]] = {}
    for block in own:
        assert block.block_hash is not None
        by_name.setdefault(block.block_hash, []).append(block)
    return by_name
