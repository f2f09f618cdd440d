"""Deterministic prompt and output token ids, identical in the simulator and the real engine.

Both drivers call `prompt_token_ids(req, vocab_size, seed)` and `output_token_ids(req,
vocab_size, seed)`; nothing is stored per request, so memory stays proportional to the requests
in flight.

**Token streams.** Every token comes from a *stream* named by a string key. Token j (0-based)
of stream `key` under `seed` is

    RESERVED_TOKEN_IDS + splitmix64(base + (j + 1) * 0x9E3779B97F4A7C15) mod (vocab_size - 10)

with `base` the first 8 bytes (little endian) of blake2b(f"{seed}:{key}"). A token depends only
on (seed, key, j), so any two requests that take the first n tokens of the same stream share
exactly those n leading tokens, and different keys give independent, effectively unique tokens.

**Reserved ids.** Ids 0..9 (`RESERVED_TOKEN_IDS` = 10) are never produced, so special tokens
that live there (e.g. EOS = 2, BOS = 1, PAD = 0) never appear in a synthetic prompt or output.
Ids range over [10, vocab_size).

**Prompts** (see `workloads.trace` for the structure a request stores):

* explicit `prompt_token_ids` are returned as given;
* hash ids: block i is the first min(B, prompt_len - i*B) tokens of stream `h:<hash_ids[i]>`,
  so equal hash ids give equal blocks and a prefix cache whose block size divides B sees
  exactly the trace's sharing; tokens beyond the covered blocks come from `u:<request_id>`;
* segments: the concatenation of the first `length` tokens of each span's stream;
* otherwise: the first `prompt_len` tokens of `u:<request_id>` (unique to the request).

**Outputs.** The output of a request is the first `output_len` tokens of stream
`o:<request_id>`. A simulator that "generates" tokens must emit exactly these; a real engine
replaying a multi-turn trace produces its own text, but the *next turn's prompt* is taken from
the trace, which already contains `o:<earlier id>` spans. A multi-turn conversation therefore
encodes turn t+1's prompt as the segments of turn t's prompt, then `Span("o:<id_t>",
output_len_t)`, then the new user message, so the later prompt contains the earlier prompt and
output token for token. Clipping an earlier turn's output keeps this a prefix relation, because
streams are prefix-consistent.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import numpy as np

from workloads.errors import TraceError
from workloads.trace import TraceRequest

RESERVED_TOKEN_IDS = 10  # ids 0..9 are never produced (special tokens such as EOS = 2)
HASH_BLOCK_PREFIX = "h:"  # stream key of the token block named by a hash id: "h:<id>"

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_ONE_TO_N = np.arange(1, 1 << 16, dtype=np.uint64)  # 1..65535: a stream's first counters
_ONE_TO_N.flags.writeable = False
_ZEROS = (0,)
_FEW_PIECES = 4  # up to this many pieces, per-piece numpy calls are cheaper than whole-array


def prompt_token_ids(req: TraceRequest, vocab_size: int, seed: int) -> list[int]:
    """The request's prompt as `req.prompt_len` token ids in [10, vocab_size)."""
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    tokens: list[int] = _concat_streams(prompt_pieces(req), vocab_size, seed).tolist()
    return tokens


def prompt_token_array(req: TraceRequest, vocab_size: int, seed: int) -> array[int]:
    """`prompt_token_ids` as an `array("q")` (8 bytes per token), built without a list."""
    if req.prompt_token_ids is not None:
        return array("q", req.prompt_token_ids)
    return _stream_array(prompt_pieces(req), vocab_size, seed)


def output_token_array(req: TraceRequest, vocab_size: int, seed: int) -> array[int]:
    """`output_token_ids` as an `array("q")`, built without a list."""
    return _stream_array([(req.output_key, req.output_len)], vocab_size, seed)


def request_token_arrays(req: TraceRequest, vocab_size: int,
                         seed: int) -> tuple[array[int], array[int]]:
    """(`prompt_token_array`, `output_token_array`) of a request, computed together."""
    if req.prompt_token_ids is not None:
        return array("q", req.prompt_token_ids), output_token_array(req, vocab_size, seed)
    both = _stream_array([*prompt_pieces(req), (req.output_key, req.output_len)],
                         vocab_size, seed)
    prompt_len = len(both) - req.output_len
    return both[:prompt_len], both[prompt_len:]


def _stream_array(pieces: Sequence[tuple[str, int]], vocab_size: int, seed: int) -> array[int]:
    """`_concat_streams` computed in place in an `array("q")` (no copy out of numpy)."""
    tokens = array("q", _ZEROS) * sum(length for _, length in pieces)
    view = np.frombuffer(tokens, dtype=np.uint64)  # writable: the array's own buffer
    _fill_streams(view, pieces, vocab_size, seed)
    del view  # releases the buffer export, so the array can grow again
    return tokens


