"""dynamo-kv: cost = prefill_load_scale * max(0, (active_prefill + isl)/bs - credit*overlap)
+ active_blocks + additional_blocks (legacy: w*(isl - overlap*bs)/bs + decode); lowest wins.
Block size 16, prompts of 64 tokens (4 blocks), fake engine hashes."""

from __future__ import annotations

import math

import pytest

from runtime.router import KvEvent, KvEventQueue, make_policy
from runtime.router.dynamo import softmax_pick
from runtime.router.rng import SplitMix64

from .helpers import bhashes, req, snaps, tokens


def r64(prefix: str, **kw):
    return req(tokens(0, 64), block_hashes=bhashes(prefix, 4), **kw)


def test_cold_fleet_ties_are_seeded() -> None:
    # every worker: 64/16 = 4 prefill + 0 + 4 new blocks = 8 -> tie, seeded draw
    for seed in range(4):
        d = make_policy("dynamo-kv", seed=seed).choose(r64("x"), snaps(3))
        assert dict(d.scores) == {0: 8.0, 1: 8.0, 2: 8.0}
        assert d.replica == SplitMix64(seed).choice([0, 1, 2])


def test_overlap_credit() -> None:
    # 1 holds x0, x1: 1: max(0, 4 - 2) + 4 = 6; others 8 -> 1
    policy = make_policy("dynamo-kv")
    policy.on_kv_events([KvEvent(1, "stored", bhashes("x", 2), 0.0)])
    d = policy.choose(r64("x"), snaps(3))
    assert d.replica == 1 and dict(d.scores) == {0: 8.0, 1: 6.0, 2: 8.0}


def test_active_prefill_and_blocks_count() -> None:
    # X (64 uncached tokens, 4 blocks) in flight on 0. Y: 0: (64+64)/16 = 8 + (4 + 4) = 16;
    # 1: 4 + 4 = 8 -> 1. After X's prefill: 0: 4 + 8 = 12.
    policy = make_policy("dynamo-kv")
    x = r64("x")
    policy.on_routed(x, 0)
    assert dict(policy.choose(r64("y"), snaps(2)).scores) == {0: 16.0, 1: 8.0}
    policy.on_prefill_done(x.request_id)
    assert dict(policy.choose(r64("y"), snaps(2)).scores) == {0: 12.0, 1: 8.0}
    policy.on_finished(x.request_id)
    assert dict(policy.choose(r64("y"), snaps(2)).scores) == {0: 8.0, 1: 8.0}


def test_shared_blocks_and_prefill_load_scale() -> None:
    # X (x0..x3) in flight on 0, prefill done; 0 cached x0, x1. Y = x0, x1, y2, y3.
    # scale 2: 0: 2*max(0, 4 - 2) + (4 active + 2 unshared) = 10; 1: 2*4 + 4 = 12 -> 0
    policy = make_policy("dynamo-kv", ["prefill_load_scale=2"])
    x = r64("x")
    policy.on_routed(x, 0)
    policy.on_prefill_done(x.request_id)
    policy.on_kv_events([KvEvent(0, "stored", bhashes("x", 2), 0.0)])
    y = req(tokens(0, 64), block_hashes=bhashes("x", 2) + (b"y2", b"y3"))
    d = policy.choose(y, snaps(2))
    assert d.replica == 0 and dict(d.scores) == {0: 10.0, 1: 12.0}


def test_partial_tail_blocks_are_prefill_only() -> None:
    # Dynamo tracks active blocks by the prompt's full-block hashes: a 72-token prompt is 4
    # blocks + 8 tokens, and the tail counts as prefill work only. X (x0..x3 + tail) in
    # flight on 0, prefill done; Y (y0..y3 + tail): 0: 72/16 = 4.5 + (4 active + 4 new) =
    # 12.5; 1: 4.5 + 4 = 8.5 (counting tails as blocks: 14.5 and 9.5)
    policy = make_policy("dynamo-kv")
    x = req(tokens(0, 72), block_hashes=bhashes("x", 4))
    policy.on_routed(x, 0)
    policy.on_prefill_done(x.request_id)
    y = req(tokens(100, 72), block_hashes=bhashes("y", 4))
    assert dict(policy.choose(y, snaps(2)).scores) == {0: 12.5, 1: 8.5}


