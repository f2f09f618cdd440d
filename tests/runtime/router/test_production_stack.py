"""production-stack prefix-aware (trie of 32-token chunks, random among longest-match holders)
and kv-aware (longest cached prefix from KV events unless shorter than len - 2000)."""

from __future__ import annotations

from runtime.router import KvEvent, KvEventQueue, make_policy
from runtime.router.rng import SplitMix64

from .helpers import bhashes, req, snaps, tokens
from .test_session import naive_owner


def send(policy, prompt, replica, now_s=0.0):
    policy.on_routed(req(prompt, now_s=now_s), replica)


# --- prefix-aware ---------------------------------------------------------------------------

def test_prefix_aware_cold_is_a_seeded_draw_over_all() -> None:
    for seed in range(4):
        d = make_policy("prefix-aware", seed=seed).choose(req(tokens(0, 64)), snaps(3))
        assert d.replica == SplitMix64(seed).choice([0, 1, 2])


def test_prefix_aware_follows_the_prompt() -> None:
    # A (64) sent to 2 -> B = A matches 2 chunks held only by 2 -> 2
    policy = make_policy("prefix-aware", seed=1)
    send(policy, tokens(0, 64), 2)
    assert policy.choose(req(tokens(0, 64)), snaps(3)).replica == 2


def test_prefix_aware_longest_match_wins() -> None:
    # A (64) on 2, C (first 32 of A + other) on 1: chunk 1 held by {1, 2}, A's chunk 2 by {2}
    # D = A's 64 tokens -> 64 matched, holders {2} -> 2
    policy = make_policy("prefix-aware")
    send(policy, tokens(0, 64), 2)
    send(policy, tokens(0, 32) + tokens(900, 32), 1)
    d = policy.choose(req(tokens(0, 64)), snaps(3))
    assert d.replica == 2 and dict(d.scores) == {0: 0.0, 1: 0.0, 2: 64.0}


def test_prefix_aware_equal_holders_draw_from_the_seed() -> None:
    # E shares only chunk 1 (held by {1, 2}) -> seeded draw among [1, 2]
    for seed in range(4):
        policy = make_policy("prefix-aware", seed=seed)
        send(policy, tokens(0, 64), 2)
        send(policy, tokens(0, 32) + tokens(900, 32), 1)
        d = policy.choose(req(tokens(0, 32) + tokens(5000, 32)), snaps(3))
        assert d.replica == SplitMix64(seed).choice([1, 2])


def test_prefix_aware_min_match_falls_back_to_lowest_qps() -> None:
    # min 64 tokens; D matches 32 -> lowest QPS: 1 and 2 got one request each, 0 none -> 0
    policy = make_policy("prefix-aware", ["min_match_tokens=64"])
    send(policy, tokens(0, 64), 2)
    send(policy, tokens(0, 32) + tokens(900, 32), 1)
    d = policy.choose(req(tokens(0, 32) + tokens(5000, 32)), snaps(3))
    assert d.replica == 0 and "lowest QPS" in d.reason


def test_prefix_aware_only_available_endpoints() -> None:
    # 2 is not a candidate: the match narrows to holders among {0, 1}: chunk 1 -> {1}
    policy = make_policy("prefix-aware")
    send(policy, tokens(0, 64), 2)
    send(policy, tokens(0, 32) + tokens(900, 32), 1)
    assert policy.choose(req(tokens(0, 64)), snaps(2)).replica == 1


# --- kv-aware -------------------------------------------------------------------------------

def test_kv_aware_no_match_goes_to_lowest_qps() -> None:
    d = make_policy("kv-aware").choose(req(tokens(0, 64), block_hashes=bhashes("x", 4)), snaps(3))
    assert d.replica == 0 and "lowest QPS" in d.reason


def test_kv_aware_follows_the_cache() -> None:
    # 2 holds x0..x2 = 48 tokens >= 64 - 2000 -> 2
    policy = make_policy("kv-aware")
    policy.on_kv_events([KvEvent(2, "stored", bhashes("x", 3), 0.0)])
    d = policy.choose(req(tokens(0, 64), block_hashes=bhashes("x", 4)), snaps(3))
    assert d.replica == 2 and dict(d.scores) == {0: 0.0, 1: 0.0, 2: 48.0}


def test_kv_aware_long_prompt_short_match_uses_the_session() -> None:
    # prompt 3000, match 48 < 3000 - 2000 -> session ring owner of "conv-7"
    policy = make_policy("kv-aware")
    policy.on_kv_events([KvEvent(2, "stored", bhashes("x", 3), 0.0)])
    r = req(prompt_len=3000, block_hashes=bhashes("x", 187), session_id="conv-7")
    assert policy.choose(r, snaps(3)).replica == naive_owner([0, 1, 2], "conv-7")


def test_kv_aware_threshold_argument() -> None:
    # threshold 10, prompt 64: match 48 < 54 -> fallback (0); match 64 >= 54 -> holder 2
    policy = make_policy("kv-aware", ["kv_aware_threshold=10"])
    policy.on_kv_events([KvEvent(2, "stored", bhashes("x", 3), 0.0)])
    r = req(tokens(0, 64), block_hashes=bhashes("x", 4))
    assert policy.choose(r, snaps(3)).replica == 0
    policy.on_kv_events([KvEvent(2, "stored", bhashes("x", 4), 0.1)])
    assert policy.choose(r, snaps(3)).replica == 2


def test_kv_aware_equal_holders_draw_from_the_seed() -> None:
    for seed in range(4):
        policy = make_policy("kv-aware", seed=seed)
        policy.on_kv_events([KvEvent(r, "stored", bhashes("x", 2), 0.0) for r in (0, 2)])
        d = policy.choose(req(tokens(0, 64), block_hashes=bhashes("x", 4)), snaps(3))
        assert d.replica == SplitMix64(seed).choice([0, 2])


def test_kv_aware_sees_events_only_after_the_delay() -> None:
    policy = make_policy("kv-aware")
    queue = KvEventQueue(0.05)
    queue.publish(KvEvent(2, "stored", bhashes("x", 4), 1.0))
    r = req(tokens(0, 64), block_hashes=bhashes("x", 4))
    policy.on_kv_events(queue.drain(1.049))
    assert policy.choose(r, snaps(3)).replica == 0  # not yet visible: lowest QPS
    policy.on_kv_events(queue.drain(1.05))
    assert policy.choose(r, snaps(3)).replica == 2
