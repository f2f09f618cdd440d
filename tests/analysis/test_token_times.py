"""Token times streamed from requests.parquet (`rt simulate`'s report without the token-time
frame column) give the same metrics and the same printed text as the loaded frame."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from analysis import rundir
from analysis.console import REPORT_STEP_COLUMNS, show_run, show_written_run
from analysis.metrics import benchmark_metrics, completed_mask, inter_token_latencies
from analysis.rundir import REQUESTS_FILE, load_run, run_info, write_run
from analysis.token_times import file_chunks, frame_chunks, gather_gaps
from runtime.records import RunSummary

from .conftest import HAND_STEPS, request

SUMMARY = RunSummary(num_steps=14, prefix_cache_queries=30, prefix_cache_hits=5, wall_s=1.0)


def _printed(path: Path, written: bool) -> list[str]:
    lines: list[str] = []
    if written:
        show_written_run(path, SUMMARY, [50.0, 99.0], 2.0, lines.append, lines.append)
    else:
        show_run(load_run(path), SUMMARY, [50.0, 99.0], 2.0, lines.append, lines.append)
    return lines


def test_hand_run_prints_the_same_without_its_token_times(hand_run: Path) -> None:
    assert _printed(hand_run, written=True) == _printed(hand_run, written=False)
    lean = load_run(hand_run, token_times=False, step_columns=REPORT_STEP_COLUMNS)
    assert "token_times_s" not in lean.requests.columns
    assert list(lean.steps.columns) == ["kv_usage"] and len(lean.steps) == len(HAND_STEPS)
    assert lean.requests.equals(load_run(hand_run).requests.drop(columns="token_times_s"))


def _random_run(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        arrival = i * 0.3
        tokens = [arrival + 0.05 + 0.01 * k + rng.random() * 0.01 for k in
                  range(rng.choice([0, 1, 2, 7, 40]))]
        status = "FINISHED_LENGTH_CAPPED" if tokens and rng.random() < 0.9 else "FINISHED_ABORTED"
        rows.append(request(f"r{i}", arrival, tokens, status=status))
    write_run(path, rows, HAND_STEPS, run_info("simulate", path.name, {
        "name": "random", "requests": n, "digest": "r"}, prefix_cache={"queries": 30, "hits": 5}))


def test_many_row_groups_give_identical_metrics(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rundir, "_BATCH_ROWS", 3)
    monkeypatch.setattr(rundir, "_GROUP_ROWS", 6)  # row groups of 6 rows
    path = tmp_path / "run"
    _random_run(path, 100, seed=1)
    assert pq.ParquetFile(path / REQUESTS_FILE).num_row_groups == 17
    full = load_run(path).requests
    lean = load_run(path, token_times=False).requests
    chunks = file_chunks(path / REQUESTS_FILE, completed_mask(lean).to_numpy(dtype=bool))
    assert np.array_equal(inter_token_latencies(lean, chunks), inter_token_latencies(full))
    done = full[completed_mask(full)]
    assert inter_token_latencies(full).size == sum(max(len(t) - 1, 0)
                                                   for t in done["token_times_s"])
    assert benchmark_metrics(lean, (50, 90, 99.9), chunks) == benchmark_metrics(
        full, (50, 90, 99.9))
    assert _printed(path, written=True) == _printed(path, written=False)


def test_runs_without_any_token(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    write_run(path, [request("a", 0.0, [], status="FINISHED_ABORTED")], HAND_STEPS,
              run_info("simulate", "empty", {"name": "a", "requests": 1, "digest": "a"}))
    every = np.array([True])  # the column's type is list<null>: read as float64
    assert [(flat.dtype, flat.size, lengths.tolist()) for flat, lengths in
            file_chunks(path / REQUESTS_FILE, every)()] == [(np.float64, 0, [0])]
    done = np.array([False])
    lean = load_run(path, token_times=False).requests
    assert benchmark_metrics(lean, (99,), file_chunks(path / REQUESTS_FILE, done)) == \
        benchmark_metrics(load_run(path).requests)


def test_a_mask_of_another_length_is_an_error(hand_run: Path) -> None:
    with pytest.raises(ValueError, match="4 rows of token times for 5 requests"):
        list(file_chunks(hand_run / REQUESTS_FILE, np.ones(5, dtype=bool))())


def test_gaps_grow_past_their_capacity(hand_run: Path) -> None:
    done = load_run(hand_run).requests.iloc[:3]
    assert gather_gaps(frame_chunks(done), 0).tolist() == pytest.approx([50, 100, 20])
    assert gather_gaps(frame_chunks(done), 1).tolist() == pytest.approx([50, 100, 20])
