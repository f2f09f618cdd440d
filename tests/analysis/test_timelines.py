"""Request timelines rebuilt from a run's files (analysis.timelines), on a hand-made run
whose every segment is worked out by hand (tests/analysis/handmade.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.timelines import StepIndex, part_totals, request_timeline
from tests.analysis.handmade import EXPECTED, PARTS, REQUEST, client_run, timeline_run


def test_segments_of_the_hand_made_request(tmp_path: Path) -> None:
    run = timeline_run(tmp_path)
    tl = request_timeline(run.requests.iloc[0], StepIndex(run.steps))
    assert [s.kind for s in tl.segments] == [kind for kind, _, _ in EXPECTED]
    for seg, (_, start, end) in zip(tl.segments, EXPECTED, strict=True):
        assert (seg.start_s, seg.end_s) == pytest.approx((start, end), abs=1e-12)
    assert [s.args for s in tl.segments if s.kind == "decode_s"] == [
        {"tokens": 2}, {"tokens": 1}, {"tokens": 1}]
    assert [c.args["step"] for c in tl.chunks] == [3, 4]
    assert [t for c in tl.chunks for t in (c.start_s, c.end_s)] == pytest.approx(
        [0.03, 0.04, 0.04, 0.05])


def test_segment_totals_equal_the_recorded_parts(tmp_path: Path) -> None:
    run = timeline_run(tmp_path)
    totals = part_totals(request_timeline(run.requests.iloc[0], StepIndex(run.steps)))
    for part in PARTS:
        assert totals.get(part, 0.0) == pytest.approx(REQUEST[part], abs=1e-12), part


def test_a_client_timed_request_has_only_what_the_client_saw(tmp_path: Path) -> None:
    run = client_run(tmp_path)
    tl = request_timeline(run.requests.iloc[0], StepIndex(run.steps), client_timed=True)
    assert [(s.kind, s.start_s, s.end_s) for s in tl.segments] == [
        ("client_wait_s", 0.0, 0.2), ("client_stream_s", 0.2, 0.3)]
    assert tl.chunks == []


def test_coalescing_bounds_segments_and_keeps_the_tiling() -> None:
    from analysis.timelines import RequestTimeline, Segment, coalesced

    kinds = ("queue_kv_capacity_s", "queue_token_budget_s")
    tiny = [Segment(kinds[i % 2], i / 1000, (i + 1) / 1000) for i in range(100)]  # 0.1 s
    tl = RequestTimeline("R", 0.0, 1.0, [*tiny, Segment("decode_s", 0.1, 1.0)], [])
    assert coalesced(tl, max_segments=200) == tl.segments  # under the bound: untouched
    merged = coalesced(tl, max_segments=10)
    assert [s.kind for s in merged] == ["mixed_s", "decode_s"]
    assert (merged[0].start_s, merged[0].end_s) == (0.0, 0.1)
    assert merged[0].args["segments"] == 100
    assert merged[0].args["queue: KV capacity ms"] == pytest.approx(50.0)
