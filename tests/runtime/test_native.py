"""The compiled core (setup.py, `RT_COMPILE=1`) and the pure one write the same records.
Without a compiled build only the pure side is checked (the comparison is skipped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from runtime.native import implementation

ROOT = Path(__file__).resolve().parents[2]
PURE = ROOT / "tests" / "runtime" / "pure_python.py"
# small runs that cross the pool's paths: preemptions with prefix hits and priorities, and a
# fleet whose router reads the pools' KV events
RUNS = {
    "preempt": ["--first-n", "300", "--time-scale", "0.1", "--num-gpu-blocks-override", "400",
                "--policy", "priority"],
    "kv_events": ["--first-n", "200", "--replicas", "2", "--router", "dynamo-kv",
                  "--time-scale", "0.25"],
}


def _simulate(tmp_path: Path, name: str, pure: bool) -> Path:
    out = tmp_path / f"{name}-{'pure' if pure else 'default'}"
    rt = [sys.executable, str(PURE)] if pure else [sys.executable, str(ROOT / "cli.py")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run([*rt, "simulate", *RUNS[name], "--result-dir", str(out)], check=True,
                   cwd=ROOT, env=env, capture_output=True, timeout=600)
    return out


def test_hidden_extensions_run_pure(tmp_path: Path) -> None:
    out = _simulate(tmp_path, "preempt", pure=True)
    assert json.loads((out / "run.json").read_text())["runtime"] == "pure"


@pytest.mark.skipif(implementation() == "pure", reason="no compiled build (RT_COMPILE=1)")
@pytest.mark.parametrize("name", sorted(RUNS))
def test_compiled_records_equal_pure(tmp_path: Path, name: str) -> None:
    pure, compiled = _simulate(tmp_path, name, True), _simulate(tmp_path, name, False)
    info = json.loads((compiled / "run.json").read_text())
    assert info["runtime"] == "compiled"
    for table in ("requests.parquet", "steps.parquet"):
        assert pd.read_parquet(pure / table).equals(pd.read_parquet(compiled / table)), table
