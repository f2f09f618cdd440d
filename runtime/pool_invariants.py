"""Consistency checks of a `BlockPool` (tests and debugging): free queue, reference counts
and the hash map agree. O(num_blocks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.block_pool import BlockPool


def check_pool_invariants(pool: BlockPool) -> None:
    """Raise AssertionError if the pool's bookkeeping is inconsistent."""
    null = pool.null_block
    assert null.block_id == 0 and null.prev is None and null.block_hash is None, null
    queued = list(pool.free_block_queue)
    assert len(queued) == pool.num_free_blocks, (len(queued), pool.num_free_blocks)
    queued_ids = {block.block_id for block in queued}
    assert len(queued_ids) == len(queued), "a block is queued twice"
    assert 0 not in queued_ids, "the null block is in the free queue"
    for block in pool.blocks[1:]:
        assert block.ref_cnt >= 0, block
        assert (block.ref_cnt == 0) == (block.block_id in queued_ids), block
        if block.block_hash is None:
            assert block.own_seq is None, block
            continue
        filed = (pool.cached_blocks.get(block.block_hash) is block
                 or pool._more_cached.get(block.block_hash, {}).get(block.block_id) is block)
        if block.own_seq is not None:  # an own name: cached without a map entry
            assert not filed, f"{block}: own name in the hash map"
        else:
            assert filed, f"{block} missing from the hash map"
    for block_hash, entry in pool._more_cached.items():
        assert entry and block_hash in pool.cached_blocks, "stray hash-map entry"
    for block_hash, ids in pool.cached_block_ids().items():
        for block_id in ids:
            block = pool.blocks[block_id]
            assert block.block_hash == block_hash, f"{block} filed under another hash"
        assert len(set(ids)) == len(ids), f"a block filed twice under {block_hash!r}"
    in_use = sum(1 for block in pool.blocks[1:] if block.ref_cnt > 0)
    assert in_use + pool.num_free_blocks == pool.num_blocks - 1
