"""sglang-cache-aware: imbalanced iff max-min > 64 and max > 1.5*min (-> least loaded);
else match rate > 0.3 -> longest-match holder, else least loaded. "Least loaded": fewest in
flight, then fewest ever routed there, then lowest id (SMG's `(load, processed, index)`).
Pages of 16 tokens; a prompt's partial last page is neither matched nor inserted.
formula=legacy: the low-match branch goes to the smallest tree, the least loaded is the first
of the fewest in flight, and the partial last page counts."""

from __future__ import annotations

from runtime.router import make_policy
from runtime.router.rng import SplitMix64

from .helpers import req, snaps, tokens


def send(policy, prompt, replica, now_s=0.0):
    r = req(prompt, now_s=now_s)
    policy.on_routed(r, replica)
    return r


def legacy(*args: str, seed: int = 0):
    return make_policy("sglang-cache-aware", ["formula=legacy", *args], seed=seed)


def test_empty_trees_go_to_the_first_least_loaded() -> None:
    # match 0 <= 0.3 -> min (in flight, routed, id): all (0, 0) -> 0, whatever the seed
    for seed in range(4):
        d = make_policy("sglang-cache-aware", seed=seed).choose(req(tokens(0, 64)), snaps(3))
        assert d.replica == 0 and dict(d.scores) == {0: 0.0, 1: 0.0, 2: 0.0}


def test_legacy_empty_trees_tie_is_seeded() -> None:
    # match 0 <= 0.3, every tree size 0 -> seeded draw among [0, 1, 2]
    for seed in range(4):
        d = legacy(seed=seed).choose(req(tokens(0, 64)), snaps(3))
        assert d.replica == SplitMix64(seed).choice([0, 1, 2])


def test_high_match_goes_to_the_holder() -> None:
    # A (64) on 1; B = A: rate 64/64 = 1 > 0.3 -> 1
    policy = make_policy("sglang-cache-aware")
    send(policy, tokens(0, 64), 1)
    d = policy.choose(req(tokens(0, 64)), snaps(3))
    assert d.replica == 1 and "match rate 1.000" in d.reason


def test_low_match_goes_to_the_least_loaded() -> None:
    # A (64) on 1, C (32) on 0, both in flight. B shares 16 of 64 -> 0.25 <= 0.3 -> in flight
    # {0: 1, 1: 1, 2: 0} -> 2. Both finish: in flight all 0, routed {0: 1, 1: 1, 2: 0} -> 2
    # again (the id alone would give 0); B sent to 2 and finished: routed 1 each; D (16 of
    # 64 shared) -> 0
    policy = make_policy("sglang-cache-aware")
    a = send(policy, tokens(0, 64), 1)
    c = send(policy, tokens(500, 32), 0)
    b = req(tokens(0, 16) + tokens(900, 48))
    d = policy.choose(b, snaps(3))
    assert d.replica == 2 and dict(d.scores) == {0: 1.0, 1: 1.0, 2: 0.0}
    assert "least loaded" in d.reason
    policy.on_finished(a.request_id)
    policy.on_finished(c.request_id)
    assert policy.choose(b, snaps(3)).replica == 2
    policy.on_routed(b, 2)
    policy.on_finished(b.request_id)
    assert policy.choose(req(tokens(0, 16) + tokens(2000, 48)), snaps(3)).replica == 0


def test_legacy_low_match_goes_to_smallest_tree() -> None:
    # A (64) on 1, C (32) on 0: sizes {0: 32, 1: 64, 2: 0}. B shares 16 of 64 -> 0.25 <= 0.3
    # -> smallest tree, 2
    policy = legacy()
    send(policy, tokens(0, 64), 1)
    send(policy, tokens(500, 32), 0)
    d = policy.choose(req(tokens(0, 16) + tokens(900, 48)), snaps(3))
    assert d.replica == 2 and dict(d.scores) == {0: 32.0, 1: 64.0, 2: 0.0}


def test_partial_last_page_is_not_matched() -> None:
    # A (20 tokens) on 1: only its first page (16) is in the tree. A again: 16/20 = 0.8 ->
    # 1; a 10-token prompt sent before to 1 has no full page: rate 0 -> least loaded, 0.
    # legacy keeps the short page: 20/20 and 10/10 -> 1 both times
    current, old = make_policy("sglang-cache-aware"), legacy()
    for policy in (current, old):
        send(policy, tokens(0, 20), 1)
        send(policy, tokens(300, 10), 1)
    assert current.tree.size(1) == 16 and old.tree.size(1) == 30
    d = current.choose(req(tokens(0, 20)), snaps(3))
    assert d.replica == 1 and "match rate 0.800" in d.reason
    assert current.choose(req(tokens(300, 10)), snaps(3)).replica == 0
    assert "match rate 1.000" in old.choose(req(tokens(0, 20)), snaps(3)).reason
    assert old.choose(req(tokens(300, 10)), snaps(3)).replica == 1


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


def test_imbalance_breaks_load_ties_by_requests_routed() -> None:
    # one request to 0, finished; 65 in flight on 1: in flight {0: 0, 1: 65, 2: 0} ->
    # imbalanced; 0 and 2 tie on load, 2 was routed fewer (0 against 1) -> 2; legacy: 0
    for policy, expected in ((make_policy("sglang-cache-aware"), 2), (legacy(), 0)):
        policy.on_finished(send(policy, tokens(7000, 64), 0).request_id)
        for _ in range(65):
            send(policy, tokens(0, 64), 1)
        d = policy.choose(req(tokens(0, 64)), snaps(3))
        assert d.replica == expected and d.reason.startswith("imbalanced")


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


def test_the_tree_tokens_kept_from_choose_are_the_request_routed() -> None:
    """`choose` keeps the request's tree tokens for its `on_routed`; a request routed
    without that `choose` (same id, other tokens) inserts its own, as computed afresh."""
    policy = make_policy("sglang-cache-aware")
    chosen = req(tokens(0, 40), request_id="a")
    policy.choose(chosen, snaps(2))
    other = req(tokens(100, 40), request_id="a")  # not the object `choose` saw
    policy.on_routed(other, 1)
    assert policy.tree.match(tokens(100, 32), [0, 1]) == (32, {1})
    assert policy.tree.match(tokens(0, 32), [0, 1]) == (0, {0, 1})
    fresh = make_policy("sglang-cache-aware")
    for policy_ in (policy, fresh):
        r = req(tokens(200, 50), request_id="b")
        policy_.choose(r, snaps(2))  # kept, then read by on_routed
        policy_.on_routed(r, 0)
    for probe in (tokens(200, 48), tokens(100, 32)):
        assert policy.tree.match(probe, [0]) == (
            fresh.tree.match(probe, [0]) if probe[0] == 200 else (0, {0}))
    assert policy.tree.size(0) == fresh.tree.size(0) == 48
