"""Load any supported trace file: detect its format from the header/keys, parse, filter.

Formats (`FORMATS`): `rt` (rt JSONL, `workloads.rtformat`), `azure`, `burstgpt` (v1 and v3),
`vidur`, `lengths` (CSV, `workloads.csv_formats`), `mooncake`, `bailian` (JSONL,
`workloads.jsonl_formats`). Detection looks only at the first non-empty line; an explicit
format overrides it. Every file is read once, line by line or with one pandas call.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from workloads.arrivals import ArrivalProcess
from workloads.csv_formats import (
    AZURE_COLUMNS,
    BURSTGPT_COLUMNS,
    LENGTH_COLUMNS,
    VIDUR_COLUMNS,
    missing_column,
    parse_azure,
    parse_burstgpt,
    parse_lengths,
    parse_vidur,
)
from workloads.errors import TraceError
from workloads.jsonl_formats import (
    BAILIAN_KEYS,
    MOONCAKE_KEYS,
    open_text,
    parse_bailian,
    parse_mooncake,
    parse_timed_trace,
)
from workloads.rows import LoadReport, RawRows, rows_to_trace
from workloads.rtformat import FORMAT_NAME, read_rt_jsonl
from workloads.trace import Trace

FORMATS = ("rt", "azure", "burstgpt", "mooncake", "bailian", "vidur", "lengths", "timed_trace")
_CSV_SIGNATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("azure", AZURE_COLUMNS), ("burstgpt", BURSTGPT_COLUMNS), ("vidur", VIDUR_COLUMNS),
    ("lengths", LENGTH_COLUMNS))
_T = TypeVar("_T")
_SNIFF_LINES = 50  # non-empty line search limit when detecting


@dataclass(frozen=True, slots=True)
class LoadResult:
    """A loaded trace and the report of what loading dropped or noticed."""

    trace: Trace
    report: LoadReport


def load_trace(path: Path, fmt: str | None = None, *, model: str | None = None,
               arrivals: ArrivalProcess | None = None,
               hash_block_size: int | None = None) -> LoadResult:
    """Load `path` as format `fmt` (None: detect).

    Args:
        model: keep only rows of this model (BurstGPT `Model`), or None for all.
        arrivals: arrival process for files without timestamps (default: all at t = 0).
        hash_block_size: tokens per hash id, overriding the format's (Mooncake 512,
            Bailian 16).
    Raises:
        TraceError naming the file, line, column and value of the first problem.
    """
    fmt = fmt or detect_format(path)
    if fmt == "rt":
        _reject_options(fmt, model=model, hash_block_size=hash_block_size)
        trace = _guard(path, lambda: read_rt_jsonl(path))
        return LoadResult(trace, LoadReport(format="rt", rows_read=len(trace)))
    rows = read_rows(path, fmt, hash_block_size=hash_block_size)
    name = path.name
    trace, report = _guard(path, lambda: rows_to_trace(rows, name, model=model,
                                                       arrivals=arrivals))
    return LoadResult(trace, report)


def read_rows(path: Path, fmt: str | None = None, *,
              hash_block_size: int | None = None) -> RawRows:
    """Every data row of a non-rt file, validated but unfiltered (failed rows included)."""
    fmt = fmt or detect_format(path)
    if fmt not in _PARSERS:
        raise TraceError(f"unknown format (known: {', '.join(FORMATS)}; rt files have no "
                         "raw rows)", column="--format", value=fmt)
    if hash_block_size is not None and hash_block_size < 1:
        raise TraceError("must be >= 1 token", column="--hash-block-size",
                         value=hash_block_size)
    parser = _PARSERS[fmt]
    return _guard(path, lambda: parser(path, hash_block_size))


def detect_format(path: Path) -> str:
    """The format name of `path`, judged from its first non-empty line."""
    first = _first_line(path)
    if first.lstrip().startswith("{"):
        return _detect_jsonl(first, path)
    try:
        header = [name.strip() for name in next(csv.reader([first]))]
    except csv.Error:  # e.g. a field past the csv module's 131,072 characters
        header = []
    for fmt, columns in _CSV_SIGNATURES:
        if set(columns) <= set(header):
            return fmt
    fmt, columns = max(_CSV_SIGNATURES, key=lambda sig: len(set(sig[1]) & set(header)))
    if set(columns) & set(header):  # a near miss: name the missing column of the best fit
        missing = next(c for c in columns if c not in header)
        raise missing_column(missing, header, path)
    raise TraceError("unrecognised trace header; pass --format (one of "
                     f"{', '.join(FORMATS)})", path=str(path), line=1, value=first.strip())


def _detect_jsonl(first: str, path: Path) -> str:
    try:
        obj = json.loads(first)
    except json.JSONDecodeError as exc:
        raise TraceError(f"first line is not valid JSON ({exc.msg})", path=str(path),
                         line=1, value=first.strip()) from None
    except RecursionError:  # the decoder's own limit: ~1,000 nested arrays or objects
        raise TraceError("first line is not valid JSON (nested too deeply)", path=str(path),
                         line=1, value=first.strip()) from None
    if not isinstance(obj, dict):
        raise TraceError("expected a JSON object", path=str(path), line=1, value=first.strip())
    if obj.get("format") == FORMAT_NAME:
        return "rt"
    if set(BAILIAN_KEYS) <= obj.keys():
        return "bailian"
    if set(MOONCAKE_KEYS) <= obj.keys():
        return "mooncake"
    raise TraceError("unrecognised JSON keys; pass --format (one of "
                     f"{', '.join(FORMATS)})", path=str(path), line=1,
                     value=", ".join(obj.keys()))


def _first_line(path: Path) -> str:
    with open_text(path) as src:
        try:
            for _, text in zip(range(_SNIFF_LINES), src, strict=False):
                if text.strip():
                    return text
        except UnicodeDecodeError as exc:
            raise TraceError(f"not a UTF-8 text file ({exc.reason})", path=str(path)) \
                from None
    raise TraceError("empty file", path=str(path), line=1)


def _reject_options(fmt: str, *, model: str | None, hash_block_size: int | None) -> None:
    if model is not None:
        raise TraceError(f"format {fmt!r} has no model column", column="--trace-model", value=model)
    if hash_block_size is not None:
        raise TraceError(f"format {fmt!r} stores its own block sizes",
                         column="--hash-block-size", value=hash_block_size)


def _guard(path: Path, action: Callable[[], _T]) -> _T:
    """Run `action`, locating any TraceError (and decode/IO errors) in file `path`.

    Errors about a command-line option (column "--...") stay unlocated.
    """
    try:
        return action()
    except TraceError as err:
        is_option = (err.column or "").startswith("--")
        if err.path is None and not is_option:
            raise err.at(str(path)) from None
        raise
    except UnicodeDecodeError as exc:
        raise TraceError(f"not a UTF-8 text file ({exc.reason})", path=str(path)) from None
    except OSError as exc:
        raise TraceError(f"cannot read ({exc.strerror})", path=str(path)) from None


def _csv_parser(parse: Callable[[Path], RawRows]) -> Callable[[Path, int | None], RawRows]:
    def run(path: Path, hash_block_size: int | None) -> RawRows:
        if hash_block_size is not None:
            raise TraceError("this format has no hash ids", column="--hash-block-size",
                             value=hash_block_size)
        return parse(path)
    return run


_PARSERS: dict[str, Callable[[Path, int | None], RawRows]] = {
    "azure": _csv_parser(parse_azure),
    "burstgpt": _csv_parser(parse_burstgpt),
    "vidur": _csv_parser(parse_vidur),
    "lengths": _csv_parser(parse_lengths),
    "mooncake": parse_mooncake,
    "bailian": parse_bailian,
    "timed_trace": parse_timed_trace,
}
