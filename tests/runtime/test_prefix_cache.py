"""Prefix caching through the scheduler: chained hashes, extra keys, hit limits, same-step
dedup, duplicates, LRU eviction, evictable hits counted, touch before pop, resume hits."""

from __future__ import annotations

import pytest

from runtime import RequestStatus
from runtime.block_hash import (
    NONE_HASH,
    hash_block_tokens,
    make_block_hasher,
    own_block_name,
    own_block_names,
)
from tests.runtime.helpers import free_ids, make_request, make_scheduler, step

P = list(range(100, 164))  # a pool of distinct prompt tokens


def hashes_of(tokens: list[int], block_size: int = 4, **kwargs: object) -> list[bytes]:
    request = make_request("x", tokens, **kwargs)
    request.set_block_hasher(make_block_hasher(block_size), block_size)
    return request.block_hashes


def test_hashes_are_chained_over_full_blocks_only() -> None:
    hashes = hashes_of(P[:10])
    assert len(hashes) == 2  # 10 tokens = 2 full blocks + a partial one
    h0 = hash_block_tokens(NONE_HASH, P[0:4])
    assert hashes == [h0, hash_block_tokens(h0, P[4:8])]
    # Same second block after a different first block: a different hash.
    assert hashes_of(P[20:24] + P[4:8])[1] != hashes[1]


def test_own_block_names_are_the_index_then_the_key_whatever_the_order_asked() -> None:
    """Own names share a table of index prefixes grown on demand: the bytes are
    `index.to_bytes(8, "little") + key` for any order of requests (a large index first)."""
    key = b"rt:own-block-test"
    for index in (70_000, 0, 1, 69_999, 70_001):
        assert own_block_name(key, index) == index.to_bytes(8, "little") + key
    for first, last in ((0, 0), (3, 3), (0, 5), (90_000, 90_003), (5, 2)):
        assert own_block_names(key, first, last) == [
            own_block_name(key, index) for index in range(first, last)]
    with pytest.raises(ValueError, match="index must be >= 0, got -1"):
        own_block_name(key, -1)
    with pytest.raises(ValueError, match="first and last must be >= 0, got -2, 3"):
        own_block_names(key, -2, 3)
    with pytest.raises(ValueError, match="first and last must be >= 0, got 0, -1"):
        own_block_names(key, 0, -1)  # a slice of the prefix table would wrap silently


def test_hashes_grow_as_output_tokens_fill_blocks() -> None:
    request = make_request("x", P[:7])
    request.set_block_hasher(make_block_hasher(4), 4)
    assert len(request.block_hashes) == 1
    request.append_output_token(5)
    assert request.block_hashes == hashes_of(P[:7] + [5])


def test_lora_tags_every_block_and_cache_salt_the_first() -> None:
    plain = hashes_of(P[:8])
    lora = hashes_of(P[:8], lora_name="a", lora_path="/a")
    other_path = hashes_of(P[:8], lora_name="a", lora_path="/b")
    salted = hashes_of(P[:8], cache_salt="s")
    assert len({plain[0], lora[0], other_path[0], salted[0]}) == 4
    assert len({plain[1], lora[1], other_path[1], salted[1]}) == 4
    # The salt is a key of block 0 only; block 1 differs through the chain alone.
    assert salted[1] == hash_block_tokens(salted[0], P[4:8])
    assert lora[1] != hash_block_tokens(lora[0], P[4:8])
    # A salt equal to an adapter's name does not collide with that adapter.
    assert hashes_of(P[:8], cache_salt="a") != hashes_of(P[:8], lora_name="a", lora_path="")


def test_cache_salt_separates_otherwise_identical_prompts() -> None:
    s = make_scheduler(max_num_batched_tokens=64)
    s.add_request(make_request("A", P[:9], 4, cache_salt="tenant-1"))
    step(s)
    s.add_request(make_request("B", P[:9], 4, cache_salt="tenant-2"))
    s.add_request(make_request("C", P[:9], 4, cache_salt="tenant-1"))
    st = step(s)
    assert st.new == [("B", [4, 5, 6], 0), ("C", [1, 2, 7], 8)]


def test_hit_is_capped_at_num_tokens_minus_one_so_aligned_prompts_recompute_a_block() -> None:
    s = make_scheduler()
    s.add_request(make_request("A", P[:8], 4))
    step(s)  # A: blocks [1, 2], both full and cached
    s.add_request(make_request("B", P[:8], 4))
    st = step(s)
    # 8 tokens: at most 7 may hit, i.e. 1 whole block; block 2's content is recomputed in
    # block 4 (block 3 went to A's decode).
    assert st.tokens == {"A": 1, "B": 4}
    assert st.new == [("B", [1, 4], 4)]
    # Block 4 now duplicates block 2 under the same hash; lookups return block 2 first.
    pool = s.kv_cache_manager.block_pool
    assert pool.get_cached_block(s.requests["B"].block_hashes[1]) is pool.blocks[2]
    assert set(pool.cached_block_ids()[s.requests["B"].block_hashes[1]]) == {2, 4}


def test_identical_prompts_admitted_in_one_step_share_blocks() -> None:
    s = make_scheduler()
    s.add_request(make_request("A", P[:12], 4))
    s.add_request(make_request("B", P[:12], 4))
    st = step(s)
    # A's full blocks are cached when allocated, so B, admitted next, already hits 2 of them.
    assert st.tokens == {"A": 12, "B": 4}
    assert st.new == [("A", [1, 2, 3], 0), ("B", [1, 2, 4], 8)]
    assert s.prefix_cache_stats.queries == 24 and s.prefix_cache_stats.hits == 8


