"""llm-d: weighted scorers, default queue 2 / kv-cache-utilization 2 / prefix-cache 3, max
score wins, ties drawn from the seed. Expected totals computed by hand in the comments."""

from __future__ import annotations

import pytest

from runtime.router import KvEvent, MetricsRefresh, make_policy
from runtime.router.llmd import Llmd, LlmdConfig
from runtime.router.rng import SplitMix64

from .helpers import bhashes, req, snaps, tokens

ONLY = dict(queue=0.0, kv_cache_utilization=0.0, prefix_cache=0.0)


def only(**weights: float | str) -> Llmd:
    return Llmd(LlmdConfig(**{**ONLY, **weights}))


def test_default_weights_queue_and_kv() -> None:
    # queue (4-q)/4: [1, 0, .5]; kv 1-u: [.5, .9, .8]; total 2q+2kv = [3.0, 1.8, 2.6] -> 0
    d = make_policy("llm-d").choose(req(tokens(0, 8)), snaps(3, [0, 4, 2], kv=[.5, .1, .2]))
    assert d.replica == 0
    assert d.scores == pytest.approx({0: 3.0, 1: 1.8, 2: 2.6})


def test_prefix_hit_wins_on_equal_load() -> None:
    # A (64 tokens = 4 blocks) went to 1; B = A: prefix 4/4 -> totals [4, 7, 4] -> 1
    policy = make_policy("llm-d")
    a = req(tokens(0, 64))
    policy.choose(a, snaps(3))
    policy.on_routed(a, 1)
    d = policy.choose(req(tokens(0, 64)), snaps(3))
    assert d.replica == 1 and d.scores == pytest.approx({0: 4.0, 1: 7.0, 2: 4.0})


def test_prefix_against_queue() -> None:
    # 1 holds the prefix; waiting [0, 3, 1]: queue [1, 0, 2/3], kv all 1
    # totals: 0: 2+2 = 4; 1: 0+2+3 = 5; 2: 4/3+2 = 3.33 -> 1
    policy = make_policy("llm-d")
    a = req(tokens(0, 64))
    policy.choose(a, snaps(3))
    policy.on_routed(a, 1)
    d = policy.choose(req(tokens(0, 64)), snaps(3, waiting=[0, 3, 1]))
    assert d.replica == 1 and d.scores[2] == pytest.approx(2 * 2 / 3 + 2)


def test_load_beats_prefix_when_kv_is_full() -> None:
    # as above but 1's KV usage 0.6: 1: 0 + 2*0.4 + 3 = 3.8 < 4 -> 0 (0 and... 2: 3.33)
    policy = make_policy("llm-d")
    a = req(tokens(0, 64))
    policy.choose(a, snaps(3))
    policy.on_routed(a, 1)
    d = policy.choose(req(tokens(0, 64)), snaps(3, waiting=[0, 3, 1], kv=[0, .6, 0]))
    assert d.replica == 0 and d.scores[1] == pytest.approx(3.8)


def test_partial_prefix_scores_the_fraction() -> None:
    # A (64) on 2; B shares 32 tokens then differs: 2 of 4 blocks -> 0.5*3 = 1.5 -> [4, 4, 5.5]
    policy = make_policy("llm-d")
    a = req(tokens(0, 64))
    policy.choose(a, snaps(3))
    policy.on_routed(a, 2)
    d = policy.choose(req(tokens(0, 32) + tokens(1000, 32)), snaps(3))
    assert d.replica == 2 and d.scores[2] == pytest.approx(5.5)


def test_tie_is_a_seeded_draw() -> None:
    # everything equal: totals 4, 4, 4 -> SplitMix64(seed).choice([0, 1, 2])
    for seed in range(5):
        d = make_policy("llm-d", seed=seed).choose(req(tokens(0, 8)), snaps(3))
        assert d.replica == SplitMix64(seed).choice([0, 1, 2])


