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
