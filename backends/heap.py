"""The garbage collector around a timed stretch of a process (a replay, a calibration grid).

A full collection scans every object alive: in the middle of a timed run it is a stall no
cost model should learn (a real engine's model, torch and transformers are ~430 k objects:
210-320 ms; the `rt fidelity --fleet` client's middle collections stalled its event loop
9-43 ms, a full one 151 ms, read as the TTFT of the requests in flight). So the heap alive at
the start is collected, then frozen out of every collection until the block ends; the
collections that remain walk only what the timed stretch allocates, and every generation
keeps collecting it (no garbage held to the end).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect, then freeze every object alive now until the block ends (then unfrozen).
    A caller that disabled the collector or froze objects of its own keeps its settings:
    the block then runs as is."""
    if not gc.isenabled() or gc.get_freeze_count() > 0:
        yield
        return
    try:
        gc.collect()
        gc.freeze()
        yield
    finally:
        gc.unfreeze()
