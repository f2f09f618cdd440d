"""Completed requests' token times, chunk by chunk: the inter-token latencies and the peak
token rate of vLLM's benchmark block without a Python object (or a frame cell) per token.

A chunk is `(flat, lengths)`: some requests' token times back to back (seconds, float64) and
each request's count of them; chunks come request by request in the run's row order. They
come from a frame's `token_times_s` column (`frame_chunks`) or straight from a run's
requests.parquet, in batches of 8,192 rows (`file_chunks`: the column is never held whole).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

TOKEN_COLUMN = "token_times_s"
Chunk = tuple[np.ndarray, np.ndarray]  # (flat times in s, float64; per-request counts, int64)
Chunks = Callable[[], Iterable[Chunk]]  # a fresh pass over the chunks at each call

_CHUNK_ROWS = 16_384  # frame rows whose token times are flattened at once


def frame_chunks(done: pd.DataFrame) -> Iterator[Chunk]:
    """`done`'s token times `_CHUNK_ROWS` rows at a time."""
    column = done[TOKEN_COLUMN]
    for first in range(0, len(column), _CHUNK_ROWS):
        rows = [np.asarray(t, dtype=np.float64) for t in column.iloc[first:first + _CHUNK_ROWS]]
        lengths = np.fromiter((t.size for t in rows), np.int64, len(rows))
        yield (np.concatenate(rows) if lengths.sum() else np.empty(0)), lengths


def file_chunks(path: Path, done: np.ndarray) -> Chunks:
    """The token times of the rows of requests.parquet at `path` where `done` (one bool per
    row of the file) is true, `_FILE_BATCH_ROWS` rows at a time (~8 MB of token times at
    127 a request; a whole 65,536-row group at once held ~0.3 GB more at its peak)."""
    def chunks() -> Iterator[Chunk]:
        first = 0
        for batch in pq.ParquetFile(path).iter_batches(_FILE_BATCH_ROWS, columns=[TOKEN_COLUMN]):
            keep = pa.array(done[first:first + batch.num_rows])
            first += batch.num_rows
            lists = batch.column(0).filter(keep)
            if len(lists):
                flat = lists.flatten().cast(pa.float64()).to_numpy(zero_copy_only=False)
                yield flat, pc.list_value_length(lists).fill_null(0).to_numpy().astype(np.int64)
        pa.default_memory_pool().release_unused()  # the last batches' buffers
        if first != done.size:
            raise ValueError(f"{path}: {first} rows of token times for {done.size} requests")
    return chunks


_FILE_BATCH_ROWS = 8_192  # requests.parquet rows read at once


def request_gaps(flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The gaps within each request of `flat` (its `lengths`), in order; the gaps across two
    requests are left out."""
    if flat.size < 2:
        return np.empty(0)
    gaps = np.diff(flat)  # gap i: flat[i + 1] - flat[i]
    keep = np.ones(gaps.size, dtype=bool)
    starts = np.cumsum(lengths)[:-1]  # where each request after the first begins
    keep[starts[(starts > 0) & (starts <= gaps.size)] - 1] = False
    kept: np.ndarray = gaps[keep]  # numpy's stubs type a boolean-mask index as Any
    return kept


def gather_gaps(chunks: Iterable[Chunk], capacity: int) -> np.ndarray:
    """Every chunk's `request_gaps` back to back, in ms, in one float64 array (no second
    array of that size). Allocated for `capacity` gaps (pages never written are never
    resident, so an overestimate costs address space only) and grown if there are more."""
    gaps, filled = np.empty(max(capacity, 0)), 0
    for flat, lengths in chunks:
        chunk = request_gaps(flat, lengths)
        if filled + chunk.size > gaps.size:
            grown = np.empty(max(2 * gaps.size, filled + chunk.size))
            grown[:filled] = gaps[:filled]
            gaps = grown
        gaps[filled:filled + chunk.size] = chunk
        filled += chunk.size
    gaps = gaps[:filled]
    gaps *= 1e3
    return gaps


def peak_tokens_per_second(chunks: Iterable[Chunk], start: float) -> float:
    """vLLM's `max_output_tokens_per_s`: the most token times in one second bucket
    (bucket = int(t - start), start = the first completed request's start)."""
    counts = np.zeros(0, dtype=np.int64)  # tokens per second bucket
    for times, _ in chunks:
        seconds = np.floor(times - start).astype(np.int64)
        chunk = np.bincount(seconds[seconds >= 0])
        if chunk.size > counts.size:
            chunk[:counts.size] += counts
            counts = chunk
        else:
            counts[:chunk.size] += chunk
    return float(counts.max()) if counts.size else 0.0
