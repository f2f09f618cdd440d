"""CSV trace formats: Azure LLM 2023, BurstGPT v1/v3, Vidur, and length-only files.

Each file is read once with pandas (every cell as text, so a bad cell can be quoted back), then
each needed column is converted and checked. Line numbers are physical: the header is line 1,
data row i (0-based) is line i + 2. Timestamps become seconds from the first row.

| format | columns (by name, any order, extra columns ignored) | time unit |
|---|---|---|
| `azure` | `TIMESTAMP,ContextTokens,GeneratedTokens` | datetime `YYYY-MM-DD HH:MM:SS.fffffff` |
| `burstgpt` | `Timestamp,Model,Request tokens,Response tokens` [+ `Session ID` in v3] | seconds |
| `vidur` | `arrived_at,num_prefill_tokens,num_decode_tokens` | seconds |
| `lengths` | `num_prefill_tokens,num_decode_tokens` (ShareGPT/arXiv stats files) | none |
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import numpy as np
import pandas as pd

from workloads.errors import TraceError
from workloads.rows import RawRows
from workloads.trace import MAX_TOKENS, Trace

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens")
BURSTGPT_SESSION = "Session ID"
VIDUR_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
LENGTH_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
_FIRST_DATA_LINE = 2  # the header is line 1


def parse_azure(path: Path) -> RawRows:
    """Azure LLM inference trace 2023 (datetime arrivals, context/generated tokens)."""
    frame = read_csv_text(path, AZURE_COLUMNS)
    try:
        stamps = pd.to_datetime(frame["TIMESTAMP"], format="ISO8601", errors="coerce")
    except ValueError as err:  # e.g. "Mixed timezones detected" (found by a loader fuzz)
        raise TraceError(f"unreadable date-times: {err}", path=str(path),
                         column="TIMESTAMP") from None
    _first_bad(frame, "TIMESTAMP", stamps.isna().to_numpy(), "not a date-time "
               "(expected YYYY-MM-DD HH:MM:SS.fffffff)")
    # in the unit pandas parsed them at: ns, or us for dates outside 1677-2262, whose ns
    # values wrapped around (a file from 1600 to 2000 read as "not sorted")
    unit = stamps.dt.unit
    ticks = stamps.to_numpy(dtype=f"datetime64[{unit}]").astype(np.int64)
    seconds = (ticks - ticks[0]) / (np.timedelta64(1, "s") / np.timedelta64(1, unit))
    _check_sorted(frame, "TIMESTAMP", seconds)
    return RawRows(format="azure", line=_lines(frame), arrival_s=seconds,
                   prompt_len=token_column(frame, "ContextTokens"),
                   output_len=token_column(frame, "GeneratedTokens"))


def parse_burstgpt(path: Path) -> RawRows:
    """BurstGPT v1 (`BurstGPT_1.csv`) or v3 with `Session ID`, read by column name."""
    frame = read_csv_text(path, BURSTGPT_COLUMNS)
    sessions = None
    if BURSTGPT_SESSION in frame.columns:
        sessions = [s.strip() or None for s in frame[BURSTGPT_SESSION].fillna("")]
    return RawRows(format="burstgpt", line=_lines(frame),
                   arrival_s=_relative_seconds(frame, "Timestamp"),
                   prompt_len=token_column(frame, "Request tokens"),
                   output_len=token_column(frame, "Response tokens"),
                   session_id=sessions, model=[m.strip() for m in frame["Model"]])


def parse_vidur(path: Path) -> RawRows:
    """Vidur processed trace: `arrived_at` (s), prefill and decode token counts."""
    frame = read_csv_text(path, VIDUR_COLUMNS)
    return RawRows(format="vidur", line=_lines(frame),
                   arrival_s=_relative_seconds(frame, "arrived_at"),
                   prompt_len=token_column(frame, "num_prefill_tokens"),
                   output_len=token_column(frame, "num_decode_tokens"))


def parse_lengths(path: Path) -> RawRows:
    """A length-only file (no timestamps); arrivals come from an arrival process later."""
    frame = read_csv_text(path, LENGTH_COLUMNS)
    return RawRows(format="lengths", line=_lines(frame), arrival_s=None,
                   prompt_len=token_column(frame, "num_prefill_tokens"),
                   output_len=token_column(frame, "num_decode_tokens"))


def write_vidur_csv(trace: Trace, path: Path) -> None:
    """Write arrivals (s) and lengths as Vidur's `arrived_at,num_prefill_tokens,...` CSV.

    Only times and lengths survive; prompt structure, sessions and priorities are dropped.
    """
    cols = trace.columns()
    frame = pd.DataFrame({"arrived_at": cols.arrival_s, "num_prefill_tokens": cols.prompt_len,
                          "num_decode_tokens": cols.output_len})
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False, float_format="%.9f")


def read_csv_text(path: Path, required: tuple[str, ...]) -> pd.DataFrame:
    """Every cell as text; checks the required columns and that data rows exist."""
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, skip_blank_lines=False)
    except pd.errors.EmptyDataError:
        raise TraceError("empty file", path=str(path), line=1) from None
    except pd.errors.ParserError as exc:
        raise _parser_error(exc, path) from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"not a text file ({exc.reason})", path=str(path)) from None
    frame.attrs["path"] = str(path)
    for name in required:
        if name not in frame.columns:
            raise missing_column(name, list(frame.columns), path)
    if frame.empty:
        raise TraceError("no data rows after the header", path=str(path), line=2)
    return frame


def token_column(frame: pd.DataFrame, name: str) -> np.ndarray:
    """A column of integer token counts >= 0 (int64); the first bad cell raises."""
    values = _numeric(frame, name)
    _first_bad(frame, name, values < 0, "token counts must be >= 0")
    _first_bad(frame, name, values != np.floor(values), "token counts must be integers")
    # before the int64 cast, which turned 1e23 into -9223372036854775808 (named as such)
    _first_bad(frame, name, values > MAX_TOKENS, f"token counts must be <= {MAX_TOKENS:,}")
    return values.astype(np.int64)


def _relative_seconds(frame: pd.DataFrame, name: str) -> np.ndarray:
    values = _numeric(frame, name)
    _first_bad(frame, name, values < 0, "timestamps must be >= 0")
    _check_sorted(frame, name, values)
    relative: np.ndarray = values - values[0]
    return relative


def _numeric(frame: pd.DataFrame, name: str) -> np.ndarray:
    values: np.ndarray = pd.to_numeric(frame[name], errors="coerce").to_numpy(dtype=np.float64)
    _first_bad(frame, name, ~np.isfinite(values), "not a finite number")
    return values


def _check_sorted(frame: pd.DataFrame, name: str, values: np.ndarray) -> None:
    bad = np.zeros(len(values), dtype=bool)
    bad[1:] = values[1:] < values[:-1]
    _first_bad(frame, name, bad, "timestamps must be sorted (earlier than the previous row)")


def _first_bad(frame: pd.DataFrame, name: str, bad: np.ndarray, message: str) -> None:
    hits = np.flatnonzero(bad)
    if len(hits):
        row = int(hits[0])
        raise TraceError(message, path=frame.attrs.get("path"), line=row + _FIRST_DATA_LINE,
                         column=name, value=frame[name].iloc[row])


def _lines(frame: pd.DataFrame) -> np.ndarray:
    return np.arange(len(frame), dtype=np.int64) + _FIRST_DATA_LINE


def missing_column(name: str, header: list[str], path: Path) -> TraceError:
    """The error for a required column absent from `header`, with a close-match hint."""
    close = difflib.get_close_matches(name, header, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    # at most 12 names of at most 40 characters: a 200 KB first line was printed whole
    names = [repr(h if len(h) <= 40 else h[:37] + "...") for h in header[:12]]
    more = ", ..." if len(header) > 12 else ""
    return TraceError(f"missing column (header has {', '.join(names)}{more}){hint}",
                      path=str(path), line=1, column=name)


def _parser_error(exc: pd.errors.ParserError, path: Path) -> TraceError:
    match = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", str(exc))
    if match is None:
        return TraceError(f"malformed CSV ({exc})", path=str(path))
    expected, line, saw = match.groups()
    return TraceError(f"row has {saw} fields, the header has {expected}", path=str(path),
                      line=int(line))
