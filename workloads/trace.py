"""The trace model: an ordered tuple of requests, each described by lengths and structure.

A `TraceRequest` never stores its materialised tokens unless the source gave explicit token ids:
it stores lengths (tokens) and, optionally, the *structure* of its prompt, from which
`workloads.tokens.prompt_token_ids` derives the tokens on demand. The structure is one of:

* `prompt_token_ids`: explicit ids, used as given;
* `hash_ids` + `hash_block_size`: prefix-block hash ids as in Mooncake (512-token blocks) or
  Bailian (16-token blocks); block i of the prompt is the token block named `hash_ids[i]`, so
  equal ids give equal blocks; a prompt longer than the ids cover gets request-unique tokens
  for the uncovered tail;
* `segments`: a tuple of `Span(key, length)`; the prompt is the concatenation, over the spans,
  of the first `length` tokens of the deterministic token stream named `key`. Requests that
  name the same key share those leading tokens (shared system prompts, prefix repetition,
  multi-turn conversations);
* none of them: the prompt is `prompt_len` request-unique tokens (the stream `u:<request_id>`).

Invariants (checked on construction): arrival times are finite, >= 0 and <= MAX_ARRIVAL_S
seconds from the trace start and sorted; request ids are unique within a trace; lengths are
>= 1 token.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from workloads.errors import TraceError

# Tokens of one prompt or one output at most: past every model's context (10M at most
# today), which no engine would accept anyway; a 10^20-token row would only exhaust memory.
MAX_TOKENS = 1 << 24
# Seconds from a trace's start to an arrival at most: 2^24 s (194 days), past any public
# trace (BurstGPT spans 121 days). Per-second counts over the span (vLLM's peak concurrency,
# `rt trace inspect`'s rates) stay under 17M bins; a 1e300 s arrival overflowed their int64
# cast (a traceback) and a 10,000-year span hung building them.
MAX_ARRIVAL_S = float(1 << 24)
UNIQUE_PREFIX = "u:"  # stream key prefix of a request's own unique tokens: "u:<request_id>"
OUTPUT_PREFIX = "o:"  # stream key prefix of a request's output tokens: "o:<request_id>"


@dataclass(frozen=True, slots=True)
class Span:
    """The first `length` tokens (>= 1) of the deterministic token stream named `key`."""

    key: str
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise TraceError("span key must be a non-empty string", column="segments",
                             value=self.key)
        _check_text(self.key, "segments")
        _check_count(self.length, "segments", minimum=1)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        request_id: unique within the trace; names the request's unique and output streams.
        arrival_s: arrival time in seconds from the trace start (finite, >= 0).
        prompt_len: prompt length in tokens (>= 1).
        output_len: output length in tokens (>= 1); the engine generates exactly this many
            (as `vllm bench serve --ignore-eos`).
        prompt_token_ids: explicit prompt token ids (length `prompt_len`), or None.
        hash_ids: prefix-block hash ids, at most ceil(prompt_len / hash_block_size), or None.
        hash_block_size: tokens per hash block (Mooncake 512, Bailian 16); set iff hash_ids is.
        segments: the prompt as spans of named token streams (lengths sum to prompt_len).
        session_id: conversation or session id, or None.
        priority: scheduling priority as in vLLM (lower is served first); 0 by default.
        cache_salt: vLLM `cache_salt` isolating this request's prefix-cache entries, or None.
    """

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    hash_block_size: int | None = None
    segments: tuple[Span, ...] | None = None
    session_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise TraceError("request id must be a non-empty string", column="request_id",
                             value=self.request_id)
        _check_text(self.request_id, "request_id")
        _check_text(self.session_id, "session_id")
        _check_text(self.cache_salt, "cache_salt")
        if isinstance(self.arrival_s, bool) or not isinstance(self.arrival_s, float | int) \
                or not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise TraceError("arrival time must be a finite number >= 0 seconds",
                             column="arrival_s", value=self.arrival_s)
        if self.arrival_s > MAX_ARRIVAL_S:
            raise TraceError(f"arrival time must be <= {MAX_ARRIVAL_S:,.0f} s (194 days)",
                             column="arrival_s", value=self.arrival_s)
        object.__setattr__(self, "arrival_s", float(self.arrival_s))
        _check_count(self.prompt_len, "prompt_len", minimum=1, maximum=MAX_TOKENS)
        _check_count(self.output_len, "output_len", minimum=1, maximum=MAX_TOKENS)
        _check_count(self.priority, "priority", minimum=None)
        self._check_structure()

    def _check_structure(self) -> None:
        given = [x is not None for x in (self.prompt_token_ids, self.hash_ids, self.segments)]
        if sum(given) > 1:
            raise TraceError("give at most one of prompt_token_ids, hash_ids, segments",
                             column="request_id", value=self.request_id)
        if self.prompt_token_ids is not None:
            _check_token_ids(self.prompt_token_ids, self.prompt_len)
        if (self.hash_ids is None) != (self.hash_block_size is None):
            raise TraceError("hash_ids and hash_block_size must be given together",
                             column="hash_block_size", value=self.hash_block_size)
        if self.hash_ids is not None and self.hash_block_size is not None:
            _check_hash_ids(self.hash_ids, self.hash_block_size, self.prompt_len)
        if self.segments is not None:
            total = sum(span.length for span in self.segments)
            if not self.segments or total != self.prompt_len:
                raise TraceError(f"segment lengths sum to {total}, not prompt_len "
                                 f"{self.prompt_len}", column="segments", value=total)

    @property
    def unique_key(self) -> str:
        """Stream key of this request's own tokens (prompt without structure, uncovered tail)."""
        return UNIQUE_PREFIX + self.request_id

    @property
    def output_key(self) -> str:
        """Stream key of this request's output tokens (see `workloads.tokens`)."""
        return OUTPUT_PREFIX + self.request_id

    @property
    def hash_covered_len(self) -> int:
        """Prompt tokens covered by hash ids (0 without hash ids), at most prompt_len."""
        if self.hash_ids is None or self.hash_block_size is None:
            return 0
        return min(len(self.hash_ids) * self.hash_block_size, self.prompt_len)


