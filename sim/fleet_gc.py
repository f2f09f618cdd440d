"""The cyclic garbage collector around a fleet run (`sim.fleet.simulate_fleet`).

A fleet's KV pools are linked `KVCacheBlock`s that live as long as the run: 16 replicas on
the bench's trace build ~253k of them (each pool builds its never-used blocks as
allocations first reach them, `runtime.free_block_queue`), against ~57k for one engine on the
whole trace. The collector can free none of them, yet walked them again in its middle and
full generations after their first young collection: on the bench, 32 middle-generation
collections (0.04-0.10 s together) and 2 full ones (0.06-0.20 s) in a ~1.3 s run; one
engine has no full collection, its pool being small beside what the imports left behind.
On the bench's runs (round-robin, dynamo-kv, least-outstanding) the run's collections
find no garbage.

So the fleet is built with the collector paused, everything then alive is frozen
(`gc.freeze`), and during the run only the youngest generation is collected: cyclic
garbage that survives one collection waits for the run's end (frozen and surviving objects
are still freed by reference counting). Records are unaffected; everything is restored on
return, a caller's own freeze and thresholds included.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_NEVER = 1 << 30  # collections of a younger generation before an older one's: never in a run


def built_and_run(build: Callable[[], T], run: Callable[[T], R]) -> R:
    """`run(build())` with the collector as the module docstring says. Thresholds, enabled
    state and a caller's frozen objects are restored on return; the full collection the
    run's young collections have made due then comes at the caller's next allocations."""
    enabled, caller_froze = gc.isenabled(), gc.get_freeze_count() > 0
    gc.disable()
    try:
        built = build()
        gc.freeze()
    finally:
        if enabled:
            gc.enable()
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], _NEVER, _NEVER)
    try:
        return run(built)
    finally:
        gc.set_threshold(*thresholds)
        if not caller_froze:  # unfreeze() thaws everything, a caller's frozen objects too
            gc.unfreeze()
