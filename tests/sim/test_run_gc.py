"""The collector around a simulation run (`sim.run_gc`): the heap frozen and only the
youngest generation collected during the run, the run's cyclic garbage freed on return,
everything as the caller had it afterwards; and the simulators leave no KV block behind."""

from __future__ import annotations

import gc
import weakref

import pytest

from runtime.free_block_queue import KVCacheBlock
from runtime.router import make_policy
from sim.engine_args import EngineArgs, build_setup
from sim.fleet import simulate_fleet
from sim.run_gc import run_with_gc
from sim.simulator import simulate
from workloads import default_trace
from workloads.trace import Trace

NEVER = 1 << 30


@pytest.fixture
def collector():
    """Restores the collector's state whatever a test does to it."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    gc.collect()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()
    if enabled:
        gc.enable()


class Node:
    """A cycle of one: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_frozen_young_only_then_garbage_freed_and_restored(collector: None) -> None:
    gc.enable()
    gc.set_threshold(700, 10, 10)
    before = Node()  # alive before the run: frozen during it
    seen: dict[str, object] = {}
    dropped: list[weakref.ref[Node]] = []

    def run() -> int:
        seen["thresholds"] = gc.get_threshold()
        seen["enabled"] = gc.isenabled()
        seen["before frozen"] = gc.get_freeze_count() > 0 and not _in_generations(before)
        dropped.append(weakref.ref(Node()))  # the run's cyclic garbage
        return 3

    assert run_with_gc(run) == 3
    assert seen == {"thresholds": (700, NEVER, NEVER), "enabled": True, "before frozen": True}
    assert dropped[0]() is None  # freed on return, not at some later full collection
    assert gc.get_threshold() == (700, 10, 10) and gc.isenabled()
    assert gc.get_freeze_count() == 0 and _in_generations(before)


def _in_generations(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_restored_when_the_run_raises(collector: None) -> None:
    gc.set_threshold(500, 5, 5)

    def run() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_with_gc(run)
    assert gc.get_threshold() == (500, 5, 5) and gc.isenabled()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("caller", ["froze", "disabled"])
def test_a_caller_managing_the_collector_keeps_it(collector: None, caller: str) -> None:
    """Nothing frozen, thawed or re-tuned for the caller. Told by where two objects are, not
    by the freeze count alone: the count falls whenever a frozen object dies (its last
    reference dropped by young garbage that a collection frees, or by another thread), at any
    allocation (a full suite run saw 703263, then 703261 inside the run)."""
    gc.set_threshold(500, 5, 5)
    old = Node()  # frozen by a caller that freezes
    if caller == "froze":
        gc.freeze()
    else:
        gc.disable()
    young = Node()  # made after the caller's freeze: in the generations, and left there
    frozen = gc.get_freeze_count()
    seen = run_with_gc(lambda: (gc.get_threshold(), gc.get_freeze_count(),
                                _in_generations(old), _in_generations(young)))
    assert seen[0] == (500, 5, 5) and seen[1] <= frozen  # no freeze added
    assert seen[2:] == (caller == "disabled", True)
    assert 0 < gc.get_freeze_count() <= frozen if caller == "froze" else \
        gc.get_freeze_count() == 0
    assert (_in_generations(old), _in_generations(young)) == (caller == "disabled", True)
    assert gc.isenabled() == (caller == "froze")


def _blocks_alive() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is KVCacheBlock)


def test_repeated_simulations_leave_no_kv_block_behind(collector: None) -> None:
    """A KV pool is a doubly linked list: without the end collection each run's ~thousands
    of blocks would wait for a full collection, and a sweep would hold several pools."""
    setup = build_setup(EngineArgs(), "llama-3.1-8b", "h200")
    trace = Trace(tuple(default_trace())[:200])
    first = simulate(trace, setup.config, setup.cost_model)
    assert _blocks_alive() == 0
    for _ in range(2):
        again = simulate(trace, setup.config, setup.cost_model)
        assert _blocks_alive() == 0
        assert again.requests == first.requests
    fleet = simulate_fleet(trace, [setup] * 3, make_policy("round-robin", [], 0))
    assert _blocks_alive() == 0 and len(fleet.requests) == len(trace)


@pytest.mark.parametrize("router", ["least-outstanding", "power-of-two"])
def test_finished_pools_are_released_so_refcounting_frees_their_blocks(
        collector: None, router: str) -> None:
    """With the collector off, nothing but reference counting frees a run: its pools'
    blocks must not be left in the free queue's cycles for the end collection's walk
    (~0.6 us a block; 64 concurrent replicas make 1.6M). Left alive: each pool's null block
    and its queue's two sentinels (a cycle of their own)."""
    setup = build_setup(EngineArgs(), "llama-3.1-8b", "h200")
    trace = Trace(tuple(default_trace())[:200])
    gc.disable()
    simulate(trace, setup.config, setup.cost_model)
    assert sorted(b.block_id for b in _all_blocks()) == [-1, -1, 0]
    simulate_fleet(trace, [setup] * 3, make_policy(router, [], 0))
    assert sorted(b.block_id for b in _all_blocks()) == [-1] * 8 + [0] * 4


def _all_blocks() -> list[KVCacheBlock]:
    return [o for o in gc.get_objects() if issubclass(type(o), KVCacheBlock)]
