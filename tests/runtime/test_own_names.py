"""Blocks under a request's own names (`Request.block_key`) are cached without a hash-map
entry and found in the request's old block tables (`BlockPool` docstring): the block ids,
free-queue order, hits and evictions are those of the same names in the map."""

from __future__ import annotations

import random

import pytest

from runtime import CacheConfig, KVCacheManager, Request, SamplingParams, Scheduler
from runtime.block_hash import make_block_hasher, own_block_names
from tests.runtime.helpers import free_ids, make_request, make_scheduler, step, steps_of

KEY = b"own:"


def keyed(req_id: str, length: int, max_tokens: int) -> Request:
    return make_request(req_id, length, max_tokens, block_key=KEY + req_id.encode())


def test_own_blocks_are_cached_without_map_entries() -> None:
    s = make_scheduler(num_blocks=10)
    s.add_request(keyed("A", 9, 1))
    assert step(s).new == [("A", [1, 2, 3], 0)]
    pool = s.kv_cache_manager.block_pool
    names = own_block_names(KEY + b"A", 0, 2)
    assert s.requests["A"].own_from == 0 and s.requests["A"].block_hashes == names
    assert pool.cached_blocks == {}  # no map entry ...
    assert pool.cached_block_ids() == {names[0]: [1], names[1]: [2]}  # ... yet cached
    assert pool.get_cached_block(names[1]) is pool.blocks[2]


def keyed_or_given(req_id: str, length: int, max_tokens: int, own: bool) -> Request:
    """Own names by a key, or the same names given (registered in the map: the reference)."""
    if own:
        return keyed(req_id, length, max_tokens)
    return make_request(req_id, length, max_tokens,
                        block_hashes=own_block_names(KEY + req_id.encode(), 0, length // 4))


@pytest.mark.parametrize("own", [True, False])
def test_preempted_request_hits_its_own_blocks_left_after_a_partial_eviction(
        own: bool) -> None:
    s = make_scheduler(num_blocks=7)  # 6 usable blocks
    s.add_request(keyed_or_given("A", 12, 9, own))
    s.add_request(keyed_or_given("B", 8, 8, own))
    assert step(s).new == [("A", [1, 2, 3], 0), ("B", [4, 5], 0)]
    st = step(s)  # A takes block 6; B cannot grow and preempts itself
    assert st.output.preempted_req_ids == ["B"] and free_ids(s) == [5, 4]
    frees = [step(s).free for _ in range(6)]
    assert frees[3] == [4]  # A grew into block 5: B's last block, evicted
    assert step(s).finished == ["A"] and free_ids(s) == [4, 5, 6, 3, 2, 1]
    # B (9 tokens) hits block 4, its own block still cached, and recomputes 5 tokens
    # into the free queue's head blocks, 5 and 6 (A's, unhashed)
    assert step(s).new == [("B", [4, 5, 6], 4)]
    assert s.prefix_cache_stats.preempted_hits == 4


def _manager(own: bool) -> tuple[KVCacheManager, Request]:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=10), max_model_len=64,
                        watermark=0.0)
    request = keyed_or_given("A", 12, 4, own)
    request.set_block_hasher(make_block_hasher(4), 4)
    return kv, request


def _preempt(kv: KVCacheManager, request: Request) -> None:
    kv.free(request)
    request.num_computed_tokens = 0


@pytest.mark.parametrize("own", [True, False])
def test_a_duplicate_own_name_hits_the_first_registered_block(own: bool) -> None:
    # A block-aligned prompt's last full block can never hit (its last token must run):
    # after a preemption it is computed again into a new block while the old one is
    # still cached under the same name.
    kv, a = _manager(own)
    pool, names = kv.block_pool, a.block_hashes
    assert kv.allocate_slots(a, 12) is not None and kv.get_block_ids("A") == [1, 2, 3]
    _preempt(kv, a)
    hits, num_hit = kv.get_computed_blocks(a)
    assert [b.block_id for b in hits] == [1, 2] and num_hit == 8
    kv.allocate_slots(a, 4, num_hit, hits)
    assert kv.get_block_ids("A") == [1, 2, 4]
    assert pool.cached_block_ids()[names[2]] == [3, 4]
    a.num_computed_tokens = 12
    a.append_output_token(7)
    _preempt(kv, a)
    assert [b.block_id for b in kv.get_computed_blocks(a)[0]] == [1, 2, 3]  # the first
    assert [b.block_id for b in pool.get_new_blocks(6)] == [5, 6, 7, 8, 9, 3]
    assert [b.block_id for b in kv.get_computed_blocks(a)[0]] == [1, 2, 4]  # the next
    pool.check_invariants()


def test_reset_prefix_cache_forgets_own_names() -> None:
    s = make_scheduler(num_blocks=10)
    s.add_request(keyed("A", 9, 1))
    while s.has_unfinished_requests():
        step(s)
    pool = s.kv_cache_manager.block_pool
    assert len(pool.cached_block_ids()) == 2
    assert s.reset_prefix_cache()
    assert pool.cached_block_ids() == {} and all(b.own_seq is None for b in pool.blocks)
    assert s.kv_cache_manager._own_tables == {}


def _workload(seed: int, own: bool) -> list[tuple[int, Request]]:
    """Requests arriving at steps: a shared prefix (hashed, given) then tokens of their own,
    named by a key (`own`) or given as the same names in the map (the reference)."""
    rng = random.Random(seed)
    hasher = make_block_hasher(4)
    prefixes = [list(range(50 * p, 50 * p + 4 * rng.randint(0, 3))) for p in range(3)]
    out = []
    for i in range(rng.randint(10, 30)):
        prefix = rng.choice(prefixes)
        prompt = prefix + list(range(10_000 * (i + 1), 10_000 * (i + 1) + rng.randint(1, 20)))
        probe = Request("p", prefix, SamplingParams(max_tokens=1))
        probe.set_block_hasher(hasher, 4)
        given, key = list(probe.block_hashes), f"k{i}".encode()
        if not own:  # the same names, but given: registered in the map
            given += own_block_names(key, len(given), len(prompt) // 4)
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True)
        out.append((rng.randint(0, 20), Request(f"r{i}", prompt, params, block_hashes=given,
                                                priority=rng.randint(0, 2),
                                                block_key=key if own else None)))
    return out


def _run(seed: int, own: bool) -> list[object]:
    rng = random.Random(seed + 1)
    s: Scheduler = make_scheduler(num_blocks=rng.choice([12, 20, 40]), max_num_seqs=4,
                                  max_num_batched_tokens=rng.choice([8, 16, 64]),
                                  policy=rng.choice(["fcfs", "priority"]))
    pending, trail = _workload(seed, own), []
    for st in steps_of(s, pending):
        trail.append((st.new, st.output.preempted_req_ids, st.free,
                      [s.get_block_ids(r.request_id) for r in s.running]))
    return trail


@pytest.mark.parametrize("seed", range(12))
def test_own_names_give_the_block_ids_of_names_in_the_map(seed: int) -> None:
    assert _run(seed, own=True) == _run(seed, own=False)