def test_eviction_order_unhashed_then_unused_then_lru_tail_first() -> None:
    s = make_scheduler(num_blocks=6)
    s.add_request(make_request("A", P[:9], 1))
    assert step(s).finished == ["A"]
    # A's table [1, 2, 3] freed reversed: partial block 3 to the head, cached [2, 1] last.
    assert free_ids(s) == [3, 4, 5, 2, 1]
    s.add_request(make_request("B", P[20:32], 1))
    st = step(s)
    assert st.new == [("B", [3, 4, 5], 0)]  # unhashed first, then never-used blocks
    assert free_ids(s) == [2, 1, 5, 4, 3]  # B's three full blocks join behind A's
    s.add_request(make_request("C", P[40:45], 1))
    st = step(s)
    # LRU: A's blocks were freed first, and within A its longest prefix goes first.
    assert st.new == [("C", [2, 1], 0)]
    pool = s.kv_cache_manager.block_pool
    assert [pool.get_cached_block(ah) for ah in s.requests["A"].block_hashes] == [None, None]
    b_hashes = s.requests["B"].block_hashes
    assert [pool.get_cached_block(bh).block_id for bh in b_hashes] == [3, 4, 5]


def test_evictable_hits_count_against_free_blocks_and_failure_changes_nothing() -> None:
    s = make_scheduler(num_blocks=4)  # 3 usable blocks
    s.add_request(make_request("A", P[:5], 1))
    step(s)  # A: [1, 2]; block 1 cached; freed: 2 to the head, 1 to the tail
    assert free_ids(s) == [2, 3, 1]
    s.add_request(make_request("D", P[30:37], 4))
    step(s)  # D holds [2, 3] and can decode one token without a new block
    assert free_ids(s) == [1]
    s.add_request(make_request("E", P[:4] + P[50:53], 4))
    st = step(s)
    # E hits block 1 (free, cached) and needs one more: 2 blocks against 1 free.
    assert "E" not in st.tokens
    assert st.output.wait_reason.value == "kv_capacity"
    block1 = s.kv_cache_manager.block_pool.blocks[1]
    assert block1.ref_cnt == 0 and block1.block_hash is not None and free_ids(s) == [1]


def test_cache_hit_is_touched_before_new_blocks_are_popped() -> None:
    s = make_scheduler(num_blocks=5)  # 4 usable blocks
    s.add_request(make_request("A", P[:5], 1))
    step(s)
    assert free_ids(s) == [2, 3, 4, 1]
    s.add_request(make_request("D", P[30:42], 1))
    step(s)  # D takes [2, 3, 4], all full; freed reversed to the tail
    assert free_ids(s) == [1, 4, 3, 2]
    s.add_request(make_request("E", P[:4] + P[50:53], 4))
    st = step(s)
    # Block 1 sits at the head, but E's hit on it is taken first; the new block is 4.
    assert st.new == [("E", [1, 4], 4)]
    pool = s.kv_cache_manager.block_pool
    assert pool.blocks[4].block_hash is None  # D's last block was evicted
    assert pool.blocks[3].block_hash is not None and pool.blocks[2].block_hash is not None


def test_preempted_request_resumes_from_its_still_cached_blocks() -> None:
    s = make_scheduler(num_blocks=6)  # 5 usable blocks
    s.add_request(make_request("A", P[:8], 5))
    s.add_request(make_request("B", P[20:28], 2))
    assert step(s).new == [("A", [1, 2], 0), ("B", [3, 4], 0)]
    st = step(s)  # A takes block 5; B cannot grow and preempts itself
    assert st.tokens == {"A": 1} and st.output.preempted_req_ids == ["B"]
    assert free_ids(s) == [4, 3]  # B's cached blocks, tail first
    assert st.output.wait_reason.value == "preempted_this_step"
    for _ in range(3):
        st = step(s)
        assert st.output.wait_reason.value == "kv_capacity"
    assert st.finished == ["A"]
    assert free_ids(s) == [4, 3, 5, 2, 1]  # A's three full blocks, reversed, behind B's
    st = step(s)
    # B (9 tokens: prompt + 1 output) hits its 2 old blocks and recomputes one token.
    assert st.tokens == {"B": 1}
    assert st.new == [("B", [3, 4, 5], 8)]
    assert st.output.scheduled_resumed_req_ids == ["B"]
    stats = s.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 16, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 9, 8)
    assert s.requests["B"].num_cached_tokens == 0  # fixed at the first admission


def test_no_hashing_and_no_hits_with_prefix_caching_off() -> None:
    s = make_scheduler(enable_prefix_caching=False)
    s.add_request(make_request("A", P[:9], 2))
    step(s)
    s.add_request(make_request("B", P[:9], 2))
    st = step(s)
    assert st.new == [("B", [4, 5, 6], 0)]
    assert s.requests["B"].block_hashes == []
    assert s.kv_cache_manager.block_pool.cached_blocks == {}
    assert s.prefix_cache_stats.queries == 0
    assert s.requests["A"].status == RequestStatus.FINISHED_LENGTH_CAPPED
