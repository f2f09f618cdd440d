"""The cyclic garbage collector around one simulation run: one engine (`sim.simulator`), a
fleet (`sim.fleet`), P/D (`sim.pd`) or an autoscaled fleet (`sim.autoscale`).

A run allocates many long-lived objects (requests, records, KV blocks: ~57k
`KVCacheBlock`s for one engine on the Azure conversation excerpt, ~253k for 16 replicas on
the fleet bench) and no cyclic garbage while it runs (no collection of any generation found
any on the default run, Mooncake, ShareGPT, round-robin, least-outstanding or dynamo-kv
fleets). Python's collector walked them again in its middle and full generations, and a
full collection also walks everything alive before the run (modules, the trace): 6-11% of
a run's time for nothing.

So during the run the heap as it was is frozen (`gc.freeze`) and only the youngest
generation is collected (cycles that die young are still freed; frozen and older objects
are still freed by reference counting). When the run returns, its simulation objects are
unreferenced: one collection, which walks only what the run allocated, frees them before the
heap is thawed. A sweep of many runs in one process thus holds one run's pools at a time.
Records are unaffected.

A KV pool's free queue is a doubly linked list: a cycle per block, which only that final
walk would free, at ~0.6 us a block (cold, scattered blocks; 64 replicas behind a router
that decides at each arrival make 1.6M on the fleet bench: ~1 s). So a run ends by
releasing its pools (`release_pools`: ~0.2 us a block, unlinked, then freed by reference
counting as the run's objects go), which leaves the walk little to do.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from runtime.kv_cache_manager import KVCacheManager

R = TypeVar("R")

_NEVER = 1 << 30  # collections of a younger generation before an older one's: never in a run


def run_with_gc(run: Callable[[], R]) -> R:
    """`run()` with the collector as the module docstring says; `run` must hold the
    simulation in its own frame, so that it is garbage once `run` returns. Thresholds are
    restored on return. A caller that disabled the collector or froze objects of its own
    manages it: `run()` then runs as is."""
    if not gc.isenabled() or gc.get_freeze_count() > 0:
        return run()
    thresholds = gc.get_threshold()
    try:  # set inside: an interrupt between the calls still restores them
        gc.freeze()
        gc.set_threshold(thresholds[0], _NEVER, _NEVER)
        return run()
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
        gc.unfreeze()


def release_pools(managers: Iterable[KVCacheManager]) -> None:
    """Release each finished run's KV pool (`KVCacheManager.release_blocks`: its blocks
    unlinked, so reference counting frees them with the run, not the collector; the module
    docstring). A pool with a block still in use is left to the collector."""
    for manager in managers:
        if not manager.block_pool.num_in_use:
            manager.release_blocks()