def output_token_ids(req: TraceRequest, vocab_size: int, seed: int) -> list[int]:
    """The request's `req.output_len` output token ids: stream `o:<request_id>`."""
    return stream_token_ids(req.output_key, req.output_len, vocab_size, seed)


def stream_token_ids(key: str, length: int, vocab_size: int, seed: int) -> list[int]:
    """The first `length` tokens of the stream named `key` (see the module docstring)."""
    tokens: list[int] = _concat_streams([(key, length)], vocab_size, seed).tolist()
    return tokens


def prompt_pieces(req: TraceRequest) -> list[tuple[str, int]]:
    """The prompt as (stream key, token count) pieces, each read from its stream's start.

    Explicit token ids have no stream form; they raise TraceError.
    """
    if req.prompt_token_ids is not None:
        raise TraceError("explicit prompt token ids have no stream pieces",
                         column="prompt_token_ids", value=req.request_id)
    if req.segments is not None:
        return [(span.key, span.length) for span in req.segments]
    if req.hash_ids is not None and req.hash_block_size is not None:
        return _hash_pieces(req, req.hash_ids, req.hash_block_size)
    return [(req.unique_key, req.prompt_len)]


def _hash_pieces(req: TraceRequest, hash_ids: Sequence[int], block: int) -> list[tuple[str, int]]:
    pieces = []
    for index, hid in enumerate(hash_ids):
        pieces.append((f"{HASH_BLOCK_PREFIX}{hid}", min(block, req.prompt_len - index * block)))
    tail = req.prompt_len - req.hash_covered_len
    if tail > 0:
        pieces.append((req.unique_key, tail))
    return pieces


def _concat_streams(pieces: Sequence[tuple[str, int]], vocab_size: int, seed: int) -> np.ndarray:
    """Token ids of the pieces, concatenated (int64 array)."""
    counters = np.empty(sum(length for _, length in pieces), dtype=np.uint64)
    _fill_streams(counters, pieces, vocab_size, seed)
    return counters.view(np.int64)


def _fill_streams(out: np.ndarray, pieces: Sequence[tuple[str, int]], vocab_size: int,
                  seed: int) -> None:
    """Write the pieces' token ids into `out` (uint64, their total length), in place."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
            or vocab_size <= RESERVED_TOKEN_IDS:
        raise TraceError(f"vocab size must be an integer > {RESERVED_TOKEN_IDS}",
                         column="vocab_size", value=vocab_size)
    # counter of token j of a stream with base b: b + (j + 1) * golden (wrapping)
    if len(pieces) <= _FEW_PIECES:  # piece by piece: three numpy calls each
        start = 0
        for key, length in pieces:
            piece = out[start : start + _check_length(key, length)]
            np.multiply(_positions(length), _GOLDEN, out=piece)
            piece += np.uint64(_stream_base(key, seed))
            start += length
    else:  # many (hash-id blocks, segments): whole-array operations, a constant number
        lengths = np.array([_check_length(key, length) for key, length in pieces],
                           dtype=np.int64)
        bases = np.array([_stream_base(key, seed) for key, _ in pieces], dtype=np.uint64)
        starts = (np.cumsum(lengths) - lengths).astype(np.uint64)  # pieces' first indices
        # j + 1 for token j of its piece: its position (1-based) less the piece's start
        np.subtract(_positions(out.size), np.repeat(starts, lengths), out=out)
        out *= _GOLDEN
        out += np.repeat(bases, lengths)
    _splitmix64_inplace(out)
    out %= np.uint64(vocab_size - RESERVED_TOKEN_IDS)
    out += np.uint64(RESERVED_TOKEN_IDS)


def _check_length(key: str, length: int) -> int:
    if length < 0:
        raise ValueError(f"negative piece length {length} for stream {key!r}")
    return length


def _positions(n: int) -> np.ndarray:
    """1..n (uint64)."""
    return _ONE_TO_N[:n] if n <= _ONE_TO_N.size else np.arange(1, n + 1, dtype=np.uint64)


def _splitmix64_inplace(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic), overwriting `z`, with
    one scratch array."""
    scratch = np.right_shift(z, np.uint64(30))
    z ^= scratch
    z *= _MIX1
    np.right_shift(z, np.uint64(27), out=scratch)
    z ^= scratch
    z *= _MIX2
    np.right_shift(z, np.uint64(31), out=scratch)
    z ^= scratch
    return z


def _stream_base(key: str, seed: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
