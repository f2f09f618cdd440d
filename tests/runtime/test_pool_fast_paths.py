"""The block pool's and hasher's fast paths leave exactly the state of the general ones."""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest

from runtime import BlockPool
from runtime.block_hash import (
    NONE_HASH,
    block_extra_keys,
    hash_block_tokens,
    make_block_hasher,
)
from runtime.block_pool import KVCacheBlock
from runtime.request import Request, SamplingParams


def _reference_free_blocks(pool: BlockPool, ordered_blocks: Iterable[KVCacheBlock]) -> None:
    """`BlockPool.free_blocks` as it was first written (two lists, then the queue)."""
    unhashed: list[KVCacheBlock] = []
    hashed: list[KVCacheBlock] = []
    for block in ordered_blocks:
        if block is pool.null_block:
            continue
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            (unhashed if block.block_hash is None else hashed).append(block)
    pool.free_block_queue.prepend_n(unhashed)
    pool.free_block_queue.append_n(hashed)


def _reference_get_new_blocks(pool: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
    """`BlockPool.get_new_blocks` as it was first written (pop, then evict each block)."""
    blocks = pool.free_block_queue.popleft_n(num_blocks)
    for block in blocks:
        if block.block_hash is not None:
            pool._evict(block)
        block.ref_cnt = 1
    return blocks


def _state(pool: BlockPool) -> tuple[object, ...]:
    pool.check_invariants()
    return (pool.free_block_ids(), pool.num_free_blocks,
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            pool.cached_block_ids())  # per hash, ids in order; hashes' order is not kept


def _run(seed: int, fast: bool) -> list[tuple[object, ...]]:
    """Random allocations (one block and many), registrations (colliding hashes too),
    touches and frees, through the fast paths or the reference ones."""
    rng = random.Random(seed)
    pool = BlockPool(24, enable_caching=True)
    tables: list[list[KVCacheBlock]] = []
    states = []
    for _ in range(300):
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks:
            n = rng.choice([1, 1, 2, 5])
            n = min(n, pool.num_free_blocks)
            coin = rng.random() < 0.5  # drawn either way: both runs see the same ops
            if fast:
                blocks = [pool.get_new_block()] if n == 1 and coin else pool.get_new_blocks(n)
            else:
                blocks = _reference_get_new_blocks(pool, n)
            tables.append(blocks)
        elif op < 0.6 and tables:
            table = rng.choice(tables)
            hashes = [hash_block_tokens(NONE_HASH, [rng.randrange(6)]) for _ in table]
            coin = rng.random()
            if fast and coin < 0.5:  # the whole table in one call
                pool.cache_each(table, hashes)
            else:
                for block, block_hash in zip(table, hashes, strict=True):
                    if fast and coin < 0.75:
                        pool.cache_full_block(block, block_hash)
                    else:
                        pool.cache_blocks([block], [block_hash])
        elif op < 0.65 and tables and pool.num_free_blocks:
            # a table grows and registers a run of blocks, old ones and new ones
            table = rng.choice(tables)
            n = min(rng.choice([1, 2, 5]), pool.num_free_blocks)
            start = rng.randrange(len(table) + 1)
            hashes = [hash_block_tokens(NONE_HASH, [rng.randrange(6)])
                      for _ in range(rng.randrange(len(table) + n - start + 1))]
            if fast:
                pool.extend_table(table, n, start, hashes)
            else:
                table += _reference_get_new_blocks(pool, n)
                pool.cache_blocks(table[start:start + len(hashes)], hashes)
        elif op < 0.7:
            cached = [pool.get_cached_block(hash_block_tokens(NONE_HASH, [t]))
                      for t in range(6)]
            hits = [b for b in cached if b is not None]
            if hits:
                pool.touch(hits)
                tables.append(hits)
        elif tables:
            table = tables.pop(rng.randrange(len(tables)))
            if fast:
                pool.free_blocks(reversed(table))
            else:
                _reference_free_blocks(pool, reversed(table))
        states.append(_state(pool))
    return states


@pytest.mark.parametrize("seed", range(12))
def test_fast_pool_paths_equal_the_reference_ones(seed: int) -> None:
    assert _run(seed, fast=True) == _run(seed, fast=False)


@pytest.mark.parametrize("seed", range(6))
def test_hash_map_keeps_every_block_in_registration_order(seed: int) -> None:
    """Against a plain model of the hash map (hash -> block ids in registration order, a
    lookup hitting the first): registrations with colliding hashes, then evictions in
    random order, through both eviction paths."""
    rng = random.Random(seed)
    pool = BlockPool(40, enable_caching=True)
    blocks = pool.get_new_blocks(39)
    model: dict[bytes, list[int]] = {}
    for block in rng.sample(blocks, 30):
        block_hash = hash_block_tokens(NONE_HASH, [rng.randrange(4)])
        pool.cache_full_block(block, block_hash)
        model.setdefault(block_hash, []).append(block.block_id)
    pool.free_blocks(rng.sample(blocks, len(blocks)))
    while pool.num_free_blocks:
        assert pool.cached_block_ids() == model
        for block_hash, ids in model.items():
            assert pool.get_cached_block(block_hash) is pool.blocks[ids[0]]
        head = pool.free_block_queue.get_all_free_blocks()[0]
        if head.block_hash is not None:
            ids = model[head.block_hash]
            ids.remove(head.block_id)
            if not ids:
                del model[head.block_hash]
        _ = pool.get_new_block() if rng.random() < 0.5 else pool.get_new_blocks(1)
        pool.check_invariants()
    assert pool.cached_blocks == {} and pool.cached_block_ids() == {}


def test_get_new_block_refuses_an_empty_pool() -> None:
    pool = BlockPool(2, enable_caching=True)
    pool.get_new_block()
    with pytest.raises(ValueError, match="cannot get a free block"):
        pool.get_new_block()


@pytest.mark.parametrize("salt", [None, "s"])
@pytest.mark.parametrize("lora", [None, "adapter"])
def test_hasher_one_block_fast_path_equals_the_chain(salt: str | None,
                                                     lora: str | None) -> None:
    block_size = 4
    hasher = make_block_hasher(block_size)
    request = Request("r", list(range(100, 109)), SamplingParams(max_tokens=40),
                      cache_salt=salt, lora_name=lora, lora_path=None if lora is None else "/p")
    request.set_block_hasher(hasher, block_size)
    rng = random.Random(1)
    for _ in range(30):  # one token at a time (one-block path) and in bulk
        if rng.random() < 0.5:
            request.append_output_token(rng.randrange(10, 1000))
        else:
            request.extend_output_tokens([rng.randrange(10, 1000)
                                          for _ in range(rng.randrange(1, 9))])
    tokens = list(request.all_token_ids)
    expected, parent = [], NONE_HASH
    for index in range(len(tokens) // block_size):
        extra = block_extra_keys(index, lora, None if lora is None else "/p", salt)
        parent = hash_block_tokens(parent, tokens[index * block_size:(index + 1) * block_size],
                                   extra)
        expected.append(parent)
    assert request.block_hashes == expected
