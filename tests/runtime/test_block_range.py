"""Never-used blocks as an id range of the free queue: a block object is made only when a pop
takes its id, pops across the range take vLLM's order exactly (linked blocks before it, its
ids, then the hashed ones after it, evicting in LRU order), and a released pool's blocks
become another pool's never-used blocks with the same ids and results."""

from __future__ import annotations

import pytest

from runtime.block_pool import BlockPool, KVCacheBlock
from runtime.config import CacheConfig
from runtime.kv_cache_manager import KVCacheManager
from runtime.kv_events import PoolEvent, observe_kv_events


def h(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def _queue_around_the_range(pool: BlockPool) -> list[KVCacheBlock]:
    """Pops 1-4, caches 1 and 2 ("a", "b"), frees them all: queue 4, 3 (unhashed, at the
    head), the never-used 5..9, then 2, 1 (hashed, LRU at the tail)."""
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    pool.cache_blocks([b1, b2], [h("a"), h("b")])
    pool.free_blocks([b4, b3, b2, b1])
    return [b1, b2, b3, b4]


def test_pops_across_the_range_take_vllms_order_and_evict_in_lru_order() -> None:
    pool = BlockPool(10, enable_caching=True)
    _queue_around_the_range(pool)
    assert pool.free_block_ids() == [4, 3, 5, 6, 7, 8, 9, 2, 1]
    assert len(pool._blocks) == 5  # the null block and 1-4: 5..9 are ids only
    assert ids(pool.get_new_blocks(3)) == [4, 3, 5]  # linked before the range, then into it
    assert len(pool._blocks) == 6 and pool.free_block_ids() == [6, 7, 8, 9, 2, 1]
    taken = pool.get_new_blocks(5)  # the rest of the range, then 2 evicts "b"
    assert ids(taken) == [6, 7, 8, 9, 2]
    assert taken[-1].block_hash is None and pool.cached_block_ids() == {h("a"): [1]}
    assert ids(pool._blocks) == list(range(10))  # made in id order
    last = pool.get_new_block()  # 1 evicts "a"
    assert last.block_id == 1 and pool.cached_block_ids() == {}
    assert pool.num_free_blocks == 0
    pool.check_invariants()


def test_a_single_pop_takes_the_linked_head_then_the_range() -> None:
    pool = BlockPool(8, enable_caching=True)
    _queue_around_the_range(pool)
    assert [pool.get_new_block().block_id for _ in range(5)] == [4, 3, 5, 6, 7]
    assert len(pool._blocks) == 8
    pool.check_invariants()


def test_evictions_are_reported_across_the_range() -> None:
    pool = BlockPool(7, enable_caching=True)
    log = observe_kv_events(pool)
    _queue_around_the_range(pool)  # queue 4, 3, 5, 6, 2 ("b"), 1 ("a")
    log.take()
    assert ids(pool.get_new_blocks(5)) == [4, 3, 5, 6, 2]
    assert log.take() == [PoolEvent("removed", (h("b"),))]


def test_a_walk_makes_the_range_in_place() -> None:
    pool = BlockPool(8, enable_caching=True)
    _queue_around_the_range(pool)
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 5, 6, 7, 2, 1]
    assert ids(pool.blocks) == list(range(8))
    assert ids(pool.get_new_blocks(4)) == [4, 3, 5, 6]
    pool.check_invariants()


def test_a_released_pool_is_new_and_its_blocks_serve_the_next_pool() -> None:
    first, second = BlockPool(10, enable_caching=True), BlockPool(10, enable_caching=True)
    held = _queue_around_the_range(first)
    table = first.get_new_blocks(3)  # 4, 3, and 5 made
    with pytest.raises(ValueError, match="3 blocks in use"):
        first.release_blocks()
    first.free_blocks(table)
    made = first._blocks
    spares = first.release_blocks()
    assert spares is made and first._blocks == [first.null_block]  # the list, not a copy
    assert ids(spares) == [1, 2, 3, 4, 5] and all(  # by id: spares[i] has id i + 1
        b.ref_cnt == 1 and b.block_hash is None and b.own_seq is None and b.piece is None
        and b.prev is None and b.next is None for b in spares)  # as a pop leaves a block
    assert first.free_block_ids() == list(range(1, 10)) and first.cached_block_ids() == {}
    assert len(first._blocks) == 1
    first.check_invariants()
    second.reuse(spares)
    taken = second.get_new_blocks(3) + [second.get_new_block()]
    assert ids(taken) == [1, 2, 3, 4] and taken == spares[:4]  # the spare of each id
    rest = second.get_new_blocks(3)
    assert ids(rest) == [5, 6, 7] and rest[0] is spares[4]  # then new objects
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in taken + rest)
    assert held[0] in spares  # a released object now serves the second pool, its id kept
    second.check_invariants()
    second.free_blocks(taken + rest)
    assert second.release_blocks() == [*spares, *rest[1:]]  # its own, by id: the spares first


def test_a_released_manager_forgets_its_tables() -> None:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=6), max_model_len=64,
                        watermark=0.0)
    kv._own_tables["r"] = [kv.block_pool.get_new_blocks(1)]
    with pytest.raises(ValueError, match="1 blocks in use"):
        kv.release_blocks()
    kv.block_pool.free_blocks(kv._own_tables["r"][0])
    assert ids(kv.release_blocks()) == [1] and kv._own_tables == {}


def test_the_invariant_check_keeps_the_range_and_checks_its_rules() -> None:
    pool = BlockPool(10, enable_caching=True)
    b1, b2, b3, b4 = _queue_around_the_range(pool)
    pool.check_invariants()
    assert len(pool._blocks) == 5  # checked without making 5..9
    b3.block_hash = h("c")  # a hashed block ahead of the range breaks `remove`'s rule
    with pytest.raises(AssertionError, match="ahead of the never-used range"):
        pool.check_invariants()


def test_a_released_pool_takes_no_spares_until_told() -> None:
    first, second = BlockPool(6, enable_caching=True), BlockPool(6, enable_caching=True)
    first.get_new_blocks(5)
    first.free_blocks(first._blocks[1:])
    spares = first.release_blocks()
    assert len(spares) == 5
    first.reuse(spares)
    first.release_blocks()  # released again, nothing made: the spares stay for the next pool
    assert not {id(b) for b in first.blocks} & {id(b) for b in spares}  # new objects
    second.reuse(spares)
    assert second.get_new_blocks(2) == spares[:2] and len(spares) == 5


def _released(num_blocks: int) -> list[KVCacheBlock]:
    """A pool's blocks 1..num_blocks-1, all made, freed and released."""
    pool = BlockPool(num_blocks, enable_caching=True)
    pool.get_new_blocks(num_blocks - 1)
    pool.free_blocks(pool._blocks[1:])
    return pool.release_blocks()


def test_a_walk_makes_spares_free_and_a_single_pop_takes_one() -> None:
    """Spares are made in use by pops (as released: one reference each), free by a walk
    that makes the whole range (`build_all`), and by a single pop as a pop sets them."""
    spares = _released(6)
    walked = BlockPool(8, enable_caching=True)
    walked.reuse(spares)
    free = walked.free_block_queue.get_all_free_blocks()
    assert ids(free) == [1, 2, 3, 4, 5, 6, 7] and free[:5] == spares  # then new objects
    assert all(b.ref_cnt == 0 for b in free)
    walked.check_invariants()
    spares = _released(6)
    single = BlockPool(6, enable_caching=True)
    single.reuse(spares)
    block = single.get_new_block()
    assert block is spares[0] and block.ref_cnt == 1 and block.prev is None
    single.check_invariants()
