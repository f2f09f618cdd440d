"""vLLM's own DP load balancer as an oracle (runs under the oracle's venv): reads a JSON list
of cases from argv[1] and writes each case's chosen engine indices to argv[2].

A case: {"engines": n, "client_count": c, "client_index": i, "events": [...]}, events
{"op": "stats", "counts": [[waiting, running, kv_usage], ...]} (the coordinator's
broadcast, replacing the client's counts), {"op": "route", "id": "r3"} and
{"op": "finish", "id": "r3"}. `DPLBAsyncMPClient.get_core_engine_for_request` and its
finished-request bookkeeping run on a stand-in for the client (the fields they read)."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from vllm.v1.engine.core_client import DPLBAsyncMPClient


def run(case: dict) -> list[int]:
    n, count, index = case["engines"], case["client_count"], case["client_index"]
    engines = [i.to_bytes(2, "little") for i in range(n)]  # vLLM's EngineIdentity
    client = SimpleNamespace(
        reqs_in_flight={}, engine_inflight=Counter(), core_engines=engines,
        client_count=count, eng_start_index=(n * index) // count,
        lb_engines=[[0, 0, 0.0] for _ in range(n)])
    chosen = []
    for ev in case["events"]:
        if ev["op"] == "stats":
            client.lb_engines = [list(c) for c in ev["counts"]]
        elif ev["op"] == "route":
            request = SimpleNamespace(request_id=ev["id"], data_parallel_rank=None,
                                      pooling_params=None)
            engine = DPLBAsyncMPClient.get_core_engine_for_request(client, request)
            chosen.append(engines.index(engine))
        else:  # process_engine_outputs' bookkeeping of a finished request
            engine = client.reqs_in_flight.pop(ev["id"], None)
            if engine is not None:
                client.engine_inflight[engine] -= 1
    return chosen


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps([run(case) for case in cases]))
    sys.stdout.flush()
    os._exit(0)
