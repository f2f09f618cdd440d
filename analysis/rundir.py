"""The run directory, the one format both drivers' results are written in and read from.

    <run>/requests.parquet   one row per request (runtime.records.RequestRecord's columns)
    <run>/steps.parquet      one row per engine step (runtime.records.StepRecord's columns)
    <run>/run.json           every config value, the seed, rt's version, the trace digest
                             (its head and the sections readers use: `analysis.run_json`)

Written atomically (`write_run`: a `.<name>.partial` directory renamed when complete).

A `vllm bench serve --save-result --save-detailed` JSON file also loads as a (client-timed)
run: see `analysis.vllm_bench`.

Writing is deterministic: the same rows give byte-identical parquet files.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import tempfile
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from analysis.run_json import check_run_info

REQUESTS_FILE = "requests.parquet"
STEPS_FILE = "steps.parquet"
RUN_FILE = "run.json"
INTERRUPTED_FILE = "INTERRUPTED"  # in a run directory whose write did not finish
RUN_FILES = (RUN_FILE, REQUESTS_FILE, STEPS_FILE, INTERRUPTED_FILE)  # a run directory's own


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


class RowDicts(Protocol):
    """Row dicts that can be walked more than once (`_write_table` reads them twice: the
    schema, then the rows): a list, or `_RecordRows`, which makes them afresh each pass. A
    one-shot iterator (a generator) would write the schema and no rows, so it is no
    `RowDicts` (it has no length)."""

    def __iter__(self) -> Iterator[dict[str, Any]]: ...

    def __len__(self) -> int: ...


Rows = RowDicts | Mapping[str, Sequence[Any]]  # row dicts, or columns


def check_writable(path: Path, what: str) -> None:
    """ValueError (naming `what` and the path) unless a file can be made beside `path`, in
    the nearest directory of its parents that exists (the writers make the rest): not a
    file there, no permission, a read-only or virtual file system. Found only by the write
    before, after the run or the fit (`--result-dir /proc/x`, `-o trace.jsonl/p.json`). A
    nameless temporary file is made and removed."""
    nearest = next(p for p in (path.parent, *path.parent.parents) if p.exists())
    if not nearest.is_dir():
        raise ValueError(f"{what} {path}: {nearest} is a file, not a directory (nothing was "
                         "written)")
    try:
        with tempfile.TemporaryFile(dir=nearest):
            pass
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot write in {nearest} ({e.strerror}; nothing "
                         "was written)") from None


def check_run_path(path: Path) -> None:
    """ValueError (naming the path) unless a run may be written at `path`: nothing there,
    an empty directory, or a run directory (which the new run replaces), in a directory that
    can be written (`check_writable`). A file, or a directory holding anything else ("/", a
    home directory), is never replaced."""
    check_writable(path, "result directory")
    if not path.exists():
        return
    if not path.is_dir():
        raise ValueError(f"result directory {path}: a file is there, not a run directory "
                         "(nothing was written)")
    if not path.resolve().name or (any(path.iterdir()) and not (path / RUN_FILE).is_file()):
        raise ValueError(f"result directory {path}: holds other files, not a run "
                         f"directory ({RUN_FILE} is missing); give a new or empty one")


def check_output_file(path: Path | None, option: str, inputs: Sequence[Path | None] = ()
                      ) -> None:
    """ValueError (naming `option` and the path) unless a command may write a file at `path`
    (None: not asked for): never onto a directory, never onto one of a run directory's own
    files (`rt report RUN --html RUN/run.json` once replaced the run it reported), and never
    onto one of the command's `inputs` (`rt trace convert T T --first-n 1` once left T one
    request). Checked before any work; nothing is written."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{option} {path}: a directory is there, not a file (nothing was "
                         "written)")
    check_writable(path, option)
    for source in inputs:
        if source is not None and path.exists() and source.exists() \
                and path.samefile(source):
            raise ValueError(f"{option} {path}: it is the input {source}, which it would "
                             "replace (nothing was written); give another path")
    if path.name in RUN_FILES and (path.parent / RUN_FILE).is_file():
        raise ValueError(f"{option} {path}: a file of run directory {path.parent}, which it "
                         "would break (nothing was written); give another path")


