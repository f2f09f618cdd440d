"""Summary statistics of a trace, defined exactly as `../shared/traces/README.md` computes them.

* rows; span = last - first arrival (s); mean rate = rows / span (req/s);
* peak per minute / per second: the largest count of arrivals in one 60 s / 1 s bin, bins
  counted from the first arrival (bin = floor((t - t0) / width));
* IA-CV: population std / mean of the inter-arrival gaps (numpy, ddof = 0; Poisson ~ 1);
* IoD(1 s): population variance / mean of the per-second arrival counts, empty seconds
  included;
* prompt and output lengths (tokens): mean, p50, p99 (linear interpolation), max;
* prefix reuse: requests are replayed in arrival order against an unbounded prefix cache.
  A request's blocks are its hash ids (one per hash block, the partial last block included),
  or, for prompts with segments or explicit token ids, its *full* `block_size`-token blocks
  chained on their prefix (as vLLM's block hashes). A block hits when it and every block before
  it in the same prompt were seen in an earlier request. `block_reuse` = hit blocks / block
  references; `token_hit_fraction` = sum of min(hit blocks x block size, prompt_len) / prompt
  tokens. Traces whose prompts have no structure (all tokens unique) report None.

Time statistics are None when the trace has no timestamps or all arrivals coincide.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from workloads.errors import TraceError
from workloads.rows import RawRows
from workloads.tokens import prompt_pieces
from workloads.trace import Trace, TraceRequest

DEFAULT_BLOCK_SIZE = 16  # tokens per prefix-cache block for prompts without hash ids


@dataclass(frozen=True, slots=True)
class LengthStats:
    """Token-count summary: mean, median, 99th percentile (linear) and maximum, in tokens."""

    mean: float
    p50: float
    p99: float
    max: int


@dataclass(frozen=True, slots=True)
class TimeStats:
    """Arrival-time summary (seconds, requests per second, counts, dimensionless ratios)."""

    span_s: float
    mean_rate: float
    peak_per_min: int
    peak_per_s: int
    ia_cv: float
    iod_1s: float


@dataclass(frozen=True, slots=True)
class PrefixReuse:
    """Ideal prefix-cache reuse (see the module docstring); `block_size` in tokens, or None
    when requests use different block sizes."""

    block_refs: int
    distinct_blocks: int
    block_reuse: float
    token_hit_fraction: float
    block_size: int | None


@dataclass(frozen=True, slots=True)
class TraceStats:
    """Everything `rt trace inspect` prints."""

    rows: int
    time: TimeStats | None
    prompt: LengthStats
    output: LengthStats
    prefix: PrefixReuse | None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (nested sections, None where a section does not apply)."""
        return asdict(self)


def trace_stats(trace: Trace, block_size: int = DEFAULT_BLOCK_SIZE) -> TraceStats:
    """Statistics of a loaded trace (`block_size` applies to prompts without hash ids)."""
    cols = trace.columns()
    timed = cols.arrival_s if len(trace) else None
    return _stats(timed, cols.prompt_len, cols.output_len, prefix_reuse(trace, block_size))


def rows_stats(rows: RawRows) -> TraceStats:
    """Statistics over every row of a file, failed rows included (README "all rows")."""
    prefix = None
    if rows.hash_ids is not None and rows.hash_block_size is not None:
        size = rows.hash_block_size
        blocks = [[("h", hid) for hid in ids] for ids in rows.hash_ids]
        prefix = _reuse(blocks, [size] * len(rows), rows.prompt_len.tolist())
    return _stats(rows.arrival_s, rows.prompt_len, rows.output_len, prefix)


def length_stats(values: np.ndarray) -> LengthStats:
    """Mean, p50, p99 and max of token counts (pandas' default linear percentiles)."""
    p50, p99 = np.percentile(values, [50, 99])
    return LengthStats(mean=float(values.mean()), p50=float(p50), p99=float(p99),
                       max=int(values.max()))


