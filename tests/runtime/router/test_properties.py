"""Property: under any interleaving of requests, finishes, prefill completions, KV events,
scrapes and candidate subsets, every policy routes each request to exactly one of its
candidates, its in-flight counts match what was routed and not finished, and a run is a
function of its seed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.router import KvEvent, KvEventQueue, MetricsRefresh, ReplicaSnapshot, make_policy
from runtime.router.registry import POLICIES

from .helpers import req

NUM_REPLICAS = 4
BLOCK = 16

op = st.one_of(
    st.tuples(st.just("request"), st.integers(0, 3), st.integers(1, 80),
              st.sets(st.integers(0, NUM_REPLICAS - 1), min_size=1),
              st.one_of(st.none(), st.sampled_from(["s0", "s1", "s2"]))),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("prefill"), st.integers(0, 50)),
    st.tuples(st.just("metrics"), st.lists(st.integers(0, 200), min_size=NUM_REPLICAS,
                                           max_size=NUM_REPLICAS)),
    st.tuples(st.just("advance"), st.floats(0.0, 0.2)),
)


def prompt(family: int, length: int) -> tuple[int, ...]:
    """Prompts of one family share a prefix: tokens family*1000, family*1000+1, ..."""
    return tuple(range(family * 1000, family * 1000 + length))


def run(name: str, seed: int, ops: list) -> list[int]:
    policy = make_policy(name, seed=seed)
    refresh, events = MetricsRefresh(0.05), KvEventQueue(0.05)
    now, loads = 0.0, [0] * NUM_REPLICAS
    in_flight: list[str] = []
    routed: dict[str, int] = {}
    picks: list[int] = []
    for index, o in enumerate(ops):
        if o[0] == "request":
            _, family, length, subset, session = o
            if refresh.due(now):
                refresh.store([ReplicaSnapshot(replica_id=i, taken_at_s=now, num_waiting=w,
                                               kv_usage=min(1.0, w / 200))
                               for i, w in enumerate(loads)], now)
            tokens = prompt(family, length)
            hashes = tuple(f"{family}-{j}".encode() for j in range(length // BLOCK))
            r = req(tokens, now_s=now, block_hashes=hashes, session_id=session,
                    request_id=f"q{index}")
            candidates = [s for s in refresh.snapshots if s.replica_id in subset]
            policy.on_kv_events(events.drain(now))
            decision = policy.route(r, candidates)
            assert decision.replica in subset
            assert r.request_id not in routed
            routed[r.request_id] = decision.replica
            in_flight.append(r.request_id)
            picks.append(decision.replica)
            events.publish(KvEvent(decision.replica, "stored", hashes, now))
        elif o[0] in ("finish", "prefill") and in_flight:
            rid = in_flight[o[1] % len(in_flight)]
            if o[0] == "finish":
                in_flight.remove(rid)
                policy.on_finished(rid)
            else:
                policy.on_prefill_done(rid)
        elif o[0] == "metrics":
            loads = o[1]
        elif o[0] == "advance":
            now += o[1]
    for replica in range(NUM_REPLICAS):
        expected = sum(1 for rid in in_flight if routed[rid] == replica)
        assert policy.local.count.get(replica, 0) == expected
    return picks


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), ops=st.lists(op, max_size=60))
def test_every_request_routed_once_to_a_candidate_and_runs_replay(name, seed, ops) -> None:
    assert run(name, seed, ops) == run(name, seed, ops)
