"""`rt bench serve` that also pickles each run's per-request records, the server path's and
the simulated twin's, to $DUMP ({"server": [...], "sim": [...]}, `RequestRecord`s): the input
of shift.py. A measuring aid for docs/serve.md ("The load client's share at 200 streams"),
not part of rt.

    DUMP=run.pkl PYTHONPATH=$PWD python docs/tools/capture_slot/bench_dump.py \\
        bench serve --client capture --concurrency 200 --num-prompts 1000 -o run.json
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any

import backends.bench.serve_run as serve_run
from cli import main

_compare = serve_run.compare


def _dumping_compare(trace: Any, load: Any, simulated: Any) -> Any:
    with open(os.environ["DUMP"], "wb") as out:
        pickle.dump({"server": load.endpoint.requests, "sim": list(simulated)}, out)
    return _compare(trace, load, simulated)


serve_run.compare = _dumping_compare  # type: ignore[assignment]
sys.argv = ["rt", *sys.argv[1:]]
main()
