"""llm-d's approximate prefix index (`BlockLRUIndex`) and its block hashes against plain
references: the hash-by-hash LRU and the blake2b chain computed afresh."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.router.prefix_index import BlockLRUIndex, prompt_block_hashes


class _ReferenceLRU:
    """llm-d's per-replica LRU, one hash at a time (the index's meaning)."""

    def __init__(self) -> None:
        self.lru: dict[int, OrderedDict[int, None]] = {}
        self.limit: dict[int, int] = {}

    def add(self, hashes: Sequence[int], replica: int, capacity: int) -> None:
        lru = self.lru.setdefault(replica, OrderedDict())
        limit = self.limit.setdefault(replica, capacity)
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if len(lru) > limit:
                    lru.popitem(last=False)

    def match(self, hashes: Sequence[int]) -> dict[int, int]:
        matched: dict[int, int] = {}
        for h in hashes:
            owners = [r for r, lru in self.lru.items() if h in lru]
            if not owners:
                break
            for r in owners:
                matched[r] = matched.get(r, 0) + 1
        return matched


_adds = st.lists(st.tuples(st.lists(st.integers(0, 12), max_size=8),  # repeats included
                           st.sampled_from([0, 1, 2, 63, 64, 200]),  # bits past a word too
                           st.integers(0, 12)), max_size=25)


@settings(max_examples=300, deadline=None)
@given(_adds, st.lists(st.integers(0, 12), max_size=8))
def test_block_lru_index_is_the_hash_by_hash_lru(
        adds: list[tuple[list[int], int, int]], probe: list[int]) -> None:
    index, reference = BlockLRUIndex(), _ReferenceLRU()
    for hashes, replica, capacity in adds:
        index.add(hashes, replica, capacity)
        reference.add(hashes, replica, capacity)
        for r, lru in reference.lru.items():
            assert index.held(r) == list(lru)  # the same hashes in the same LRU order
    assert index.match(probe) == reference.match(probe)


def test_block_lru_index_touches_in_prompt_order_without_eviction() -> None:
    index = BlockLRUIndex()
    index.add([1, 2, 3, 4], replica=0, capacity=10)
    index.add([3, 5, 1], replica=0, capacity=10)  # 3, 1 touched, 5 new
    assert index.held(0) == [2, 4, 3, 5, 1]
    index.add([6, 6, 2], replica=0, capacity=10)  # a repeat: touched again
    assert index.held(0) == [4, 3, 5, 1, 6, 2]
    index.add([7, 4, 8, 9, 10, 11], replica=0, capacity=10)  # 11 held > 10: 3 evicted
    assert index.held(0) == [5, 1, 6, 2, 7, 4, 8, 9, 10, 11]
    assert index.match([3]) == {} and index.match([5, 6, 7]) == {0: 3}


def test_block_lru_index_compacts_its_touches_in_order() -> None:
    index, reference = BlockLRUIndex(), _ReferenceLRU()
    adds = [[i % 5, 9, (i * 2) % 5] for i in range(100)]  # 6 hashes, touched 300 times
    adds += [[20 + i, i % 5] for i in range(8)]  # then evictions
    longest = 0
    for hashes in adds:
        index.add(hashes, replica=1, capacity=6)
        reference.add(hashes, replica=1, capacity=6)
        assert index.held(1) == list(reference.lru[1])
        assert index.match([9]) == reference.match([9])
        longest = max(longest, len(index._lru[1].log))
    assert index.size(1) == 6
    assert longest <= 2 * 6 + 64 + 3  # compacted, never 300 touches long


def test_block_lru_index_rejects_a_negative_replica() -> None:
    with pytest.raises(ValueError, match="replica must be >= 0, got -1"):
        BlockLRUIndex().add([1], replica=-1, capacity=4)


def _fresh_hashes(tokens: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """The router's block hashes computed afresh, one `int.from_bytes` per block."""
    if len(tokens) < block_size:
        return []
    tokens = list(tokens[: max_blocks * block_size])
    parent, hashes = b"rt-router-root", []
    for start in range(0, len(tokens), block_size):
        block = b"".join(t.to_bytes(8, "little", signed=True)
                         for t in tokens[start:start + block_size])
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=80), st.integers(1, 20),
       st.integers(1, 6))
def test_prompt_block_hashes_are_the_blake2b_chain(
        tokens: list[int], block_size: int, max_blocks: int) -> None:
    assert prompt_block_hashes(tokens, block_size, max_blocks) == _fresh_hashes(
        tokens, block_size, max_blocks)


def test_prompt_block_hashes_exact_values() -> None:
    hashes = prompt_block_hashes(list(range(10, 50)), 16, 256)
    assert hashes == _fresh_hashes(list(range(10, 50)), 16, 256)
    assert hashes[0] == int.from_bytes(hashlib.blake2b(
        b"rt-router-root" + b"".join(t.to_bytes(8, "little") for t in range(10, 26)),
        digest_size=8).digest(), "little")
