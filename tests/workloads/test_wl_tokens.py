"""Deterministic token ids: reserved range, sharing exactly where the trace says, pinned values."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workloads import (
    RESERVED_TOKEN_IDS,
    Span,
    TraceError,
    TraceRequest,
    load_trace,
    output_token_ids,
    prompt_token_ids,
    stream_token_ids,
)
from workloads.tokens import (
    _splitmix64_inplace,
    _stream_base,
    output_token_array,
    prompt_pieces,
    prompt_token_array,
    request_token_arrays,
)

from .helpers import FIXTURES

VOCAB = 32000


def test_pinned_stream_values() -> None:
    # a change here changes every simulated and replayed prompt: bump the rt-trace version
    assert stream_token_ids("u:0", 8, 32000, 0) == [7089, 5863, 6265, 10096, 24570, 28785,
                                                     15128, 30292]
    assert stream_token_ids("h:0", 4, 128256, 1) == [47555, 41381, 22557, 10118]


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser on one integer (the reference for the numpy one)."""
    mask = (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_vectorised_splitmix64_is_the_finaliser() -> None:
    assert _splitmix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF  # SplitMix64(seed 0), 1st
    values = [0, 1, 0x9E3779B97F4A7C15, (1 << 64) - 1, *range(12345, 2**64, 2**59 + 977)]
    z = np.array(values, dtype=np.uint64)
    assert _splitmix64_inplace(z) is z
    assert z.tolist() == [_splitmix64(v) for v in values]


@given(st.text(min_size=1, max_size=12), st.integers(1, 300), st.integers(1, 300),
       st.integers(11, 10**6), st.integers(0, 2**32))
@settings(max_examples=60, deadline=None)
def test_streams_are_prefix_consistent_and_in_range(key: str, a: int, b: int, vocab: int,
                                                    seed: int) -> None:
    longer = stream_token_ids(key, max(a, b), vocab, seed)
    assert stream_token_ids(key, min(a, b), vocab, seed) == longer[:min(a, b)]
    assert all(RESERVED_TOKEN_IDS <= t < vocab for t in longer)


def test_reserved_ids_never_appear_even_in_a_tiny_vocab() -> None:
    tokens = stream_token_ids("u:x", 5000, 12, 0)
    assert set(tokens) == {10, 11}


def test_seed_and_key_change_tokens() -> None:
    base = stream_token_ids("u:1", 64, VOCAB, 0)
    assert base == stream_token_ids("u:1", 64, VOCAB, 0)
    assert base != stream_token_ids("u:1", 64, VOCAB, 1)
    assert base != stream_token_ids("u:2", 64, VOCAB, 0)


def test_unstructured_prompts_are_unique_per_request() -> None:
    a, b = TraceRequest("a", 0.0, 100, 5), TraceRequest("b", 0.0, 100, 5)
    ta, tb = prompt_token_ids(a, VOCAB, 0), prompt_token_ids(b, VOCAB, 0)
    assert len(ta) == 100 and ta != tb
    assert sum(x == y for x, y in zip(ta, tb, strict=True)) < 5  # chance agreements only


def test_equal_hash_ids_give_equal_blocks_and_a_16_token_cache_sees_the_sharing() -> None:
    a = TraceRequest("a", 0.0, 1000, 1, hash_ids=(7, 8), hash_block_size=512)
    b = TraceRequest("b", 0.0, 1300, 1, hash_ids=(7, 9, 10), hash_block_size=512)
    ta, tb = prompt_token_ids(a, VOCAB, 3), prompt_token_ids(b, VOCAB, 3)
    assert (len(ta), len(tb)) == (1000, 1300)
    assert ta[:512] == tb[:512]
    blocks_a = [tuple(ta[i:i + 16]) for i in range(0, 992, 16)]
    blocks_b = [tuple(tb[i:i + 16]) for i in range(0, 1296, 16)]
    shared = sum(1 for x, y in zip(blocks_a, blocks_b, strict=False) if x == y)
    assert shared == 32  # exactly the 512 / 16 blocks of hash id 7
    # the partial last block of `a` (hash id 8, 488 tokens) is a prefix of block 8's tokens
    assert ta[512:] == stream_token_ids("h:8", 488, VOCAB, 3)


def test_uncovered_tail_is_request_unique() -> None:
    a = TraceRequest("a", 0.0, 600, 1, hash_ids=(1,), hash_block_size=512)
    b = TraceRequest("b", 0.0, 600, 1, hash_ids=(1,), hash_block_size=512)
    ta, tb = prompt_token_ids(a, VOCAB, 0), prompt_token_ids(b, VOCAB, 0)
    assert ta[:512] == tb[:512] and ta[512:] != tb[512:]
    assert ta[512:] == stream_token_ids("u:a", 88, VOCAB, 0)


def test_segments_concatenate_streams() -> None:
    req = TraceRequest("r", 0.0, 30, 4, segments=(Span("p:sys", 10), Span("u:r", 20)))
    assert prompt_token_ids(req, VOCAB, 0) == \
        stream_token_ids("p:sys", 10, VOCAB, 0) + stream_token_ids("u:r", 20, VOCAB, 0)
    assert output_token_ids(req, VOCAB, 0) == stream_token_ids("o:r", 4, VOCAB, 0)


def test_explicit_token_ids_are_returned_as_given() -> None:
    req = TraceRequest("r", 0.0, 3, 1, prompt_token_ids=(1, 2, 3))
    assert prompt_token_ids(req, VOCAB, 0) == [1, 2, 3]


def test_mooncake_fixture_prompts_have_their_lengths_and_shared_first_block() -> None:
    trace = load_trace(FIXTURES / "mooncake_conversation_first300.jsonl").trace
    firsts = set()
    for req in trace.requests[:20]:
        tokens = prompt_token_ids(req, VOCAB, 0)
        assert len(tokens) == req.prompt_len
        firsts.add(tuple(tokens[:512]))
    assert len(firsts) == 1  # every request starts with hash id 0


def test_vocab_must_leave_room_above_reserved_ids() -> None:
    with pytest.raises(TraceError) as info:
        prompt_token_ids(TraceRequest("r", 0.0, 3, 1), 10, 0)
    assert info.value.column == "vocab_size"


def test_materialising_a_long_prompt_is_vectorised() -> None:
    req = TraceRequest("r", 0.0, 131072, 1, hash_ids=tuple(range(256)), hash_block_size=512)
    tokens = np.asarray(prompt_token_ids(req, 151936, 0))
    assert tokens.shape == (131072,) and tokens.min() >= RESERVED_TOKEN_IDS


def _reference_ids(pieces: list[tuple[str, int]], vocab: int, seed: int) -> list[int]:
    """The module docstring's formula, token by token in Python integers."""
    mask = (1 << 64) - 1
    out = []
    for key, length in pieces:
        base = _stream_base(key, seed)
        for j in range(length):
            z = (base + (j + 1) * 0x9E3779B97F4A7C15) & mask
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
            z ^= z >> 31
            out.append(RESERVED_TOKEN_IDS + z % (vocab - RESERVED_TOKEN_IDS))
    return out


@pytest.mark.parametrize("req", [
    TraceRequest("a", 0.0, 1000, 7, hash_ids=(7, 8), hash_block_size=512),
    TraceRequest("b", 0.0, 600, 1, hash_ids=(1,), hash_block_size=512),
    TraceRequest("r", 0.0, 30, 4, segments=(Span("p:sys", 10), Span("u:r", 20))),
    TraceRequest("u", 0.0, 77, 1),
    TraceRequest("x", 0.0, 3, 2, prompt_token_ids=(1, 2, 3)),
])
@pytest.mark.parametrize(("vocab", "seed"), [(VOCAB, 0), (11, 5), (151936, 2**40)])
def test_token_arrays_equal_the_lists_and_the_formula(req: TraceRequest, vocab: int,
                                                      seed: int) -> None:
    prompt = prompt_token_array(req, vocab, seed)
    output = output_token_array(req, vocab, seed)
    assert isinstance(prompt, array) and prompt.typecode == "q" and output.typecode == "q"
    assert prompt.tolist() == prompt_token_ids(req, vocab, seed)
    assert output.tolist() == output_token_ids(req, vocab, seed)
    assert output.tolist() == _reference_ids([(req.output_key, req.output_len)], vocab, seed)
    if req.prompt_token_ids is None:
        assert prompt.tolist() == _reference_ids(prompt_pieces(req), vocab, seed)
    prompt.append(12)  # no buffer export left behind: the array can still grow
    output.extend([13, 14])


def test_token_arrays_of_the_mooncake_fixture_equal_the_lists() -> None:
    trace = load_trace(FIXTURES / "mooncake_conversation_first300.jsonl").trace
    for req in trace.requests[:40]:
        assert prompt_token_array(req, VOCAB, 1).tolist() == prompt_token_ids(req, VOCAB, 1)
        assert output_token_array(req, VOCAB, 1).tolist() == output_token_ids(req, VOCAB, 1)


def test_token_arrays_check_the_vocab() -> None:
    with pytest.raises(TraceError):
        prompt_token_array(TraceRequest("r", 0.0, 3, 1), 10, 0)


@pytest.mark.parametrize("req", [
    TraceRequest("a", 0.0, 1000, 7, hash_ids=(7, 8), hash_block_size=512),
    TraceRequest("r", 0.0, 30, 4, segments=(Span("p:sys", 10), Span("u:r", 20))),
    TraceRequest("u", 0.0, 77, 1),
    TraceRequest("x", 0.0, 3, 2, prompt_token_ids=(1, 2, 3)),
])
def test_request_token_arrays_are_the_prompt_and_output_arrays(req: TraceRequest) -> None:
    prompt, output = request_token_arrays(req, VOCAB, 4)
    assert prompt == prompt_token_array(req, VOCAB, 4)
    assert output == output_token_array(req, VOCAB, 4)
    prompt.append(11)
    output.append(11)
