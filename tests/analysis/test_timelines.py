"""Request timelines rebuilt from a run's files (analysis.timelines), on a hand-made run
whose every segment is worked out by hand (tests/analysis/handmade.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.engine_steps import EngineSteps, StepIndex
from analysis.timelines import engine_timeline, part_totals, request_timeline
from tests.analysis.handmade import (
    EXPECTED,
    FLEET_CHUNKS,
    FLEET_EXPECTED,
    PARTS,
    PD_CHUNKS,
    PD_EXPECTED,
    PD_REQUEST,
    REQUEST,
    client_run,
    fleet_run,
    pd_run,
    timeline_run,
)


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


def _kinds_and_times(segments: list) -> tuple[list[str], list[float]]:
    """Kinds, and start and end times flattened (pytest.approx compares flat lists)."""
    return [s.kind for s in segments], [t for s in segments for t in (s.start_s, s.end_s)]


def _expected(spans: list[tuple[str, float, float]]) -> tuple[list[str], list[float]]:
    return [k for k, _, _ in spans], [t for _, a, b in spans for t in (a, b)]


def test_a_fleet_request_is_read_from_its_own_replicas_steps(tmp_path: Path) -> None:
    run = fleet_run(tmp_path)
    steps = EngineSteps(run.steps)
    assert sorted(steps.replicas) == [0, 1]
    for _, row in run.requests.iterrows():
        rid = row["request_id"]
        tl = engine_timeline(row, steps)
        kinds, times = _kinds_and_times(tl.segments)
        expected_kinds, expected_times = _expected(FLEET_EXPECTED[rid])
        assert kinds == expected_kinds, rid
        assert times == pytest.approx(expected_times, abs=1e-12), rid
        assert [(c.args.get("replica"), c.args["step"]) for c in tl.chunks] == \
            FLEET_CHUNKS[rid]
        totals = part_totals(tl)
        for part in (*PARTS, "routing_s"):
            assert totals.get(part, 0.0) == pytest.approx(row[part], abs=1e-12), (rid, part)


def test_reading_a_fleet_as_one_engine_gets_it_wrong(tmp_path: Path) -> None:
    """The hand-made fleet tells the readings apart: replica 1's steps interleave with
    replica 0's, so R's wait and F1's prefill come out wrong when all steps are one
    engine's."""
    run = fleet_run(tmp_path)
    one_engine = StepIndex(run.steps.sort_values("start_s", kind="stable"))
    wrong = 0
    for _, row in run.requests.iterrows():
        kinds, times = _kinds_and_times(request_timeline(row, one_engine).segments)
        expected_kinds, expected_times = _expected(FLEET_EXPECTED[row["request_id"]])
        wrong += kinds != expected_kinds or times != pytest.approx(expected_times, abs=1e-12)
    assert wrong >= 2


def test_a_pd_request_prefills_on_one_replica_and_decodes_on_another(tmp_path: Path) -> None:
    run = pd_run(tmp_path)
    tl = engine_timeline(run.requests.iloc[0], EngineSteps(run.steps))
    kinds, times = _kinds_and_times(tl.segments)
    assert (kinds, times) == (_expected(PD_EXPECTED)[0],
                              pytest.approx(_expected(PD_EXPECTED)[1], abs=1e-12))
    assert [(c.args["replica"], c.args["step"]) for c in tl.chunks] == PD_CHUNKS
    transfer = next(s for s in tl.segments if s.kind == "kv_transfer_s")
    assert transfer.args == {"bytes": 26_214_400, "from": 0, "to": 1}
    api = [s.args for s in tl.segments if s.kind == "api_server_s"]
    assert api == [{"replica": 0}, {"replica": 1}]
    totals = part_totals(tl)
    for part in (*PARTS, "routing_s", "kv_transfer_s"):
        assert totals.get(part, 0.0) == pytest.approx(PD_REQUEST[part], abs=1e-12), part
