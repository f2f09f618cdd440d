"""The run directory, the one format both drivers' results are written in and read from.

    <run>/requests.parquet   one row per request (runtime.records.RequestRecord's columns)
    <run>/steps.parquet      one row per engine step (runtime.records.StepRecord's columns)
    <run>/run.json           every config value, the seed, rt's version, the trace digest

Written atomically (`write_run`: a `.<name>.partial` directory renamed when complete).

A `vllm bench serve --save-result --save-detailed` JSON file also loads as a (client-timed)
run: see `analysis.vllm_bench`.

Writing is deterministic: the same rows give byte-identical parquet files.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

REQUESTS_FILE = "requests.parquet"
STEPS_FILE = "steps.parquet"
RUN_FILE = "run.json"
INTERRUPTED_FILE = "INTERRUPTED"  # in a run directory whose write did not finish


@dataclass(frozen=True)
class Run:
    """A loaded run directory."""

    path: Path
    requests: pd.DataFrame
    steps: pd.DataFrame
    info: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.info.get("name") or self.path.name)


Rows = Sequence[dict[str, Any]] | Mapping[str, Sequence[Any]]  # row dicts, or columns


def write_run(path: Path, requests: Rows, steps: Rows, info: dict[str, Any]) -> None:
    """Write the three files. Tables come as a list of row dicts or as a mapping of column
    name to values.

    Atomic: the files go to `.<name>.partial/` beside `path`, which is renamed to `path`
    once complete (a run already at `path` is replaced), so a reader never sees half a
    run. A write cut short (Ctrl-C, a full disk) leaves the partial directory marked with
    an `INTERRUPTED` file, never a directory named `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".{path.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        _write_table(partial / REQUESTS_FILE, requests)
        _write_table(partial / STEPS_FILE, steps)
        (partial / RUN_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    except BaseException:
        with contextlib.suppress(OSError):
            (partial / INTERRUPTED_FILE).write_text("the write of this run was interrupted\n")
        raise
    if path.exists():
        old = path.parent / f".{path.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        partial.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        partial.rename(path)


def _write_table(path: Path, rows: Rows) -> None:
    if isinstance(rows, Mapping):
        table = pa.table({name: list(values) for name, values in rows.items()})
    else:
        table = pa.Table.from_pylist(list(rows)) if rows else pa.table({})
    pq.write_table(table, path, compression="zstd")


def load_run(path: Path) -> Run:
    """Read a run directory, or a `vllm bench serve --save-detailed` result JSON file
    (`analysis.vllm_bench`); a missing or malformed one raises ValueError naming the file."""
    if path.is_file() and path.suffix == ".json":
        from analysis.vllm_bench import load_vllm_bench

        return load_vllm_bench(path)
    if (path / INTERRUPTED_FILE).exists():
        raise ValueError(f"{path}: the write of this run was interrupted")
    for name in (REQUESTS_FILE, STEPS_FILE, RUN_FILE):
        if not (path / name).is_file():
            raise ValueError(f"{path}: not a run directory ({name} is missing)")
    try:
        info = json.loads((path / RUN_FILE).read_text())
        requests = pq.read_table(path / REQUESTS_FILE).to_pandas()
        steps = pq.read_table(path / STEPS_FILE).to_pandas()
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise ValueError(f"{path}: unreadable run directory: {exc}") from exc
    return Run(path, requests, steps, info)


def request_columns(path: Path) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """A run's requests as columns (name -> values) and its run.json; `load_run`'s errors."""
    run = load_run(path)
    return {name: run.requests[name].tolist() for name in run.requests.columns}, run.info


def finished_run(path: Path, **expected: Any) -> Run | None:
    """The run at `path` if it is complete (runs are written atomically, so a directory under
    the run's name is) and its run.json holds `expected`'s values, else None: an interrupted
    sweep, run again into the same directory, reuses the points it finished."""
    if not (path / RUN_FILE).is_file():
        return None
    try:
        run = load_run(path)
    except ValueError:
        return None
    wanted = json.loads(json.dumps(expected))
    return run if all(run.info.get(k) == v for k, v in wanted.items()) else None


def rt_version() -> str:
    """rt's installed version, or "unknown" when it runs from a plain checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rt")
    except PackageNotFoundError:
        return "unknown"


def run_info(kind: str, name: str, trace: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
    """run.json's head, the same for every driver: the kind of run, rt's version, the run's
    name and the trace's identity ({"name", "requests", "digest"}), then `fields`."""
    return {"kind": kind, "rt_version": rt_version(), "name": name, "trace": dict(trace),
            **fields}


def save_result(path: Path, kind: str, trace: Mapping[str, Any], result: Any,
                describe: Mapping[str, Any], **extra: Any) -> Run:
    """Write a driver's result (`runtime.records.RunResult`: request records, step columns,
    wall time, prefix-cache counts) as a run directory, with `describe` (every config value)
    and `extra` in run.json, and read it back."""
    info = run_info(kind, path.name, trace, wall_s=round(result.wall_s, 3), **extra,
                    prefix_cache={"queries": result.prefix_cache_queries,
                                  "hits": result.prefix_cache_hits}, **describe)
    write_run(path, [r.to_row() for r in result.requests], result.step_columns, info)
    return load_run(path)