def check_runs_root(path: Path, table: str) -> None:
    """ValueError (naming the path) unless `path` may hold a sweep's or plan's run
    directories: nothing there, an empty directory, or one an earlier sweep or plan left (run
    directories, or its summary `table`, e.g. "plan.csv" of a plan whose every shape was
    pruned), in a directory that can be written (`check_writable`); never a file, "/" or a
    directory of other things."""
    check_writable(path, "result directory")
    if not path.exists():
        return
    if not path.is_dir():
        raise ValueError(f"result directory {path}: a file is there (nothing was written)")
    entries = [e for e in path.iterdir() if not e.name.endswith(".partial")]  # interrupted
    ours = (path / table).is_file() or any(
        (entry / RUN_FILE).is_file() for entry in entries if entry.is_dir())
    if not path.resolve().name or (entries and not ours):
        raise ValueError(f"result directory {path}: holds other files and no run directory; "
                         "give a new or empty one (or one to resume)")


def write_run(path: Path, requests: Rows, steps: Rows, info: dict[str, Any]) -> None:
    """Write the three files. Tables come as a list of row dicts or as a mapping of column
    name to values.

    Atomic: the files go to `.<name>.partial/` beside `path`, which is renamed to `path`
    once complete (a run already at `path` is replaced; anything else there is refused,
    `check_run_path`), so a reader never sees half a run. A write cut short (Ctrl-C, a
    full disk) leaves the partial directory marked with an `INTERRUPTED` file, never a
    directory named `path`."""
    check_run_path(path)
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
    """Columns go to arrow in one table (typed arrays without a copy); rows (`RowDicts`,
    read twice) in batches of `_BATCH_ROWS`, so the rows are
    never all converted at once."""
    if isinstance(rows, Mapping):
        pq.write_table(pa.table({name: _column(values) for name, values in rows.items()}),
                       path, compression="zstd")
        return
    schema = _rows_schema(rows)
    if schema is None:
        pq.write_table(pa.table({}), path, compression="zstd")
        return
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        group: list[pa.Table] = []
        for batch in _batches(rows):  # rows as Python objects: a few MB at a time
            group.append(pa.Table.from_pylist(batch, schema=schema))
            if len(group) * _BATCH_ROWS >= _GROUP_ROWS:
                writer.write_table(pa.concat_tables(group))
                group.clear()
        if group:
            writer.write_table(pa.concat_tables(group))


_BATCH_ROWS = 4_096  # rows converted at once (a row's token times are Python floats)
_GROUP_ROWS = 65_536  # rows per parquet row group (arrow memory, 8 bytes a token time)