def time_stats(arrival_s: np.ndarray) -> TimeStats | None:
    """Arrival statistics of sorted arrival times (s), or None if the span is 0."""
    if len(arrival_s) < 2 or arrival_s[-1] == arrival_s[0]:
        return None
    offset = arrival_s - arrival_s[0]
    span = float(offset[-1])
    per_s = np.bincount(np.floor(offset).astype(np.int64))
    gaps = np.diff(arrival_s)
    return TimeStats(
        span_s=span,
        mean_rate=len(arrival_s) / span,
        peak_per_min=int(np.bincount(np.floor(offset / 60.0).astype(np.int64)).max()),
        peak_per_s=int(per_s.max()),
        ia_cv=float(gaps.std() / gaps.mean()),
        iod_1s=float(per_s.var() / per_s.mean()),
    )


def prefix_reuse(trace: Trace, block_size: int = DEFAULT_BLOCK_SIZE) -> PrefixReuse | None:
    """Ideal prefix-cache reuse of the trace, or None if no prompt has any structure."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise TraceError("must be an integer >= 1 token", column="--block-size",
                         value=block_size)
    if not any(_has_structure(req) for req in trace):
        return None
    blocks, sizes = [], []
    for req in trace:
        size = req.hash_block_size or block_size
        blocks.append(_request_blocks(req, block_size))
        sizes.append(size)
    return _reuse(blocks, sizes, [req.prompt_len for req in trace])


def _stats(arrival_s: np.ndarray | None, prompt_len: np.ndarray, output_len: np.ndarray,
           prefix: PrefixReuse | None) -> TraceStats:
    if len(prompt_len) == 0:
        empty = LengthStats(mean=0.0, p50=0.0, p99=0.0, max=0)
        return TraceStats(rows=0, time=None, prompt=empty, output=empty, prefix=None)
    return TraceStats(rows=len(prompt_len),
                      time=None if arrival_s is None else time_stats(arrival_s),
                      prompt=length_stats(prompt_len), output=length_stats(output_len),
                      prefix=prefix)


def _has_structure(req: TraceRequest) -> bool:
    return req.hash_ids is not None or req.segments is not None or \
        req.prompt_token_ids is not None


def _request_blocks(req: TraceRequest, block_size: int) -> list[Any]:
    if req.hash_ids is not None:
        return [("h", hid) for hid in req.hash_ids]
    if req.prompt_token_ids is not None:
        return _chained(_token_blocks(req.prompt_token_ids, block_size))
    return _chained(_piece_blocks(prompt_pieces(req), block_size))


def _token_blocks(tokens: Sequence[int], block: int) -> Iterable[tuple[Any, ...]]:
    for start in range(0, len(tokens) - block + 1, block):
        yield tuple(tokens[start:start + block])


def _piece_blocks(pieces: Sequence[tuple[str, int]], block: int) -> Iterable[tuple[Any, ...]]:
    """Each full block as the (stream key, start, end) slices that fill it."""
    current: list[tuple[str, int, int]] = []
    filled = 0
    for key, length in pieces:
        pos = 0
        while pos < length:
            take = min(block - filled, length - pos)
            current.append((key, pos, pos + take))
            pos += take
            filled += take
            if filled == block:
                yield tuple(current)
                current, filled = [], 0


def _chained(blocks: Iterable[tuple[Any, ...]]) -> list[Any]:
    """Block identities that include their whole prefix (parent identity, own content)."""
    out: list[Any] = []
    parent: Any = None
    for content in blocks:
        parent = hash((parent, content))
        out.append(parent)
    return out


def _reuse(blocks: Sequence[Sequence[Any]], sizes: Sequence[int],
           prompt_lens: Sequence[int]) -> PrefixReuse:
    seen: set[Any] = set()
    refs = hits = hit_tokens = 0
    for ids, size, prompt_len in zip(blocks, sizes, prompt_lens, strict=True):
        leading = 0
        while leading < len(ids) and ids[leading] in seen:
            leading += 1
        refs += len(ids)
        hits += leading
        hit_tokens += min(leading * size, prompt_len)
        seen.update(ids)
    total_tokens = sum(prompt_lens)
    return PrefixReuse(
        block_refs=refs, distinct_blocks=len(seen),
        block_reuse=hits / refs if refs else 0.0,
        token_hit_fraction=hit_tokens / total_tokens if total_tokens else 0.0,
        block_size=sizes[0] if sizes and len(set(sizes)) == 1 else None)
