"""A fleet behind routers that read completions, in processes in lockstep
(`simulate_fleet(workers=N)`, `sim.fleet_lockstep`): the records are those of one process
exactly; only policies that hear completions as counts run so; the trade between processes
is exact; an error anywhere reaches the caller as itself, a killed worker as one line, and no
worker outlives the call."""

from __future__ import annotations

import multiprocessing
import os
import resource
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, cast

import pytest

from runtime.router import RouterPolicy, make_policy
from runtime.router.simple import LeastOutstanding
from sim import fleet as fleet_module
from sim import fleet_lockstep
from sim.fleet import simulate_fleet
from sim.fleet_lockstep import PeerGone, Peers, hears_counts_only, run_lockstep
from tests.sim.test_fleet_prerouted import randomised
from tests.sim.test_fleet_workers import equal, fleet, killed_when, uneven


@pytest.mark.parametrize("policy", ["least-outstanding", "power-of-two",
                                    "sglang-cache-aware"])
@pytest.mark.parametrize("seed", [1, 3])
def test_lockstep_gives_the_records_of_one_process(policy: str, seed: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    trace = randomised(seed)  # seed 3: multi-turn sessions, step noise, 2 routers
    setups = uneven(seed)
    one = fleet(trace, policy, setups, workers=1, routers=1 + seed // 2)
    assert len({r.replica for r in one.requests}) == 4
    ran: list[int] = []
    lockstep = fleet_module.run_lockstep
    monkeypatch.setattr(fleet_module, "run_lockstep",
                        lambda tasks, *args: ran.append(len(tasks)) or lockstep(tasks, *args))
    for workers in (2, 3, 9):  # 9: more workers than replicas
        equal(fleet(trace, policy, setups, workers, routers=1 + seed // 2), one)
    assert ran == [2, 3, 4]
    assert not multiprocessing.active_children()


class _HearsFinishesItsWay(LeastOutstanding):
    """A policy whose `on_finished` does more than count: order could matter to it."""

    def on_finished(self, request_id: str) -> None:
        super().on_finished(request_id)


@pytest.mark.parametrize(("policy", "counts_only"), [
    (make_policy("least-outstanding", ()), True),
    (make_policy("power-of-two", ()), True),
    (make_policy("sglang-cache-aware", ()), True),
    (make_policy("llm-d", ()), False),  # its token estimates
    (make_policy("dynamo-kv", ()), False),  # prefill tokens at the first token
    (_HearsFinishesItsWay(), False),
])
def test_only_policies_hearing_completions_as_counts_qualify(policy: RouterPolicy,
                                                             counts_only: bool) -> None:
    assert hears_counts_only(policy) is counts_only


def test_a_policy_hearing_finishes_its_own_way_runs_in_one_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_lockstep(*args: object) -> None:
        raise AssertionError("ran in lockstep")

    trace, setups = randomised(1), uneven(1)
    one = simulate_fleet(trace, setups, _HearsFinishesItsWay(seed=5), refresh_s=0.02,
                         routing_latency_s=0.001)
    monkeypatch.setattr(fleet_module, "run_lockstep", no_lockstep)
    two = simulate_fleet(trace, setups, _HearsFinishesItsWay(seed=5), refresh_s=0.02,
                         routing_latency_s=0.001, workers=2)
    equal(two, one)


def _parent(rounds: int, children: int) -> Callable[[Peers], list[list[int]]]:
    def route(peers: Peers) -> list[list[int]]:
        assert peers.index == 0
        heard = []
        for k in range(rounds):
            heard.append(peers.gather().tolist())
            peers.announce(1000 + k)
        return heard
    return route


def _child(index: int, rounds: int) -> Callable[[Peers], list[int]]:
    def follow(peers: Peers) -> list[int]:
        assert peers.index == index
        # round k: child i sends i + k % 2 copies of 100 i + k
        return [peers.ask(array("q", [100 * index + k] * (index + k % 2)))
                for k in range(rounds)]
    return follow


def test_the_parent_hears_every_child_in_group_order_and_each_hears_its_word() -> None:
    got = run_lockstep([_parent(3, 2), _child(1, 3), _child(2, 3)])
    assert got[0] == [[100 * i + k for i in (1, 2) for _ in range(i + k % 2)]
                      for k in range(3)]
    assert got[1] == got[2] == [1000, 1001, 1002]
    assert not multiprocessing.active_children()


def test_a_frame_longer_than_a_pipe_crosses_whole() -> None:
    big = list(range(-50_000, 50_000))  # 800 kB: many times a pipe's buffer

    def parent(peers: Peers) -> list[int]:
        heard = peers.gather().tolist()
        peers.announce(-7)
        return heard

    def child(peers: Peers) -> int:
        return peers.ask(array("q", big))

    assert run_lockstep([parent, child]) == [big, -7]


def test_closing_the_pipes_closes_no_other_file(tmp_path: Path) -> None:
    """A file opened during the run takes the lowest free number: one the parent's `keep`
    freed (a child's end). The parent's closing of its pipes at the end leaves it open."""
    def parent(peers: Peers) -> tuple[BinaryIO, bool]:
        opened = open(tmp_path / "opened-mid-run", "wb")  # noqa: SIM115 (returned)
        peers.gather()
        peers.announce(0)
        return opened, opened.fileno() in peers.fds()

    def child(peers: Peers) -> int:
        return peers.ask(array("q"))

    got = run_lockstep([parent, child])
    opened, reused = cast(tuple[BinaryIO, bool], got[0])
    assert reused and got[1] == 0  # the number was a pipe end's: the case this tests
    with opened:
        opened.write(b"still open")  # EBADF had the number been closed again
    assert (tmp_path / "opened-mid-run").read_bytes() == b"still open"


def test_pipes_numbered_past_1024_are_waited_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parent of ~145 processes holds descriptors numbered 1,024 and up, which `select`
    refuses ('filedescriptor out of range in select()'). Here 1,030 files hold the low
    numbers and no read polls before it blocks."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"needs 1,100 descriptors, the hard limit is {hard}")
    monkeypatch.setattr(fleet_lockstep, "_MIN_POLLS", 1)  # one poll, then wait
    monkeypatch.setattr(fleet_lockstep._POLLS, "limit", 1)

    def parent(peers: Peers) -> list[int]:
        heard = peers.gather().tolist()
        peers.announce(3)
        return heard

    def child(peers: Peers) -> int:
        return peers.ask(array("q", [7]))

    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    try:
        assert run_lockstep([parent, child]) == [[7], 3]
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _failing_group(start: int, error: BaseException) -> Callable[..., object]:
    run_group = fleet_module._Fleet.run_group

    def run(self: fleet_module._Fleet, group: range, peers: Peers) -> object:
        if group.start == start:
            raise error
        return run_group(self, group, peers)
    return run


@pytest.mark.parametrize("start", [0, 2])  # the parent's group, a child's
def test_an_error_in_any_process_reaches_the_caller(start: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    error = ValueError("stack_delay_s['7'] must be >= 0, got -1")
    monkeypatch.setattr(fleet_module._Fleet, "run_group", _failing_group(start, error))
    with pytest.raises(ValueError) as raised:
        fleet(randomised(1), "least-outstanding", uneven(1), workers=2)
    assert str(raised.value) == "stack_delay_s['7'] must be >= 0, got -1"
    assert not multiprocessing.active_children()


def _open_fds() -> list[str]:
    """This process's open file descriptors (Linux: /proc/self/fd)."""
    return sorted(os.listdir("/proc/self/fd"))


def _failing_mid_run(method: str, in_parent: bool) -> Callable[..., object]:
    """`_Fleet.<method>`, raising at request 20 in the parent (`in_parent`) or a child."""
    original = getattr(fleet_module._Fleet, method)

    def run(self: fleet_module._Fleet, *args: object) -> object:
        assert self.peers is not None
        if self.next_index == 20 and (self.peers.index == 0) == in_parent:
            raise ValueError(f"request 20 failed in the {'parent' if in_parent else 'child'}")
        return original(self, *args)
    return run


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
@pytest.mark.parametrize(("method", "in_parent"), [("route", True), ("take_routed", False)])
def test_an_error_mid_run_leaves_no_descriptor_open(method: str, in_parent: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Not even while the caller holds the error (its traceback holds `run_lockstep`'s
    frame: the children's `Process` objects kept 2 pipe ends each open until collected)."""
    trace, setups = randomised(1), uneven(1)
    before = _open_fds()
    monkeypatch.setattr(fleet_module._Fleet, method, _failing_mid_run(method, in_parent))
    with pytest.raises(ValueError, match="^request 20 failed in the ") as raised:
        fleet(trace, "least-outstanding", setups, workers=3)
    assert _open_fds() == before
    assert raised.value.__traceback__ is not None
    assert not multiprocessing.active_children()


def _room_for(spare: int, open_fds: set[int]) -> int:
    """The descriptor limit under which exactly `spare` more can be opened (new ones take
    the lowest free numbers, each below the limit)."""
    free = [fd for fd in range(max(open_fds) + spare + 1) if fd not in open_fds]
    return free[spare - 1] + 1


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
@pytest.mark.parametrize("spare", [6, 16, 18])
def test_running_out_of_descriptors_is_one_line(spare: int) -> None:
    """5 processes with room for 6, 16 or 18 more descriptors: out in `Peers` (16 ends), in
    child 1's result pipe, in its start (multiprocessing's own pipes); nothing left open."""
    def idle(peers: Peers) -> None:
        raise AssertionError("ran")

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = _open_fds()
    limit = _room_for(spare, {int(fd) for fd in before})
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        with pytest.raises(ValueError) as raised:
            run_lockstep([idle] * 5)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert str(raised.value) == (
        f"workers 5: out of file descriptors starting the simulation processes (this "
        f"process may open {limit}: ulimit -n); use fewer "
        f"workers or raise the limit")
    assert _open_fds() == before
    assert not multiprocessing.active_children()


def test_a_killed_worker_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # mid-run, in the child (only a child takes the parent's word)
    monkeypatch.setattr(fleet_module._Fleet, "take_routed", killed_when(
        fleet_module._Fleet.take_routed, lambda fleet, *_: fleet.next_index == 20))
    with pytest.raises(ChildProcessError) as raised:
        fleet(randomised(1), "least-outstanding", uneven(1), workers=2)
    assert str(raised.value) == ("simulation worker 1 (replicas 2-3) was killed by SIGKILL "
                                 "before sending its records")
    assert not multiprocessing.active_children()


def test_a_peer_gone_mid_trade_is_peer_gone() -> None:
    def leaves(peers: Peers) -> None:
        os._exit(0)  # no answer, no result: the parent reads EOF in the middle of a trade

    def stays(peers: Peers) -> object:
        return peers.gather()

    with pytest.raises(ChildProcessError, match="^simulation worker 1 exited with status 0"):
        run_lockstep([stays, leaves])
    assert not multiprocessing.active_children()
    peers = Peers(2)
    peers.keep(0)  # closes the child's ends, as a dead child leaves them: EOF
    with pytest.raises(PeerGone):
        peers.gather()
    peers.close()


def test_progress_is_reported_as_requests_finish_and_workers_end() -> None:
    trace = randomised(1)
    seen: list[tuple[int, int]] = []
    fleet(trace, "least-outstanding", uneven(1), 2,
          progress=lambda done, n: seen.append((done, n)))
    assert seen[-1] == (len(trace), len(trace))
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)