def _batches(rows: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    iterator = iter(rows)
    while batch := list(itertools.islice(iterator, _BATCH_ROWS)):
        yield batch


def _rows_schema(rows: Iterable[dict[str, Any]]) -> pa.Schema | None:
    """The schema one `Table.from_pylist` of all the rows would infer (a column's type over
    every row: all-None null, ints and floats double), from the batches' own schemas."""
    schemas = [pa.Table.from_pylist(batch).schema for batch in _batches(rows)]
    if not schemas:
        return None
    return pa.unify_schemas(schemas, promote_options="permissive")


def _column(values: Sequence[Any]) -> pa.Array:
    """An arrow column: a typed array ('d' or 'q') without a copy, a list by inference."""
    if isinstance(values, array) and values.typecode in _NUMPY_TYPES and len(values):
        return pa.array(np.frombuffer(values, dtype=_NUMPY_TYPES[values.typecode]))
    return pa.array(list(values))


_NUMPY_TYPES = {"d": np.float64, "q": np.int64}


def load_run(path: Path, *, token_times: bool = True,
             step_columns: Sequence[str] | None = None) -> Run:
    """Read a run directory, or a `vllm bench serve --save-detailed` result JSON file
    (`analysis.vllm_bench`); a missing or malformed one raises ValueError naming the file.

    `token_times=False` leaves out requests' `token_times_s` (8 bytes a token and an array
    object a request: most of a long run's frames; `analysis.token_times.file_chunks` reads
    them in batches of 8,192 rows); `step_columns` reads those columns of steps.parquet only
    (the ones it has). Both apply to run directories only."""
    if path.is_file() and path.suffix == ".json":
        from analysis.vllm_bench import load_vllm_bench

        return load_vllm_bench(path)
    if (path / INTERRUPTED_FILE).exists():
        raise ValueError(f"{path}: the write of this run was interrupted")
    for name in (REQUESTS_FILE, STEPS_FILE, RUN_FILE):
        if not (path / name).is_file():
            raise ValueError(f"{path}: not a run directory ({name} is missing)")
    info = _read_info(path)
    reading = REQUESTS_FILE  # the file an error is in
    try:
        requests = _read_frame(path / REQUESTS_FILE,
                               lambda name: token_times or name != "token_times_s")
        reading = STEPS_FILE
        steps = _read_frame(path / STEPS_FILE,
                            lambda name: step_columns is None or name in step_columns)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise ValueError(f"{path}: unreadable run directory: {reading}: {exc}") from exc
    return Run(path, requests, steps, info)


def _read_info(path: Path) -> dict[str, Any]:
    """run.json of the run directory `path`, checked (`analysis.run_json.check_run_info`);
    ValueError naming the directory and the file (once unnamed: "Expecting value: ...")."""
    try:
        info = json.loads((path / RUN_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable run directory: {RUN_FILE}: {exc}") from exc
    if not isinstance(info, dict):
        raise ValueError(f"{path}: unreadable run directory: {RUN_FILE}: holds "
                         f"{type(info).__name__}, not a JSON object")
    return check_run_info(info, path / RUN_FILE)


def source_run_info(path: Path) -> dict[str, Any] | None:
    """The checked run.json (`_read_info`) of the run directory `path` is, or holds (its
    steps.parquet); None where there is none: a bare steps.parquet, a vLLM bench result
    file, a path that is not there (its reader says so). ValueError naming the file, or the
    directory when its write was interrupted."""
    if not path.exists() or (path.is_file() and path.suffix == ".json"):  # a vLLM file
        return None
    directory = path if path.is_dir() else path.parent
    if not (directory / RUN_FILE).is_file():
        return None
    if (directory / INTERRUPTED_FILE).exists():
        raise ValueError(f"{directory}: the write of this run was interrupted")
    return _read_info(directory)


def _read_frame(path: Path, wanted: Callable[[str], bool]) -> pd.DataFrame:
    """The `wanted` columns of a parquet file as a frame; arrow's buffers are freed column
    by column as pandas takes them over and handed back to the OS after (500 k requests:
    1.27 GB held instead of 1.91)."""
    names = pq.read_schema(path).names
    columns = [name for name in names if wanted(name)]
    frame = pq.read_table(path, columns=None if len(columns) == len(names) else columns
                          ).to_pandas(self_destruct=True)
    pa.default_memory_pool().release_unused()
    return frame


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


class _RecordRows:
    """Request records as row dicts, made afresh at each pass (never all at once)."""

    def __init__(self, records: Sequence[Any]) -> None:
        self.records = records

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (record.to_row() for record in self.records)

    def __len__(self) -> int:
        return len(self.records)


def rt_version() -> str:
    """rt's installed version; from a plain checkout (PYTHONPATH, as `.ci/gpu` runs on a lent
    GPU), the version in the pyproject.toml beside this package; else "unknown"."""
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rt")
    except PackageNotFoundError:
        pass
    try:
        with (Path(__file__).resolve().parents[1] / "pyproject.toml").open("rb") as file:
            project = tomllib.load(file).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return "unknown"
    return str(project.get("version") or "unknown") if project.get("name") == "rt" \
        else "unknown"


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
    write_result(path, kind, trace, result, describe, **extra)
    return load_run(path)


def write_result(path: Path, kind: str, trace: Mapping[str, Any], result: Any,
                 describe: Mapping[str, Any], **extra: Any) -> None:
    """`save_result` without the read-back: a caller that drops `result` (keeping
    `result.summary()`) before `load_run(path)` never holds the records twice (the
    records and step columns of a 1 M-request run are ~2 GB, the frames as much again)."""
    info = run_info(kind, path.name, trace, wall_s=round(result.wall_s, 3), **extra,
                    prefix_cache={"queries": result.prefix_cache_queries,
                                  "hits": result.prefix_cache_hits}, **describe)
    write_run(path, _RecordRows(result.requests), result.step_columns, info)
