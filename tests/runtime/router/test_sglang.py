"""sglang-cache-aware: imbalanced iff max-min > 64 and max > 1.5*min (-> least loaded);
else match rate > 0.3 -> longest-match holder, else smallest tree. Page size 16."""

from __future__ import annotations

from runtime.router import make_policy
from runtime.router.rng import SplitMix64

from .helpers import req, snaps, tokens


def send(policy, prompt, replica, now_s=0.0):
    r = req(prompt, now_s=now_s)
    policy.on_routed(r, replica)
    return r


def test_empty_trees_tie_is_seeded() -> None:
    # match 0 <= 0.3, every tree size 0 -> seeded draw among [0, 1, 2]
    for seed in range(4):
        d = make_policy("sglang-cache-aware", seed=seed).choose(req(tokens(0, 64)), snaps(3))
        assert d.replica == SplitMix64(seed).choice([0, 1, 2])


def test_high_match_goes_to_the_holder() -> None:
    # A (64) on 1; B = A: rate 64/64 = 1 > 0.3 -> 1
    policy = make_policy("sglang-cache-aware")
    send(policy, tokens(0, 64), 1)
    d = policy.choose(req(tokens(0, 64)), snaps(3))
    assert d.replica == 1 and "match rate 1.000" in d.reason


def test_low_match_goes_to_smallest_tree() -> None:
    # A (64) on 1, C (32) on 0: sizes {0: 32, 1: 64, 2: 0}. B shares 16 of 64 -> 0.25 <= 0.3
    # -> smallest tree, 2
    policy = make_policy("sglang-cache-aware")
    send(policy, tokens(0, 64), 1)
    send(policy, tokens(500, 32), 0)
    d = policy.choose(req(tokens(0, 16) + tokens(900, 48)), snaps(3))
    assert d.replica == 2 and dict(d.scores) == {0: 32.0, 1: 64.0, 2: 0.0}


def test_threshold_is_strict() -> None:
    # A (48) on 1, C (16) on 2: sizes {0: 0, 1: 48, 2: 16}; B (160) starts with A:
    # rate 48/160 = 0.3, not > 0.3 -> smallest tree, 0
    policy = make_policy("sglang-cache-aware")
    send(policy, tokens(0, 48), 1)
    send(policy, tokens(700, 16), 2)
    assert policy.choose(req(tokens(0, 48) + tokens(900, 112)), snaps(3)).replica == 0
    # cache_threshold 0.29: the same 0.3 is now above it -> the holder, 1
    policy2 = make_policy("sglang-cache-aware", ["cache_threshold=0.29"])
    send(policy2, tokens(0, 48), 1)
    assert policy2.choose(req(tokens(0, 48) + tokens(900, 112)), snaps(3)).replica == 1


def test_imbalance_overrides_the_cache() -> None:
    # 65 in flight on 1, 0 elsewhere: 65 - 0 > 64 and 65 > 1.5*0 -> least loaded, first: 0
    policy = make_policy("sglang-cache-aware")
    for _ in range(65):
        send(policy, tokens(0, 64), 1)
    d = policy.choose(req(tokens(0, 64)), snaps(3))
    assert d.replica == 0 and d.reason.startswith("imbalanced")


def test_64_apart_is_still_balanced() -> None:
    # 64 - 0 is not > 64 -> cache path -> 1 holds the prompt
    policy = make_policy("sglang-cache-aware")
    for _ in range(64):
        send(policy, tokens(0, 64), 1)
    assert policy.choose(req(tokens(0, 64)), snaps(3)).replica == 1


def test_relative_threshold() -> None:
    # {0: 130, 1: 200}: 70 > 64 and 200 > 195 -> imbalanced -> 0
    # {0: 140, 1: 200}: 60 not > 64 -> balanced -> holder 1
    for on_zero, expected in ((130, 0), (140, 1)):
        policy = make_policy("sglang-cache-aware")
        for _ in range(on_zero):
            send(policy, tokens(5000, 16), 0)
        for _ in range(200):
            send(policy, tokens(0, 64), 1)
        assert policy.choose(req(tokens(0, 64)), snaps(2)).replica == expected


def test_eviction_every_interval() -> None:
    # max_tree_size 32: A (64 tokens = 4 pages) on 0 at t=0. At t=119 no eviction (size 64);
    # the decision at t=120 trims 0's LRU leaves: pages 4 then 3 -> 32 left (A's first 2)
    policy = make_policy("sglang-cache-aware", ["max_tree_size=32"])
    send(policy, tokens(0, 64), 0)
    policy.choose(req(tokens(0, 16), now_s=119.0), snaps(2))
    assert policy.tree.size(0) == 64
    d = policy.choose(req(tokens(0, 64), now_s=120.0), snaps(2))
    assert policy.tree.size(0) == 32
    assert d.replica == 0 and "match rate 0.500" in d.reason  # 32 of 64 still matched