@dataclass(frozen=True, slots=True)
class TraceColumns:
    """Column view of a trace for fast replay and statistics (numpy arrays, one row each).

    `arrival_s` in seconds (float64), `prompt_len` and `output_len` in tokens (int64).
    """

    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray


@dataclass(frozen=True, slots=True)
class Trace:
    """An ordered, validated tuple of requests (arrival-sorted, unique ids).

    `name` is free text describing the source (e.g. a file name), or None.
    """

    requests: tuple[TraceRequest, ...]
    name: str | None = None
    _ids: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        reqs = tuple(self.requests)
        object.__setattr__(self, "requests", reqs)
        problem = check_order(reqs)
        if problem is not None:
            raise problem[1]
        object.__setattr__(self, "_ids", frozenset(req.request_id for req in reqs))

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __getitem__(self, index: int) -> TraceRequest:
        return self.requests[index]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def columns(self) -> TraceColumns:
        """Arrival times (s) and lengths (tokens) as numpy arrays, in trace order."""
        n = len(self.requests)
        return TraceColumns(
            arrival_s=np.fromiter((r.arrival_s for r in self.requests), np.float64, n),
            prompt_len=np.fromiter((r.prompt_len for r in self.requests), np.int64, n),
            output_len=np.fromiter((r.output_len for r in self.requests), np.int64, n),
        )

    def replace_requests(self, requests: Sequence[TraceRequest]) -> Trace:
        """A trace with the same name and the given requests."""
        return Trace(tuple(requests), name=self.name)


def _check_count(value: object, column: str, *, minimum: int | None,
                 maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError("must be an integer", column=column, value=value)
    if minimum is not None and value < minimum:
        raise TraceError(f"must be >= {minimum}", column=column, value=value)
    if maximum is not None and value > maximum:
        raise TraceError(f"must be <= {maximum:,}", column=column, value=value)


def _check_text(value: object, column: str) -> None:
    """A string of a trace must be Unicode text: JSON's escapes can spell a lone surrogate
    ("\\ud800"), which no UTF-8 file or request body can hold (such a request id was
    refused only when the run's parquet files were written, after the run, naming nothing).
    ASCII (nearly every id) is checked without encoding."""
    if not isinstance(value, str) or value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise TraceError("must be Unicode text (it holds a lone surrogate)", column=column,
                         value=value) from None


def _check_token_ids(ids: tuple[int, ...], prompt_len: int) -> None:
    if len(ids) != prompt_len:
        raise TraceError(f"has {len(ids)} ids but prompt_len is {prompt_len}",
                         column="prompt_token_ids", value=len(ids))
    for tok in ids:
        _check_count(tok, "prompt_token_ids", minimum=0)


def _check_hash_ids(ids: tuple[int, ...], block_size: int, prompt_len: int) -> None:
    _check_count(block_size, "hash_block_size", minimum=1)
    needed = -(-prompt_len // block_size)
    if len(ids) > needed:
        raise TraceError(f"{len(ids)} hash ids of {block_size} tokens exceed the "
                         f"{needed} blocks of a {prompt_len}-token prompt",
                         column="hash_ids", value=len(ids))
    for hid in ids:
        _check_count(hid, "hash_ids", minimum=0)


def check_order(requests: Sequence[TraceRequest]) -> tuple[int, TraceError] | None:
    """The first request (index, error) breaking arrival order or id uniqueness, or None."""
    previous = 0.0
    seen: set[str] = set()
    for index, req in enumerate(requests):
        if req.arrival_s < previous:
            return index, TraceError(f"arrival times must be sorted: {req.arrival_s} s comes "
                                     f"after {previous} s", column="arrival_s",
                                     value=req.arrival_s)
        if req.request_id in seen:
            return index, TraceError("request ids must be unique", column="request_id",
                                     value=req.request_id)
        previous = req.arrival_s
        seen.add(req.request_id)
    return None
