"""Loading the real-trace fixtures reproduces the shared README's statistics.

Whole files (Azure conv, both BurstGPT excerpts) are pinned to the README's numbers; excerpts
(first N rows) are pinned to values cross-checked with an independent pandas computation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from workloads import load_trace, read_rows, rows_stats, trace_stats
from workloads.stats import TraceStats

from .helpers import FIXTURES


def _stats(name: str, **kwargs: object) -> TraceStats:
    return trace_stats(load_trace(FIXTURES / name, **kwargs).trace)  # type: ignore[arg-type]


def _lengths(s: TraceStats) -> tuple[float, ...]:
    return (round(s.prompt.mean, 1), s.prompt.p50, round(s.prompt.p99, 1), s.prompt.max,
            round(s.output.mean, 1), s.output.p50, round(s.output.p99, 1), s.output.max)


def test_azure_conv_whole_file_matches_readme() -> None:
    s = _stats("azure_conv_2023_head.csv")
    assert s.rows == 19366
    assert s.time is not None
    assert round(s.time.span_s, 1) == 3501.7
    assert round(s.time.mean_rate, 3) == 5.530
    assert (s.time.peak_per_min, s.time.peak_per_s) == (507, 16)
    assert (round(s.time.ia_cv, 2), round(s.time.iod_1s, 2)) == (1.09, 1.39)
    assert _lengths(s) == (1154.7, 1020, 4142, 14050, 211.1, 129, 601, 1000)
    assert s.prefix is None


def test_azure_first_arrivals_are_relative_seconds() -> None:
    trace = load_trace(FIXTURES / "azure_conv_2023_head.csv").trace
    # 18:15:46.6805900 -> 18:15:50.9951690 -> 18:15:51.2224670
    assert [r.arrival_s for r in trace.requests[:3]] == [0.0, 4.314579, 4.541877]
    assert (trace[0].prompt_len, trace[0].output_len, trace[0].request_id) == (374, 44, "0")


def test_burstgpt_drops_and_counts_failed_rows() -> None:
    result = load_trace(FIXTURES / "burstgpt_head.csv")
    assert result.report.rows_read == 400
    assert result.report.dropped_failed == 17
    assert result.report.models == {"ChatGPT": 320, "GPT-4": 80}
    s = trace_stats(result.trace)
    assert s.rows == 383
    # README row "burstgpt_head.csv (without the 17 failed rows)"
    assert _lengths(s)[:3] + _lengths(s)[4:7] == (543.6, 353, 1958.4, 288.8, 238, 1424.8)


def test_burstgpt_all_rows_match_readme() -> None:
    s = rows_stats(read_rows(FIXTURES / "burstgpt_head.csv"))
    assert s.rows == 400 and s.time is not None
    assert s.time.span_s == 37269.0
    assert round(s.time.mean_rate, 4) == 0.0107
    assert (s.time.peak_per_min, s.time.peak_per_s) == (8, 2)
    assert (round(s.time.ia_cv, 2), round(s.time.iod_1s, 2)) == (4.56, 1.01)
    assert _lengths(s) == (520.5, 314, 1958.0, 2126, 276.5, 229.5, 1421.2, 2019)


def test_burstgpt3_all_rows_match_readme_and_sessions_are_kept() -> None:
    s = rows_stats(read_rows(FIXTURES / "burstgpt3_head.csv"))
    assert s.rows == 400 and s.time is not None
    assert s.time.span_s == 41453.0  # 19,440,110 s to 19,481,563 s
    assert round(s.time.mean_rate, 4) == 0.0096
    assert (s.time.peak_per_min, s.time.peak_per_s) == (7, 2)
    assert (round(s.time.ia_cv, 2), round(s.time.iod_1s, 2)) == (2.87, 1.01)
    assert _lengths(s) == (617.4, 308.5, 5928.8, 25085, 170.9, 101, 862.2, 1101)
    rows = read_rows(FIXTURES / "burstgpt3_head.csv")
    assert rows.session_id is not None
    sessions = rows.session_id
    assert sum(s is None for s in sessions) == 6  # the API-log rows
    assert len({s for s in sessions if s is not None}) == 135
    assert max(sessions.count(s) for s in set(sessions) if s is not None) == 24
    trace = load_trace(FIXTURES / "burstgpt3_head.csv").trace
    # the one failed row was the only turn of its session
    assert len({r.session_id for r in trace if r.session_id is not None}) == 134


def test_burstgpt_model_filter() -> None:
    result = load_trace(FIXTURES / "burstgpt_head.csv", model="GPT-4")
    assert result.report.dropped_model == 320
    assert len(result.trace) == 80 - sum(
        1 for line in (FIXTURES / "burstgpt_head.csv").read_text().splitlines()[1:]
        if ",GPT-4," in line and line.split(",")[3] == "0")


def test_azure_code_excerpt() -> None:
    s = _stats("azure_code_2023_first1000.csv")
    assert s.rows == 1000 and s.time is not None
    assert round(s.time.span_s, 6) == 521.588576
    assert (s.time.peak_per_min, s.time.peak_per_s) == (531, 32)
    assert (round(s.time.ia_cv, 3), round(s.time.iod_1s, 3)) == (11.009, 11.658)
    assert _lengths(s) == (2122.4, 1469, 7436, 7436, 27.6, 13, 283.1, 841)


@pytest.mark.parametrize(("name", "expected"), [
    ("mooncake_conversation_first300.jsonl",
     dict(span=102.0, peaks=(162, 16), cv=2.792, iod=6.981, refs=8490, distinct=7814,
          reuse=0.0796, tokens=0.0810,
          lengths=(14233.2, 8768.5, 87198.9, 120633, 376.9, 397, 906.2, 2000))),
    ("mooncake_synthetic_first200.jsonl",
     dict(span=58.501, peaks=(200, 9), cv=1.007, iod=1.090, refs=5330, distinct=5007,
          reuse=0.0606, tokens=0.0619,
          lengths=(13317.4, 11998.5, 54664.5, 82831, 191.8, 160.5, 790.0, 800))),
])
def test_mooncake_excerpts(name: str, expected: dict[str, object]) -> None:
    s = _stats(name)
    assert s.time is not None and s.prefix is not None
    assert s.time.span_s == pytest.approx(expected["span"], abs=1e-9)
    assert (s.time.peak_per_min, s.time.peak_per_s) == expected["peaks"]
    assert (round(s.time.ia_cv, 3), round(s.time.iod_1s, 3)) == (expected["cv"], expected["iod"])
    assert (s.prefix.block_refs, s.prefix.distinct_blocks) == (expected["refs"],
                                                               expected["distinct"])
    assert round(s.prefix.block_reuse, 4) == expected["reuse"]
    assert round(s.prefix.token_hit_fraction, 4) == expected["tokens"]
    assert s.prefix.block_size == 512
    assert _lengths(s) == expected["lengths"]


def test_mooncake_hash_ids_and_millisecond_timestamps() -> None:
    trace = load_trace(FIXTURES / "mooncake_conversation_first300.jsonl").trace
    first = trace[0]
    assert (first.prompt_len, first.output_len, first.hash_block_size) == (6758, 500, 512)
    assert first.hash_ids == tuple(range(14))
    assert all(r.hash_ids is not None and r.hash_ids[0] == 0 for r in trace)
    last_ms = int((FIXTURES / "mooncake_conversation_first300.jsonl").read_text()
                  .splitlines()[-1].split('"timestamp": ')[1].split(",")[0])
    assert trace[-1].arrival_s == last_ms / 1000


@pytest.mark.parametrize(("name", "expected"), [
    ("sharegpt_lengths_first1000.csv", (2388.1, 1801, 7395.4, 8014, 454.5, 434, 985, 1021)),
    ("arxiv_summarization_lengths_first1000.csv",
     (2566.9, 2708, 3937.1, 4009, 297.5, 166, 3098.1, 3716)),
])
def test_length_only_files(name: str, expected: tuple[float, ...]) -> None:
    result = load_trace(FIXTURES / name)
    s = trace_stats(result.trace)
    assert result.report.synthetic_arrivals and s.rows == 1000
    assert s.time is None  # default process: request rate inf, everything at t = 0
    assert _lengths(s) == expected


def test_fixture_folder_is_self_contained() -> None:
    names = {p.name for p in FIXTURES.iterdir()}
    assert "ATTRIBUTION.md" in names
    text = (FIXTURES / "ATTRIBUTION.md").read_text()
    for name in names - {"ATTRIBUTION.md"}:
        assert f"`{name}`" in text, f"{name} lacks attribution"
    assert all(isinstance(p, Path) for p in FIXTURES.iterdir())
