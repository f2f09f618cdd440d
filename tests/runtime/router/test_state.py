"""What a router knows and when: scrape ticks, delayed KV events, router-local counts, and
the approximate and precise prefix indexes."""

from __future__ import annotations

import pytest

from runtime.router import KvEvent, KvEventQueue, MetricsRefresh, RouterLocal
from runtime.router.prefix_index import BlockLRUIndex, PageTrie, PreciseIndex, prompt_block_hashes

from .helpers import bhashes, req, snaps, tokens


def test_refresh_ticks_on_a_grid() -> None:
    refresh = MetricsRefresh(0.05)
    assert refresh.due(0.0)  # nothing scraped yet
    refresh.store(snaps(2), 0.0)
    assert not refresh.due(0.049) and refresh.due(0.05)
    refresh.store(snaps(2), 0.07)  # scraped late: the next tick is still 0.10
    assert refresh.next_due_s == pytest.approx(0.10) and not refresh.due(0.09)


def test_refresh_zero_is_an_oracle() -> None:
    refresh = MetricsRefresh(0.0)
    refresh.store(snaps(2), 0.0)
    assert refresh.due(0.0) and refresh.due(1e-9)


def test_refresh_rejects_a_negative_interval() -> None:
    with pytest.raises(ValueError, match="refresh_s must be a finite number >= 0, got -1"):
        MetricsRefresh(-1)


def test_kv_events_drain_in_order_after_the_delay() -> None:
    queue = KvEventQueue(0.05)
    first = KvEvent(0, "stored", bhashes("a", 1), 0.0)
    second = KvEvent(1, "stored", bhashes("b", 1), 0.02)
    queue.publish(first)
    queue.publish(second)
    assert queue.drain(0.04) == [] and len(queue) == 2
    assert queue.drain(0.05) == [first]
    assert queue.drain(10.0) == [second] and len(queue) == 0


def test_kv_events_must_be_published_in_time_order() -> None:
    queue = KvEventQueue(0.0)
    queue.publish(KvEvent(0, "stored", (), 1.0))
    with pytest.raises(ValueError, match="in time order"):
        queue.publish(KvEvent(0, "stored", (), 0.5))


def test_router_local_counts() -> None:
    local = RouterLocal()
    a, b = req(tokens(0, 10)), req(tokens(0, 30))
    local.add(a, 1)
    local.add(b, 1)
    assert local.count[1] == 2 and local.tokens[1] == 40
    assert local.finish(a.request_id) == 1 and local.count[1] == 1 and local.tokens[1] == 30
    assert local.finish("nope") is None
    with pytest.raises(ValueError, match="already routed"):
        local.add(b, 0)


def test_request_validation() -> None:
    with pytest.raises(ValueError, match="prompt_len must be >= 1, got 0"):
        req(prompt_len=0)
    with pytest.raises(ValueError, match="token_ids has 3 tokens, prompt_len is 4"):
        req((1, 2, 3), prompt_len=4)
    with pytest.raises(ValueError, match="kv_usage must be in \\[0, 1\\], got 1.5"):
        snaps(1, kv=[1.5])


def test_prompt_block_hashes() -> None:
    assert prompt_block_hashes(tokens(0, 15), 16, 256) == []  # shorter than a block
    assert prompt_block_hashes(None, 16, 256) == []
    h = prompt_block_hashes(tokens(0, 40), 16, 256)
    assert len(h) == 3  # 16 + 16 + the 8-token tail
    assert len(prompt_block_hashes(tokens(0, 40), 16, 2)) == 2  # truncated to 2 blocks
    other = prompt_block_hashes(tokens(0, 16) + tokens(99, 24), 16, 256)
    assert other[0] == h[0] and other[1] != h[1]
    shifted = prompt_block_hashes((7,) + tokens(1, 39), 16, 256)
    assert all(x != y for x, y in zip(shifted, h, strict=True))  # chained


def test_block_lru_index_evicts_the_oldest_and_counts_greedily() -> None:
    index = BlockLRUIndex()
    index.add([1, 2, 3], replica=0, capacity=2)  # 1 evicted
    assert index.match([1, 2, 3]) == {} and index.size(0) == 2
    index.add([1], replica=1, capacity=10)
    # llm-d's greedy count: block 1 held by {1}, block 2 by {0}, block 3 by {0}
    assert index.match([1, 2, 3]) == {1: 1, 0: 2}


def test_page_trie_match_and_sizes() -> None:
    trie = PageTrie(4)
    trie.insert(tokens(0, 10), 0, 0.0)  # pages 4, 4, 2
    trie.insert(tokens(0, 4) + tokens(50, 4), 1, 0.0)
    assert trie.size(0) == 10 and trie.size(1) == 8
    assert trie.match(tokens(0, 10), [0, 1]) == (10, {0})
    assert trie.match(tokens(0, 8), [1]) == (4, {1})
    assert trie.match(tokens(100, 8), [0, 1]) == (0, {0, 1})


def test_page_trie_evicts_least_recent_leaves_first() -> None:
    trie = PageTrie(4)
    trie.insert(tokens(0, 8), 0, 1.0)  # older branch
    trie.insert(tokens(0, 4) + tokens(50, 4), 0, 2.0)  # newer branch, shares page 1
    assert trie.size(0) == 12
    trie.evict_to(8)  # drops the older leaf (tokens 4..8)
    assert trie.size(0) == 8
    assert trie.match(tokens(0, 8), [0]) == (4, {0})
    assert trie.match(tokens(0, 4) + tokens(50, 4), [0]) == (8, {0})


def test_precise_index_overlap_is_leading_blocks() -> None:
    index = PreciseIndex()
    index.apply([KvEvent(0, "stored", (b"a", b"b", b"c"), 0.0),
                 KvEvent(1, "stored", (b"a", b"c"), 0.0)])
    assert index.overlap_blocks((b"a", b"b", b"c")) == {0: 3, 1: 1}  # 1 lacks b: stops
    index.apply([KvEvent(0, "cleared", (), 1.0)])
    assert index.overlap_blocks((b"a", b"b")) == {1: 1} and index.num_blocks(0) == 0