def test_stale_metrics_hide_a_busy_replica() -> None:
    # scraped at t=0: 0 idle, 1 busy; at t=0.01 (refresh 0.05, not due) replica 0 is busy
    # for real but the router still sees the t=0 scrape -> 0; at t=0.05 it rescrapes -> 1
    policy = make_policy("llm-d")
    refresh = MetricsRefresh(0.05)
    truth = {0.0: snaps(2, waiting=[0, 5]), 0.01: snaps(2, waiting=[9, 5]),
             0.05: snaps(2, waiting=[9, 5])}
    picks = []
    for now in (0.0, 0.01, 0.05):
        if refresh.due(now):
            refresh.store(truth[now], now)
        picks.append(policy.choose(req(tokens(0, 8), now_s=now), refresh.snapshots).replica)
    assert picks == [0, 0, 1]


def test_load_aware_scorer() -> None:
    # 0 waiting -> 0.5; 64 -> 0.5*(1-64/128) = 0.25; 200 -> capped at 128 -> 0
    d = only(load_aware=1).choose(req(tokens(0, 8)), snaps(3, waiting=[0, 64, 200]))
    assert d.scores == pytest.approx({0: 0.5, 1: 0.25, 2: 0.0}) and d.replica == 0


def test_active_request_scorer() -> None:
    # in flight {0: 2, 1: 1}: maxC 2 -> 0: 0/2 = 0, 1: 1/2, 2 (idle) 1.0 -> 2
    policy = only(active_request=1)
    for r in (0, 0, 1):
        policy.on_routed(req(tokens(0, 8)), r)
    d = policy.choose(req(tokens(0, 8)), snaps(3))
    assert d.scores == pytest.approx({0: 0.0, 1: 0.5, 2: 1.0}) and d.replica == 2


def test_active_request_max_is_over_the_candidates() -> None:
    # in flight {0: 4, 1: 2, 2: 1}; candidates 1 and 2 only: maxC over them = 2 (llm-d since
    # #931) -> 1: (2-2)/2 = 0, 2: (2-1)/2 = 0.5. formula=legacy (maxC over every replica the
    # router tracks, 4): 1: (4-2)/4 = 0.5, 2: (4-1)/4 = 0.75
    current, legacy = only(active_request=1), only(active_request=1, formula="legacy")
    for policy in (current, legacy):
        for r in (0, 0, 0, 0, 1, 1, 2):
            policy.on_routed(req(tokens(0, 8)), r)
    candidates = snaps(3)[1:]
    assert current.choose(req(tokens(0, 8)), candidates).scores == pytest.approx(
        {1: 0.0, 2: 0.5})
    assert legacy.choose(req(tokens(0, 8)), candidates).scores == pytest.approx(
        {1: 0.5, 2: 0.75})


def test_token_load_scorer() -> None:
    # llm-d's estimate per request: input + round(1.5 * input), Go's round (half away from
    # zero). Threshold 1000; 50 + 75 = 125 and 7 + round(10.5) = 7 + 11 = 18 in flight on 0:
    # 1 - 143/1000 = 0.857; after the 50-token one finishes: 1 - 18/1000 = 0.982
    policy = Llmd(LlmdConfig(**ONLY, token_load=1, token_load_threshold=1000))
    first = req(tokens(0, 50))
    policy.on_routed(first, 0)
    policy.on_routed(req(tokens(0, 7)), 0)
    d = policy.choose(req(tokens(0, 8)), snaps(2))
    assert d.scores == pytest.approx({0: 0.857, 1: 1.0}) and d.replica == 1
    policy.on_finished(first.request_id)
    assert policy.choose(req(tokens(0, 8)), snaps(2)).scores == pytest.approx(
        {0: 0.982, 1: 1.0})


