"""vLLM's timed_trace JSONL (`rt trace convert --to timed_trace`) and back: arrivals, lengths
and prefix sharing survive; every prompt gets the ids vLLM needs to expand it in full."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from cli import app
from workloads import ArrivalProcess, load_trace, write_rt_jsonl
from workloads.synthetic import PrefixRepetition, prefix_repetition_trace
from workloads.trace import Trace, TraceRequest

runner = CliRunner()


def test_timed_trace_round_trip(tmp_path: Path) -> None:
    # 6 requests over 2 prefixes of 40 tokens, 20 unique tokens each, at 2 req/s.
    trace = prefix_repetition_trace(6, PrefixRepetition(40, 20, 2, 8),
                                    ArrivalProcess(2.0, 1.0, 3))
    src, dst = tmp_path / "t.jsonl", tmp_path / "timed.jsonl"
    write_rt_jsonl(trace, src)
    result = runner.invoke(app, ["trace", "convert", str(src), str(dst), "--to", "timed_trace"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert set(rows[0]) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert all(len(r["hash_ids"]) == 4 for r in rows)  # ceil(60 / 16): vLLM expands all 60
    # Blocks 0-1 are pure prefix (shared by requests of one prefix); block 2 mixes the
    # prefix's last 8 tokens with unique ones, so from there every prompt has its own ids.
    by_prefix: dict[tuple[int, int], list[list[int]]] = {}
    for r in rows:
        by_prefix.setdefault(tuple(r["hash_ids"][:2]), []).append(r["hash_ids"])
    assert sorted(len(group) for group in by_prefix.values()) == [3, 3]
    assert len({h for r in rows for h in r["hash_ids"][2:]}) == 6 * 2
    back = load_trace(dst, "timed_trace").trace
    first = min(r.arrival_s for r in trace)
    ordered = sorted(trace, key=lambda r: r.arrival_s)
    assert [r.prompt_len for r in back] == [r.prompt_len for r in ordered]
    assert [r.output_len for r in back] == [r.output_len for r in ordered]
    assert [round(r.arrival_s, 6) for r in back] == \
        [round(r.arrival_s - first, 6) for r in ordered]
    assert [list(r.hash_ids or ()) for r in back] == [r["hash_ids"] for r in rows]
    assert {r.hash_block_size for r in back} == {16}
    # Written again from what was read: the same rows (times from the first arrival).
    again = tmp_path / "again.jsonl"
    result = runner.invoke(app, ["trace", "convert", str(dst), str(again), "--format",
                                 "timed_trace", "--to", "timed_trace"])
    assert result.exit_code == 0, result.output
    rows2 = [json.loads(line) for line in again.read_text().splitlines()]
    t0 = rows[0]["timestamp"]
    assert rows2 == [{**r, "timestamp": round(r["timestamp"] - t0, 9)} for r in rows]


def test_explicit_token_prompts_share_ids_by_content(tmp_path: Path) -> None:
    a = tuple(range(10, 42))  # 32 tokens: 2 blocks
    trace = Trace((TraceRequest("a", 0.0, 32, 1, prompt_token_ids=a),
                   TraceRequest("b", 1.0, 20, 1, prompt_token_ids=a[:16] + (99,) * 4)))
    dst = tmp_path / "t.jsonl"
    from workloads import write_timed_trace

    write_timed_trace(trace, dst)
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["hash_ids"] for r in rows] == [[0, 1], [0, 2]]


def test_bad_to_is_one_line(tmp_path: Path) -> None:
    src = tmp_path / "t.jsonl"
    write_rt_jsonl(Trace((TraceRequest("a", 0.0, 4, 1),)), src)
    result = runner.invoke(app, ["trace", "convert", str(src), str(tmp_path / "o"),
                                 "--to", "timedtrace"])
    assert result.exit_code != 0
    assert "--to" in result.output and "timedtrace" in result.output
