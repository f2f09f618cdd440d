"""The block pool builds never-used blocks lazily: allocations, frees, cache hits and the
free-queue order are those of a list model of vLLM's queue, and a pool that has handed out
few blocks has built few."""

from __future__ import annotations

import random

import pytest

from runtime.block_pool import BlockPool, KVCacheBlock


class QueueModel:
    """vLLM's free-queue order on a plain list of ids: unhashed frees at the head, hashed at
    the tail, pops from the head, cache hits taken out of the middle."""

    def __init__(self, num_blocks: int) -> None:
        self.ids = list(range(1, num_blocks))

    def pop(self, count: int) -> list[int]:
        taken, self.ids = self.ids[:count], self.ids[count:]
        return taken

    def free(self, unhashed: list[int], hashed: list[int]) -> None:
        self.ids = unhashed + self.ids + hashed

    def take(self, block_id: int) -> None:
        self.ids.remove(block_id)


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_follow_the_list_model(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = rng.choice([40, 300, 1000])
    pool, model = BlockPool(num_blocks, enable_caching=True), QueueModel(num_blocks)
    held: list[list[KVCacheBlock]] = []
    serial = 0
    for _ in range(200):
        op = rng.random()
        if op < 0.45 and pool.num_free_blocks:
            count = rng.randint(1, min(pool.num_free_blocks, 20))
            blocks = pool.get_new_blocks(count) if count > 1 or rng.random() < 0.5 \
                else [pool.get_new_block()]
            assert [b.block_id for b in blocks] == model.pop(count)
            if rng.random() < 0.5:  # register some as full
                hashes = [f"h{serial + i}".encode() for i in range(len(blocks) // 2)]
                serial += len(hashes)
                pool.cache_blocks(blocks[:len(hashes)], hashes)
            held.append(blocks)
        elif op < 0.8 and held:
            blocks = held.pop(rng.randrange(len(held)))
            ordered = list(reversed(blocks))
            last = [b for b in ordered if b.ref_cnt == 1]  # their last reference
            pool.free_blocks(ordered)
            model.free([b.block_id for b in last if b.block_hash is None],
                       [b.block_id for b in last if b.block_hash is not None])
        elif pool.cached_blocks:
            block = pool.cached_blocks[rng.choice(sorted(pool.cached_blocks))]
            if block.ref_cnt == 0:
                model.take(block.block_id)
            pool.touch([block])
            held.append([block])
        assert pool.num_free_blocks == len(model.ids)
    assert pool.free_block_ids() == model.ids
    pool.check_invariants()


def test_a_pool_makes_only_the_blocks_it_hands_out() -> None:
    pool = BlockPool(100_000, enable_caching=True)
    blocks = pool.get_new_blocks(10)
    assert [b.block_id for b in blocks] == list(range(1, 11))
    assert len(pool._blocks) == 11 and pool.num_free_blocks == 100_000 - 1 - 10
    assert pool.usage == pytest.approx(10 / 99_999)
    pool.free_blocks(reversed(blocks))  # unhashed: back at the head, 10 first
    assert [pool.get_new_block().block_id for _ in range(3)] == [10, 9, 8]
    assert len(pool.blocks) == 100_000 and pool.blocks[77_777].block_id == 77_777


def test_blocks_made_in_bulk_equal_constructed_ones() -> None:
    """`make_blocks` (pure Python: without `__init__`'s call) makes the blocks the
    constructor makes, every slot equal, each a `KVCacheBlock` that pickles as one."""
    import pickle

    from runtime.free_block_queue import make_blocks

    def slots(block: KVCacheBlock) -> list[object]:
        return [getattr(block, name) for name in KVCacheBlock.__slots__]

    made = make_blocks(range(7, 10), 1)
    assert [slots(block) for block in made] == [
        slots(KVCacheBlock(block_id, 1)) for block_id in (7, 8, 9)]
    assert slots(made[0]) == [7, 1, None, None, None, 0, None, None]
    assert all(isinstance(block, KVCacheBlock) for block in made)
    assert repr(made[2]) == "KVCacheBlock(9, ref_cnt=1)"
    assert slots(pickle.loads(pickle.dumps(made[1]))) == slots(made[1])
    assert make_blocks(range(3, 3), 0) == []
