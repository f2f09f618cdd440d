"""session-hash: the ring owner computed by a naive ring (min point >= md5(key), wrapping)."""

from __future__ import annotations

import hashlib

from runtime.router import make_policy

from .helpers import req, snaps


def naive_owner(replicas: list[int], key: str, vnodes: int = 160) -> int:
    def point(s: str) -> int:
        return int.from_bytes(hashlib.md5(s.encode()).digest()[:8], "big")

    points = [(point(f"{r}-{i}"), r) for r in replicas for i in range(vnodes)]
    h = point(key)
    after = [p for p in points if p[0] >= h]
    return min(after)[1] if after else min(points)[1]


def test_session_goes_to_its_ring_owner() -> None:
    policy = make_policy("session-hash")
    for key in ("alice", "bob", "carol", "dave", "eve"):
        got = policy.choose(req(prompt_len=8, session_id=key), snaps(4)).replica
        assert got == naive_owner([0, 1, 2, 3], key)


def test_session_is_sticky_whatever_the_load() -> None:
    policy = make_policy("session-hash")
    first = policy.route(req(prompt_len=8, session_id="s1"), snaps(3)).replica
    busy = snaps(3, waiting=[100, 100, 100])
    assert all(policy.route(req(prompt_len=8, session_id="s1"), busy).replica == first
               for _ in range(5))


def test_no_session_goes_to_lowest_qps() -> None:
    # fresh: all 0 QPS -> first, 0; after one dispatch to 0 (1/60 QPS) -> 1
    policy = make_policy("session-hash")
    assert policy.route(req(prompt_len=8), snaps(3)).replica == 0
    assert policy.route(req(prompt_len=8), snaps(3)).replica == 1


def test_a_replica_never_sent_to_comes_first() -> None:
    # production-stack's `_qps_routing` returns the first endpoint without request stats as
    # soon as its scan reaches it: 0 got a request at t=0, 1 none. At t=61 0's window is
    # empty (QPS 0) but 1 still wins
    policy = make_policy("session-hash")
    policy.route(req(prompt_len=8, now_s=0.0), snaps(2))
    assert policy.choose(req(prompt_len=8, now_s=59.0), snaps(2)).replica == 1
    assert policy.choose(req(prompt_len=8, now_s=61.0), snaps(2)).replica == 1


def test_qps_window_keeps_its_left_edge() -> None:
    # production-stack drops timestamps < now - 60: two dispatches to 0 at t=0, one to 1 at
    # t=30. At t=60 both of 0's still count: 2/60 vs 1/60 -> 1; at t=60.5 they are gone:
    # 0/60 vs 1/60 -> 0
    policy = make_policy("session-hash")
    policy.route(req(prompt_len=8, now_s=0.0), snaps(1))
    policy.route(req(prompt_len=8, now_s=0.0), snaps(1))
    policy.on_routed(req(prompt_len=8, now_s=30.0), 1)
    assert policy.choose(req(prompt_len=8, now_s=60.0), snaps(2)).replica == 1
    assert policy.choose(req(prompt_len=8, now_s=60.5), snaps(2)).replica == 0


def test_removing_a_replica_moves_only_its_sessions() -> None:
    policy = make_policy("session-hash")
    keys = [f"session-{i}" for i in range(200)]
    before = {k: policy.choose(req(prompt_len=8, session_id=k), snaps(4)).replica for k in keys}
    three = snaps(3)
    after = {k: policy.choose(req(prompt_len=8, session_id=k), three).replica for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != 3)
    assert any(before[k] == 3 for k in keys)


def test_fewer_virtual_nodes_change_the_ring() -> None:
    policy = make_policy("session-hash", ["virtual_nodes=1"])
    for key in ("a", "b", "c"):
        got = policy.choose(req(prompt_len=8, session_id=key), snaps(3)).replica
        assert got == naive_owner([0, 1, 2], key, vnodes=1)
