"""The trace model's invariants, and prefix-reuse statistics on explicit token ids."""

from __future__ import annotations

import pytest

from workloads import Span, Trace, TraceError, TraceRequest, trace_stats

from .helpers import simple_trace


@pytest.mark.parametrize(("kwargs", "column"), [
    ({"arrival_s": -0.5}, "arrival_s"), ({"arrival_s": float("nan")}, "arrival_s"),
    ({"arrival_s": True}, "arrival_s"), ({"prompt_len": 0}, "prompt_len"),
    ({"output_len": 0}, "output_len"), ({"prompt_len": 2.0}, "prompt_len"),
    ({"request_id": ""}, "request_id"),
    ({"prompt_token_ids": (1, 2)}, "prompt_token_ids"),
    ({"hash_ids": (1, 2), "hash_block_size": 4}, "hash_ids"),
    ({"hash_ids": (1,)}, "hash_block_size"),
    ({"segments": (Span("p:x", 2),)}, "segments"),
    ({"segments": (Span("u:r", 3),), "hash_ids": (1,), "hash_block_size": 4}, "request_id"),
])
def test_request_rejects(kwargs: dict[str, object], column: str) -> None:
    base: dict[str, object] = {"request_id": "r", "arrival_s": 0.0, "prompt_len": 3,
                               "output_len": 1}
    with pytest.raises(TraceError) as info:
        TraceRequest(**{**base, **kwargs})  # type: ignore[arg-type]
    assert info.value.column == column


def test_trace_rejects_unsorted_and_duplicate_ids() -> None:
    with pytest.raises(TraceError, match="sorted"):
        simple_trace([1.0, 0.5])
    with pytest.raises(TraceError, match="unique") as info:
        Trace((TraceRequest("a", 0.0, 1, 1), TraceRequest("a", 1.0, 1, 1)))
    assert info.value.value == "a"


def test_columns_and_membership() -> None:
    trace = simple_trace([0.0, 2.0], prompt_len=7, output_len=3)
    cols = trace.columns()
    assert cols.arrival_s.tolist() == [0.0, 2.0] and cols.prompt_len.tolist() == [7, 7]
    assert cols.output_len.dtype.kind == "i" and "1" in trace and "2" not in trace
    assert trace[1].request_id == "1" and len(trace) == 2


def test_prefix_reuse_on_explicit_tokens_counts_full_chained_blocks() -> None:
    shared = tuple(range(100, 132))  # two 16-token blocks
    reqs = (TraceRequest("a", 0.0, 40, 1, prompt_token_ids=shared + tuple(range(8))),
            TraceRequest("b", 1.0, 48, 1, prompt_token_ids=shared + tuple(range(200, 216))),
            TraceRequest("c", 2.0, 32, 1, prompt_token_ids=tuple(range(200, 216)) + shared[:16]))
    prefix = trace_stats(Trace(reqs), block_size=16).prefix
    assert prefix is not None
    # refs: a 2, b 3, c 2; hits: b's 2 leading blocks only (c's second block has another parent)
    assert (prefix.block_refs, prefix.distinct_blocks) == (7, 5)
    assert prefix.block_reuse == 2 / 7
    assert prefix.token_hit_fraction == 32 / 120


def test_traces_without_structure_report_no_reuse() -> None:
    assert trace_stats(simple_trace([0.0, 1.0])).prefix is None
