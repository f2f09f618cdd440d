"""Client-timed endpoint runs (`rt replay --endpoint`, run.json `timing: "client"`): rt's
block says engine-side attribution is unavailable instead of printing NaN rows, and
`rt compare` labels such runs by kind and endpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from analysis.compare import run_labels
from analysis.console import CLIENT_TIMING_NOTE, is_client_timed, rt_block
from analysis.rundir import Run

SIM_INFO = {"kind": "simulate", "name": "sim", "engine_args": {"block_size": 16,
                                                              "max_num_seqs": 256}}
ENDPOINT_INFO = {"kind": "endpoint", "name": "ep", "timing": "client",
                 "endpoint": {"url": "http://127.0.0.1:8000/v1/completions"}}


def _run(info: dict[str, Any]) -> Run:
    return Run(Path(str(info["name"])), pd.DataFrame(), pd.DataFrame(), info)


def test_rt_block_of_a_client_timed_run_has_a_note_not_nan_rows() -> None:
    assert is_client_timed(ENDPOINT_INFO) and not is_client_timed(SIM_INFO)
    text = rt_block(pd.DataFrame(), pd.DataFrame(), 0.25, client_timing=True)
    assert CLIENT_TIMING_NOTE in text
    assert "nan" not in text.lower()
    assert "25.00" in text


def test_compare_labels_an_endpoint_run_by_kind_and_endpoint() -> None:
    labels = run_labels([_run(SIM_INFO), _run(ENDPOINT_INFO)])
    assert labels == ["simulate", "endpoint 127.0.0.1:8000"]
    assert not any("None" in label for label in labels)


def test_compare_labels_two_endpoint_runs_apart() -> None:
    other = {**ENDPOINT_INFO, "name": "ep2"}
    labels = run_labels([_run(SIM_INFO), _run(ENDPOINT_INFO), _run(other)])
    assert labels[0] == "simulate (sim)"
    assert labels[1:] == ["endpoint 127.0.0.1:8000 (ep)", "endpoint 127.0.0.1:8000 (ep2)"]


def test_labels_of_same_kind_runs_still_name_the_differing_flag() -> None:
    other = {**SIM_INFO, "name": "sim2", "engine_args": {"block_size": 32,
                                                          "max_num_seqs": 256}}
    assert run_labels([_run(SIM_INFO), _run(other)]) == ["block_size=16", "block_size=32"]