def test_without_hashes_full_blocks_are_distinct() -> None:
    # a trace of lengths only: no hashes, every full block its own (Dynamo without KV reuse
    # hashes blocks at random). X: 72 tokens = 4 blocks on 0, prefill done; Y (72): 0: 4.5 +
    # (4 + 4) = 12.5; 1: 4.5 + 4 = 8.5; after X finishes 0 is back to 8.5
    policy = make_policy("dynamo-kv")
    x = req(prompt_len=72)
    policy.on_routed(x, 0)
    policy.on_prefill_done(x.request_id)
    assert dict(policy.choose(req(prompt_len=72), snaps(2)).scores) == {0: 12.5, 1: 8.5}
    policy.on_finished(x.request_id)
    assert dict(policy.choose(req(prompt_len=72), snaps(2)).scores) == {0: 8.5, 1: 8.5}


def test_credit_zero_ignores_the_cache() -> None:
    # credit 0: 1 holds all 4 blocks but costs 4 + 4 = 8 like the others -> seeded tie
    policy = make_policy("dynamo-kv", ["overlap_score_credit=0"], seed=3)
    policy.on_kv_events([KvEvent(1, "stored", bhashes("x", 4), 0.0)])
    d = policy.choose(r64("x"), snaps(3))
    assert dict(d.scores) == {0: 8.0, 1: 8.0, 2: 8.0}


def test_legacy_formula() -> None:
    # legacy: w*(isl - overlap*bs)/bs + decode. X in flight on 0 (not prefilled).
    # 0: 64/16 = 4 + (4 + 4) = 12 (active prefill ignored; current formula says 16);
    # 1 holds x0, x1 of Y=x..: (64 - 32)/16 = 2 + 4 = 6 -> 1
    policy = make_policy("dynamo-kv", ["formula=legacy"])
    policy.on_routed(r64("z"), 0)
    policy.on_kv_events([KvEvent(1, "stored", bhashes("x", 2), 0.0)])
    d = policy.choose(r64("x"), snaps(3))
    assert d.replica == 1 and dict(d.scores) == {0: 12.0, 1: 6.0, 2: 8.0}


def test_softmax_pick_by_hand() -> None:
    # costs {0: 8, 1: 6}, T=1: weights exp(-8/2) : exp(-6/2) -> p0 = e^-1 / (1 + e^-1)
    p0 = math.exp(-1) / (1 + math.exp(-1))  # 0.2689
    assert softmax_pick({0: 8.0, 1: 6.0}, 1.0, p0 - 1e-9) == 0
    assert softmax_pick({0: 8.0, 1: 6.0}, 1.0, p0 + 1e-9) == 1
    # equal costs -> uniform: [0, .5] -> first, (.5, 1) -> second
    assert softmax_pick({3: 5.0, 7: 5.0}, 0.5, 0.49) == 3
    assert softmax_pick({3: 5.0, 7: 5.0}, 0.5, 0.51) == 7


def test_temperature_samples_with_the_seeded_draw() -> None:
    policy = make_policy("dynamo-kv", ["temperature=1.0"], seed=12)
    policy.on_kv_events([KvEvent(1, "stored", bhashes("x", 2), 0.0)])
    rng = SplitMix64(12)
    p0 = math.exp(-1) / (1 + math.exp(-1))
    for _ in range(20):
        expected = 0 if rng.random() <= p0 else 1
        assert policy.choose(r64("x"), snaps(2)).replica == expected


def test_kv_events_arrive_after_the_delay() -> None:
    # stored on 1 at t=0, delay 50 ms: at t=0.04 nothing is known (tie, 8 each); at 0.05 the
    # overlap is visible -> 1 (cost 6)
    policy = make_policy("dynamo-kv")
    queue = KvEventQueue(0.05)
    queue.publish(KvEvent(1, "stored", bhashes("x", 2), 0.0))
    policy.on_kv_events(queue.drain(0.04))
    assert dict(policy.choose(r64("x", now_s=0.04), snaps(2)).scores) == {0: 8.0, 1: 8.0}
    policy.on_kv_events(queue.drain(0.05))
    assert policy.choose(r64("x", now_s=0.05), snaps(2)).replica == 1


def test_bad_temperature_is_refused() -> None:
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1.0"):
        make_policy("dynamo-kv", ["temperature=-1"])
