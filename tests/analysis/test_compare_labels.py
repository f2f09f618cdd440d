"""`rt compare`'s legend labels name configuration, not how the core ran: `run.json`'s
`runtime` ("compiled"/"pure", #16; absent in earlier runs) is noise like `wall_s`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from analysis.compare import differing_keys, run_labels
from analysis.rundir import Run


def _run(name: str, info: dict[str, Any]) -> Run:
    return Run(Path(name), pd.DataFrame(), pd.DataFrame(), {"name": name, **info})


def test_runtime_alone_does_not_label_runs() -> None:
    before = {"kind": "sim", "engine_args": {"max_num_seqs": 64}}  # a run from before #16
    after = {**before, "runtime": "pure"}
    assert differing_keys([before, after]) == []
    assert run_labels([_run("old", before), _run("new", after)]) == ["old", "new"]


def test_runtime_beside_a_flag_leaves_only_the_flag() -> None:
    runs = [_run("a", {"runtime": "compiled", "engine_args": {"max_num_seqs": 64}}),
            _run("b", {"runtime": "pure", "engine_args": {"max_num_seqs": 128}})]
    assert run_labels(runs) == ["max_num_seqs=64", "max_num_seqs=128"]


def test_one_engine_against_a_fleet_is_labelled_by_replicas_and_router() -> None:
    # run.json's fleet section as `rt simulate --replicas 4 --router llm-d` writes it; the
    # alphabetical first keys (kv_event_delay_ms, pools) said nothing a user chose
    fleet = {"kv_event_delay_ms": 0.0, "pools": [{"name": "default", "count": 4}],
             "replicas": 4, "router": "llm-d", "router_args": {}, "router_refresh_ms": 50.0,
             "routers": 1, "routing_latency_ms": 0.0}
    runs = [_run("one", {"kind": "sim"}), _run("four", {"kind": "sim", "fleet": fleet})]
    assert run_labels(runs) == ["replicas=None, router=None", "replicas=4, router=llm-d"]
