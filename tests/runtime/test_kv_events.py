"""KV events of an observed block pool: exact for a hand-made sequence, the pool's own
behaviour unchanged, and an index fed by them holds exactly what the pool caches."""

from __future__ import annotations

from runtime import Request, SamplingParams
from runtime.block_hash import NONE_HASH, hash_block_tokens, make_block_hasher
from runtime.block_pool import BlockPool
from runtime.kv_events import PoolEvent, observe_kv_events, prompt_block_hashes
from runtime.router import KvEvent
from runtime.router.prefix_index import PreciseIndex


def h(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def test_a_hand_made_sequence_emits_vllms_events() -> None:
    pool = BlockPool(5, enable_caching=True)  # null block 0, usable 1..4
    log = observe_kv_events(pool)
    assert pool.kv_event_log is log and observe_kv_events(pool) is log
    b1, b2 = pool.get_new_blocks(2)
    assert (b1.block_id, b2.block_id) == (1, 2) and log.take() == []
    pool.cache_blocks([b1, b2], [h("a"), h("b")])
    pool.cache_full_block(b1, h("a"))  # already registered: no event
    assert log.take() == [PoolEvent("stored", (h("a"), h("b")))]
    pool.free_blocks(reversed([b1, b2]))  # free queue: 3, 4, 2, 1
    assert pool.free_block_ids() == [3, 4, 2, 1]
    taken = pool.get_new_blocks(3)  # 3, 4, then 2 evicts "b"
    assert [b.block_id for b in taken] == [3, 4, 2]
    assert log.take() == [PoolEvent("removed", (h("b"),))]
    last = pool.get_new_block()  # 1 evicts "a"
    assert last.block_id == 1 and log.take() == [PoolEvent("removed", (h("a"),))]
    pool.cache_full_block(taken[0], h("c"))
    pool.free_blocks([*taken, last])
    assert pool.reset_prefix_cache()
    assert log.take() == [PoolEvent("stored", (h("c"),)), PoolEvent("cleared")]


def test_a_hash_held_twice_stays_held_until_both_blocks_go() -> None:
    pool = BlockPool(4, enable_caching=True)
    log = observe_kv_events(pool)
    b1, b2, b3 = pool.get_new_blocks(3)
    pool.cache_full_block(b1, h("x"))
    pool.cache_blocks([b2, b3], [h("x"), h("y")])  # a second block under "x"
    pool.free_blocks([b1, b2, b3])  # queue: 1, 2, 3 (all hashed)
    pool.get_new_block()  # evicts block 1 ("x"), block 2 still caches "x"
    events = log.take()
    assert events == [PoolEvent("stored", (h("x"),)), PoolEvent("stored", (h("x"), h("y"))),
                      PoolEvent("removed", (h("x"),))]
    index = PreciseIndex()
    index.apply(KvEvent(0, e.kind, e.block_hashes, 0.0) for e in events)
    assert index.hashes(0) == set(pool.cached_block_ids()) == {h("x"), h("y")}


def test_cache_each_emits_one_stored_event_per_new_block_in_order() -> None:
    pool = BlockPool(6, enable_caching=True)
    log = observe_kv_events(pool)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    pool.cache_full_block(b2, h("b"))
    pool.cache_each([b3, b2, b1, pool.null_block, b4], [h("c"), h("z"), h("a"), h("n"), h("c")])
    assert log.take() == [PoolEvent("stored", (h("b"),)), PoolEvent("stored", (h("c"),)),
                          PoolEvent("stored", (h("a"),)), PoolEvent("stored", (h("c"),))]
    assert pool.cached_block_ids() == {h("b"): [2], h("c"): [3, 4], h("a"): [1]}


def test_extend_table_emits_the_evictions_then_one_stored_event() -> None:
    pool = BlockPool(5, enable_caching=True)
    log = observe_kv_events(pool)
    table = pool.get_new_blocks(2)
    pool.cache_blocks(table, [h("a"), h("b")])
    pool.free_blocks(reversed(table))  # queue: 3, 4, 2 ("b"), 1 ("a")
    log.take()
    table = pool.get_new_blocks(1)
    new = pool.extend_table(table, 2, 0, [h("c"), h("d"), h("b")])  # blocks 3 | 4, 2
    assert [b.block_id for b in new] == [4, 2] and [b.block_id for b in table] == [3, 4, 2]
    assert log.take() == [PoolEvent("removed", (h("b"),)),
                          PoolEvent("stored", (h("c"), h("d"), h("b")))]


def test_observing_changes_nothing_in_the_pool() -> None:
    pools = [BlockPool(9, enable_caching=True) for _ in range(2)]
    observe_kv_events(pools[1])
    for pool in pools:
        blocks = pool.get_new_blocks(4)
        pool.cache_blocks(blocks[:3], [h("p"), h("q"), h("r")])
        pool.free_blocks(reversed(blocks))
        table = pool.get_new_blocks(2)
        pool.extend_table(table, 3, 1, [h("s"), h("q"), h("t")])  # evicts "r", "q", "p"
        pool.get_new_blocks(2)
    assert pools[0].free_block_ids() == pools[1].free_block_ids()
    assert pools[0].cached_block_ids() == pools[1].cached_block_ids()


def test_prompt_block_hashes_are_the_engines() -> None:
    tokens = list(range(100, 140))  # 2 full blocks of 16, 8 left over
    first = hash_block_tokens(NONE_HASH, tokens[:16])
    assert prompt_block_hashes(tokens, 16) == (first, hash_block_tokens(first, tokens[16:32]))
    salted = prompt_block_hashes(tokens, 16, cache_salt="s")
    assert salted[0] != first and len(salted) == 2
    for salt in (None, "s"):  # what the scheduler's hasher gives the request
        request = Request("r", tokens, SamplingParams(max_tokens=4), cache_salt=salt)
        request.set_block_hasher(make_block_hasher(16), 16)
        assert prompt_block_hashes(tokens, 16, salt) == tuple(request.block_hashes)
