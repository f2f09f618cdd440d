"""A diagnostic (fid15d): with this directory on PYTHONPATH and GC_PROBE_DIR set, every
Python process started (the client, the router, each replica's API server and engine) logs
each collection of the middle and oldest generations, and every 200th of the youngest, to
GC_PROBE_DIR/<pid>.log: wall time, generation, duration, objects collected, objects frozen.

    GC_PROBE_DIR=/tmp/gc PYTHONPATH=$PWD:$PWD/docs/measure/gc_probe python cli.py fidelity ...
"""

import gc
import os
import sys
import time

_DIR = os.environ.get("GC_PROBE_DIR")
if _DIR:
    _started = [0.0]
    _counts = [0, 0, 0]
    _log = open(os.path.join(_DIR, f"{os.getpid()}.log"), "a", buffering=1)  # noqa: SIM115
    _log.write(f"# {time.time():.3f} argv {' '.join(sys.argv)[:200]}\n")

    def _probe(phase: str, info: dict) -> None:
        if phase == "start":
            _started[0] = time.perf_counter()
            return
        took = time.perf_counter() - _started[0]
        generation = info["generation"]
        _counts[generation] += 1
        if generation or _counts[0] % 200 == 0:
            _log.write(f"{time.time():.3f} gen{generation} {took * 1e3:.3f}ms collected "
                       f"{info['collected']} frozen {gc.get_freeze_count()}\n")

    gc.callbacks.append(_probe)