def test_token_load_caps_at_the_threshold() -> None:
    # threshold 100: 50 + 75 = 125 tokens -> min(1, 1.25) -> score 0
    policy = Llmd(LlmdConfig(**ONLY, token_load=1, token_load_threshold=100))
    policy.on_routed(req(tokens(0, 50)), 0)
    assert policy.choose(req(tokens(0, 8)), snaps(2)).scores == pytest.approx({0: 0.0, 1: 1.0})


def test_no_hit_lru_scorer_rotates_cold_requests() -> None:
    # cold, none used: 1 - i/2 -> [1, .5, 0] -> 0; LRU [0]: never [1, 2] -> 1: 1, 2: .5,
    # 0: 1 - (2+0)/2 = 0 -> 1; LRU [0, 1]: 2: 1, 0: 1 - (1+0)/2 = .5, 1: 1 - (1+1)/2 = 0 -> 2
    policy = only(no_hit_lru=1)
    expected_scores = [{0: 1.0, 1: 0.5, 2: 0.0}, {0: 0.0, 1: 1.0, 2: 0.5},
                       {0: 0.5, 1: 0.0, 2: 1.0}]
    for start, scores in zip((0, 100, 200), expected_scores, strict=True):
        d = policy.route(req(tokens(start, 32)), snaps(3))  # distinct prompts: all cold
        assert d.scores == pytest.approx(scores)
    assert policy.route(req(tokens(0, 32)), snaps(3)).scores == pytest.approx(
        {0: 0.5, 1: 0.5, 2: 0.5})  # warm: prompt 0 was sent to 0 -> neutral


def test_precise_prefix_scorer_from_kv_events() -> None:
    # llm-d since #1107: matched / total blocks. Replica 1 reported x0, x1 of the request's
    # 3 blocks: {1: 2/3}, others 0; after x0's removal nothing leads: all 0 (the old min-max
    # gave every replica 1 here)
    policy = only(precise_prefix_cache=1)
    policy.on_kv_events([KvEvent(1, "stored", bhashes("x", 2), 0.0)])
    r = req(tokens(0, 48), block_hashes=bhashes("x", 3))
    assert policy.choose(r, snaps(3)).scores == pytest.approx({0: 0.0, 1: 2 / 3, 2: 0.0})
    policy.on_kv_events([KvEvent(1, "removed", bhashes("x", 1), 0.1)])
    assert policy.choose(r, snaps(3)).scores == {0: 0.0, 1: 0.0, 2: 0.0}
    # no engine block hashes (a prompt shorter than one block): 0 for all
    assert policy.choose(req(tokens(0, 8)), snaps(2)).scores == {0: 0.0, 1: 0.0}


def test_precise_prefix_scorer_legacy_min_max() -> None:
    # formula=legacy (llm-d <= v0.8.0): overlap {1: 2} min-max -> [0, 1, 0]; all 0 -> all 1
    policy = only(precise_prefix_cache=1, formula="legacy")
    policy.on_kv_events([KvEvent(1, "stored", bhashes("x", 2), 0.0)])
    r = req(tokens(0, 48), block_hashes=bhashes("x", 3))
    assert policy.choose(r, snaps(3)).scores == {0: 0.0, 1: 1.0, 2: 0.0}
    policy.on_kv_events([KvEvent(1, "removed", bhashes("x", 1), 0.1)])
    assert policy.choose(r, snaps(3)).scores == {0: 1.0, 1: 1.0, 2: 1.0}


def test_auto_tune_sizes_the_lru_from_the_pool() -> None:
    # a 2-block pool keeps only the last 2 of A's 4 blocks: matching stops at block 0 -> 0
    policy = make_policy("llm-d")
    tiny = [s.__class__(replica_id=s.replica_id, taken_at_s=0.0, num_gpu_blocks=2)
            for s in snaps(2)]
    a = req(tokens(0, 64))
    policy.choose(a, tiny)
    policy.on_routed(a, 1)
    assert policy.choose(req(tokens(0, 64)), tiny).scores == {0: 4.0, 1: 4.0}
