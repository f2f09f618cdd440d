"""rt JSONL round-trips exactly; malformed files name the line, key and value."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workloads import (
    Span,
    Trace,
    TraceError,
    TraceRequest,
    load_trace,
    read_rt_jsonl,
    write_rt_jsonl,
)
from workloads.rtformat import dump_lines, parse_rt_lines

from .helpers import FIXTURES, write

HEADER = '{"format": "rt-trace", "version": 1, "name": "t", "requests": %d}\n'


@st.composite
def requests(draw: st.DrawFn, index: int) -> TraceRequest:
    prompt_len = draw(st.integers(1, 300))
    kind = draw(st.sampled_from(["plain", "tokens", "hash", "segments"]))
    extra: dict[str, object] = {}
    if kind == "tokens":
        extra["prompt_token_ids"] = tuple(draw(st.lists(st.integers(0, 200000),
                                                        min_size=prompt_len,
                                                        max_size=prompt_len)))
    elif kind == "hash":
        block = draw(st.sampled_from([16, 64, 512]))
        count = draw(st.integers(0, -(-prompt_len // block)))
        extra["hash_ids"] = tuple(draw(st.lists(st.integers(0, 2**40), min_size=count,
                                                max_size=count)))
        extra["hash_block_size"] = block
    elif kind == "segments":
        cut = draw(st.integers(0, prompt_len - 1))
        spans = [Span("p:shared", cut)] if cut else []
        extra["segments"] = (*spans, Span(f"u:{index}", prompt_len - cut))
    return TraceRequest(
        request_id=f"r{index}", arrival_s=draw(st.floats(0, 1e6, allow_nan=False)),
        prompt_len=prompt_len, output_len=draw(st.integers(1, 5000)),
        session_id=draw(st.none() | st.text(max_size=8)),
        priority=draw(st.integers(-5, 5)), cache_salt=draw(st.none() | st.text(max_size=8)),
        **extra)  # type: ignore[arg-type]


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    n = draw(st.integers(0, 8))
    reqs = sorted((draw(requests(i)) for i in range(n)), key=lambda r: r.arrival_s)
    return Trace(tuple(reqs), name=draw(st.none() | st.text(max_size=10)))


@given(traces())
@settings(max_examples=80, deadline=None)
def test_round_trip_is_exact(trace: Trace) -> None:
    assert parse_rt_lines(dump_lines(trace)) == trace


def test_real_trace_round_trips_through_a_file(tmp_path: Path) -> None:
    trace = load_trace(FIXTURES / "mooncake_synthetic_first200.jsonl").trace
    write_rt_jsonl(trace, tmp_path / "sub" / "t.jsonl")
    again = read_rt_jsonl(tmp_path / "sub" / "t.jsonl")
    assert again == trace and again.name == "mooncake_synthetic_first200.jsonl"
    assert load_trace(tmp_path / "sub" / "t.jsonl").report.format == "rt"


def test_written_form_is_documented_json(tmp_path: Path) -> None:
    trace = Trace((TraceRequest("a", 1.5, 3, 2, segments=(Span("p:x", 1), Span("u:a", 2)),
                           session_id="s", priority=1),), name="n")
    write_rt_jsonl(trace, tmp_path / "t.jsonl")
    assert (tmp_path / "t.jsonl").read_text() == (
        '{"format": "rt-trace", "version": 1, "name": "n", "requests": 1}\n'
        '{"id": "a", "arrival_s": 1.5, "prompt_len": 3, "output_len": 2, '
        '"segments": [["p:x", 1], ["u:a", 2]], "session_id": "s", "priority": 1}\n')


@pytest.mark.parametrize(("body", "line", "column", "value"), [
    (HEADER % 1 + '{"id": "a", "arrival_s": 0, "prompt_len": 3}\n', 2, "output_len", None),
    (HEADER % 1 + '{"id": "a", "arrival_s": 0, "prompt_len": 3, "output_len": 1, "x": 1}\n',
     2, "x", 1),
    (HEADER % 1 + '{"id": "a", "arrival_s": -1, "prompt_len": 3, "output_len": 1}\n',
     2, "arrival_s", -1),
    (HEADER % 1 + '{"id": "a", "arrival_s": 0, "prompt_len": "3", "output_len": 1}\n',
     2, "prompt_len", "3"),
    (HEADER % 2 + '{"id": "a", "arrival_s": 5, "prompt_len": 3, "output_len": 1}\n\n'
     '{"id": "b", "arrival_s": 4, "prompt_len": 3, "output_len": 1}\n', 4, "arrival_s", 4.0),
    (HEADER % 2 + '{"id": "a", "arrival_s": 0, "prompt_len": 3, "output_len": 1}\n'
     '{"id": "a", "arrival_s": 1, "prompt_len": 3, "output_len": 1}\n', 3, "request_id", "a"),
    (HEADER % 2 + '{"id": "a", "arrival_s": 0, "prompt_len": 3, "output_len": 1}\n', 1,
     "requests", 2),
    ('{"format": "rt-trace", "version": 2, "requests": 0}\n', 1, "version", 2),
    (HEADER % 1 + '{"id": "a", "arrival_s": 0, "prompt_len": 3, "output_len": 1, '
     '"segments": [["u:a", 2]]}\n', 2, "segments", 2),
    (HEADER % 1 + "{not json}\n", 2, None, "{not json}"),
])
def test_malformed_files_name_line_column_value(tmp_path: Path, body: str, line: int,
                                                column: str | None, value: object) -> None:
    path = write(tmp_path / "bad.jsonl", body)
    with pytest.raises(TraceError) as info:
        read_rt_jsonl(path)
    err = info.value
    assert (err.path, err.line, err.column, err.value) == (str(path), line, column, value)
    assert str(err).startswith(f"{path}:{line}: ")
