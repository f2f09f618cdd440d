"""BlockPool and FreeBlockQueue: null block, free order, touch, lazy eviction, invariants."""

from __future__ import annotations

import pytest

from runtime import BlockPool
from runtime.block_hash import NONE_HASH, hash_block_tokens


def h(*tokens: int) -> bytes:
    return hash_block_tokens(NONE_HASH, list(tokens))


def ids(blocks: list) -> list[int]:  # type: ignore[type-arg]
    return [b.block_id for b in blocks]


def test_block_zero_is_the_null_block_and_never_free() -> None:
    pool = BlockPool(6, enable_caching=True)
    assert pool.null_block.block_id == 0
    assert pool.free_block_ids() == [1, 2, 3, 4, 5]
    assert ids(pool.get_new_blocks(2)) == [1, 2]
    pool.free_blocks([pool.null_block])  # ignored
    assert pool.free_block_ids() == [3, 4, 5]
    pool.check_invariants()


def test_cannot_pop_more_blocks_than_free() -> None:
    pool = BlockPool(4, enable_caching=False)
    with pytest.raises(ValueError, match="cannot get 4 free blocks"):
        pool.get_new_blocks(4)
    assert pool.free_block_ids() == [1, 2, 3]


def test_free_puts_unhashed_at_head_and_hashed_at_tail_in_given_order() -> None:
    pool = BlockPool(8, enable_caching=True)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    pool.cache_full_block(b1, h(1))
    pool.cache_full_block(b2, h(2))
    # A table [1, 2, 3, 4] freed reversed: unhashed [4, 3] to the head, hashed [2, 1] last.
    pool.free_blocks([b4, b3, b2, b1])
    assert pool.free_block_ids() == [4, 3, 5, 6, 7, 2, 1]
    pool.check_invariants()


def test_shared_blocks_stay_out_of_the_queue_until_the_last_reference() -> None:
    pool = BlockPool(5, enable_caching=True)
    (b1,) = pool.get_new_blocks(1)
    pool.touch([b1])
    assert b1.ref_cnt == 2
    pool.free_blocks([b1])
    assert pool.free_block_ids() == [2, 3, 4]
    pool.free_blocks([b1])
    assert pool.free_block_ids() == [1, 2, 3, 4]
    pool.check_invariants()


def test_touching_a_free_cached_block_takes_it_out_of_the_middle_of_the_queue() -> None:
    pool = BlockPool(6, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_block(b1, h(1))
    pool.free_blocks([b2, b1])
    assert pool.free_block_ids() == [2, 3, 4, 5, 1]
    hit = pool.get_cached_block(h(1))
    assert hit is b1
    pool.touch([b1])
    assert b1.ref_cnt == 1 and pool.free_block_ids() == [2, 3, 4, 5]
    pool.check_invariants()


def test_popping_a_cached_block_evicts_only_its_own_hash_entry() -> None:
    pool = BlockPool(5, enable_caching=True)
    b1, b2, b3 = pool.get_new_blocks(3)
    pool.cache_full_block(b1, h(7))
    pool.cache_full_block(b2, h(7))  # the same block content computed twice: both registered
    pool.cache_full_block(b3, h(8))
    assert pool.get_cached_block(h(7)) is b1  # the first inserted wins
    pool.free_blocks([b1])
    pool.free_blocks([b2])
    assert pool.free_block_ids() == [4, 1, 2]
    assert ids(pool.get_new_blocks(2)) == [4, 1]  # block 1 is evicted on the way out
    assert b1.block_hash is None
    assert pool.get_cached_block(h(7)) is b2
    pool.check_invariants()


def test_a_block_is_never_rehashed() -> None:
    pool = BlockPool(3, enable_caching=True)
    (b1,) = pool.get_new_blocks(1)
    pool.cache_full_block(b1, h(1))
    pool.cache_full_block(b1, h(2))
    assert b1.block_hash == h(1) and pool.get_cached_block(h(2)) is None


def test_reset_prefix_cache_needs_every_block_free() -> None:
    pool = BlockPool(4, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_block(b1, h(1))
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(1)) is b1
    pool.free_blocks([b2, b1])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h(1)) is None and b1.block_hash is None
    pool.check_invariants()


def test_usage_excludes_the_null_block_and_counts_cached_free_blocks_as_free() -> None:
    pool = BlockPool(5, enable_caching=True)
    b1, b2, b3 = pool.get_new_blocks(3)
    assert pool.usage == pytest.approx(0.75)
    pool.cache_full_block(b1, h(1))
    pool.free_blocks([b1])
    assert pool.usage == pytest.approx(0.5)


def test_check_invariants_detects_corruption() -> None:
    pool = BlockPool(4, enable_caching=True)
    (b1,) = pool.get_new_blocks(1)
    b1.ref_cnt = 0  # in use but not in the free queue
    with pytest.raises(AssertionError):
        pool.check_invariants()
    b1.ref_cnt = 1
    b1.block_hash = h(3)  # hash not in the map
    with pytest.raises(AssertionError):
        pool.check_invariants()
