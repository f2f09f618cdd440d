"""The rows a format parser reads, before filtering: one validated numpy column per field.

Parsers (`workloads.csv_formats`, `workloads.jsonl_formats`) turn a file into `RawRows` once,
with every value checked and every row's source line kept; `rows_to_trace` then drops failed
rows, applies the model filter and builds `TraceRequest` objects. Statistics over *all* rows
(`rt trace inspect --keep-failed`) read `RawRows` directly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from workloads.arrivals import ArrivalProcess
from workloads.errors import TraceError
from workloads.trace import MAX_ARRIVAL_S, Trace, TraceRequest


@dataclass(frozen=True, slots=True)
class RawRows:
    """All data rows of one file, validated, in file order.

    Attributes:
        format: the format name the parser used (e.g. "azure").
        line: 1-based source line of each row (int64).
        arrival_s: seconds from the first row (float64, sorted, starts at 0), or None for
            length-only files that carry no timestamps.
        prompt_len, output_len: token counts (int64, >= 0; 0 marks a failed row).
        request_id: per-row id from the file (Bailian `chat_id`), or None: ids are then the
            0-based data-row index.
        session_id: per-row session id or None entries; None when the format has none.
        model: per-row model name (BurstGPT) or None.
        hash_ids: per-row prefix-block hash ids, or None.
        hash_block_size: tokens per hash block when hash_ids is given.
    """

    format: str
    line: np.ndarray
    arrival_s: np.ndarray | None
    prompt_len: np.ndarray
    output_len: np.ndarray
    request_id: list[str] | None = None
    session_id: list[str | None] | None = None
    model: list[str] | None = None
    hash_ids: list[tuple[int, ...]] | None = None
    hash_block_size: int | None = None

    def __post_init__(self) -> None:
        if self.arrival_s is None:
            return
        late = np.flatnonzero(self.arrival_s > MAX_ARRIVAL_S)
        if len(late):  # `TraceRequest`'s bound, for the statistics of every row too
            row = int(late[0])
            raise TraceError(f"arrival time must be <= {MAX_ARRIVAL_S:,.0f} s (194 days)",
                             line=int(self.line[row]), column="arrival_s",
                             value=float(self.arrival_s[row]))

    def __len__(self) -> int:
        return len(self.prompt_len)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What loading dropped or noticed (counts of rows).

    Attributes:
        format: the format that was read.
        rows_read: data rows in the file.
        dropped_failed: rows dropped because output_len is 0 (BurstGPT failures).
        dropped_empty_prompt: rows dropped because prompt_len is 0 with a non-zero output.
        dropped_model: rows dropped by the model filter.
        uncovered_hash_rows: kept rows whose hash ids cover fewer tokens than the prompt
            (the uncovered tail gets request-unique tokens).
        synthetic_arrivals: True when arrival times came from an arrival process.
        models: rows per model name in the file (empty when the format has no model column).
    """

    format: str
    rows_read: int
    dropped_failed: int = 0
    dropped_empty_prompt: int = 0
    dropped_model: int = 0
    uncovered_hash_rows: int = 0
    synthetic_arrivals: bool = False
    models: dict[str, int] = field(default_factory=dict)


def rows_to_trace(rows: RawRows, name: str | None, *, model: str | None = None,
                  arrivals: ArrivalProcess | None = None) -> tuple[Trace, LoadReport]:
    """Drop failed / empty rows and rows of other models, then build the trace.

    `arrivals` supplies arrival times for files without timestamps (default: all at t = 0,
    as `vllm bench serve --request-rate inf`); it is ignored for files with timestamps.
    """
    keep = _model_mask(rows, model)
    of_model = int(keep.sum())
    failed = keep & (rows.output_len == 0)
    empty = keep & (rows.output_len > 0) & (rows.prompt_len == 0)
    keep &= ~failed & ~empty
    index = np.flatnonzero(keep)
    arrival = _arrivals(rows, index, arrivals)
    requests = [_request(rows, int(i), float(t)) for i, t in zip(index, arrival, strict=True)]
    uncovered = sum(1 for r in requests if r.hash_ids is not None and
                    r.hash_covered_len < r.prompt_len)
    report = LoadReport(
        format=rows.format, rows_read=len(rows), dropped_failed=int(failed.sum()),
        dropped_empty_prompt=int(empty.sum()), dropped_model=len(rows) - of_model,
        uncovered_hash_rows=uncovered, synthetic_arrivals=rows.arrival_s is None,
        models=dict(Counter(rows.model)) if rows.model is not None else {})
    return Trace(tuple(requests), name=name), report


def _model_mask(rows: RawRows, model: str | None) -> np.ndarray:
    if model is None:
        return np.ones(len(rows), dtype=bool)
    if rows.model is None:
        raise TraceError(f"format {rows.format!r} has no model column to filter on",
                         column="--trace-model", value=model)
    mask = np.array([m == model for m in rows.model], dtype=bool)
    if not mask.any():
        known = ", ".join(sorted(set(rows.model)))
        raise TraceError(f"no row has this model (models in the file: {known})",
                         column="--trace-model", value=model)
    return mask


def _arrivals(rows: RawRows, index: np.ndarray, process: ArrivalProcess | None) -> np.ndarray:
    if rows.arrival_s is not None:
        picked: np.ndarray = rows.arrival_s[index]
        return picked
    return (process or ArrivalProcess()).arrival_times(len(index))


def _request(rows: RawRows, i: int, arrival_s: float) -> TraceRequest:
    try:
        return TraceRequest(
            request_id=rows.request_id[i] if rows.request_id is not None else str(i),
            arrival_s=arrival_s,
            prompt_len=int(rows.prompt_len[i]),
            output_len=int(rows.output_len[i]),
            hash_ids=rows.hash_ids[i] if rows.hash_ids is not None else None,
            hash_block_size=rows.hash_block_size if rows.hash_ids is not None else None,
            session_id=rows.session_id[i] if rows.session_id is not None else None,
        )
    except TraceError as err:
        raise err.at(None, int(rows.line[i])) from None
