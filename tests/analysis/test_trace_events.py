"""Chrome trace events of a run (analysis.trace_events): exact spans of the hand-made run,
and the format Perfetto reads: well-formed events, microsecond timestamps, spans nested
and in time order per track."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from analysis.rundir import load_run, run_info, write_run
from analysis.trace_events import (
    ENGINE_PID,
    REPLICA_PID,
    REQUESTS_PID,
    select_requests,
    trace_events,
    write_trace_events,
)
from tests.analysis.conftest import HAND_REQUESTS, HAND_STEPS
from tests.analysis.handmade import (
    EXPECTED,
    FLEET_CHUNKS,
    FLEET_EXPECTED,
    PD_CHUNKS,
    PD_EXPECTED,
    client_run,
    fleet_run,
    pd_run,
    timeline_run,
)

PHASES = {"X", "C", "M"}


def check_format(document: dict[str, Any]) -> None:
    """The trace-event format's rules that Perfetto relies on."""
    assert set(document) >= {"traceEvents"}
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in document["traceEvents"]:
        assert event["ph"] in PHASES, event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int), event
        assert isinstance(event["name"], str) and event["name"], event
        if event["ph"] == "M":
            assert set(event["args"]) & {"name", "sort_index"}, event
            continue
        assert isinstance(event["ts"], float | int) and event["ts"] >= 0, event
        if event["ph"] == "C":
            assert all(isinstance(v, int | float) for v in event["args"].values()), event
            continue
        assert isinstance(event["dur"], float | int) and event["dur"] >= 0, event
        tracks[(event["pid"], event["tid"])].append(event)
    for spans in tracks.values():
        starts = [e["ts"] for e in spans]
        assert starts == sorted(starts), "spans in time order per track"
        open_ends: list[float] = []
        for e in spans:  # each span inside the enclosing one, or after it (to 1 ns: ts and
            # dur are rounded to it, so ts + dur may miss the next ts by a float ulp)
            while open_ends and e["ts"] >= open_ends[-1] - 1e-3:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + 1e-3, e
            open_ends.append(end)


def _spans(document: dict[str, Any], pid: int, tid: int) -> list[dict[str, Any]]:
    return [e for e in document["traceEvents"]
            if e["ph"] == "X" and e["pid"] == pid and e["tid"] == tid]


def test_request_track_of_the_hand_made_run(tmp_path: Path) -> None:
    document = trace_events(timeline_run(tmp_path))
    check_format(document)
    spans = _spans(document, REQUESTS_PID, 1)
    assert len(spans) == 1 + len(EXPECTED) + 2  # the request, its segments, two chunks
    root = spans[0]
    assert (root["name"], root["ts"], root["dur"]) == ("request R", 0.0, 130000.0)
    assert root["args"]["ttft_ms"] == pytest.approx(50.0)
    segments = [e for e in spans[1:] if e["cat"] != "prefill_chunk"]
    assert [(e["cat"], e["ts"], e["dur"]) for e in segments] == [
        (kind.removesuffix("_s"), round(a * 1e6, 3), round(round(b * 1e6, 3) - a * 1e6, 3))
        for kind, a, b in EXPECTED]
    chunks = [e for e in spans if e["cat"] == "prefill_chunk"]
    assert [(e["name"], e["ts"], e["dur"], e["args"]["step"]) for e in chunks] == [
        ("chunk 0", 30000.0, 10000.0, 3), ("chunk 1", 40000.0, 10000.0, 4)]


def test_engine_track_and_counters(tmp_path: Path) -> None:
    document = trace_events(timeline_run(tmp_path), max_steps=None)
    steps = _spans(document, ENGINE_PID, 1)
    assert len(steps) == 13
    assert [e["dur"] for e in steps] == [10000.0] * 13
    assert steps[3]["name"] == "P 100" and steps[5]["name"] == "D 1"
    assert steps[7]["args"]["num_preempted"] == 1
    counters = [e for e in document["traceEvents"] if e["ph"] == "C"]
    requests = [(e["ts"], e["args"]["running"], e["args"]["waiting"]) for e in counters
                if e["name"] == "requests"]
    assert requests == [(10000.0, 0, 0), (20000.0, 0, 1), (40000.0, 1, 0), (80000.0, 0, 1),
                        (100000.0, 1, 0)]  # at step ends, one event per change
    kv = [(e["ts"], e["args"]["kv"]) for e in counters if e["name"] == "KV cache usage (%)"]
    assert kv == [(10000.0, 0.0), (40000.0, 50.0), (80000.0, 0.0), (100000.0, 50.0)]


def test_merging_decode_runs_bounds_the_engine_track(tmp_path: Path) -> None:
    document = trace_events(timeline_run(tmp_path), max_steps=5)
    check_format(document)
    names = [e["name"] for e in _spans(document, ENGINE_PID, 1)]
    # back-to-back decode-only steps of one sequence merge: 0-2, 5-8, 10-12
    assert names == ["D 1 x 3", "P 100", "P 100", "D 1 x 4", "P 100", "D 1 x 3"]


def test_sampling_keeps_the_slowest_and_spreads_the_rest(tmp_path: Path) -> None:
    write_run(tmp_path / "hand", HAND_REQUESTS, HAND_STEPS,
              run_info("simulate", "hand", {"name": "hand", "requests": 4, "digest": "abc"}))
    run = load_run(tmp_path / "hand")
    kept = select_requests(run.requests, 2)
    assert list(kept["request_id"]) == ["A", "C"]  # C: the slowest by E2E; A: the spread
    windowed = select_requests(run.requests, None, window=(0.4, 0.9))
    assert list(windowed["request_id"]) == ["B"]


def test_written_file_loads_and_client_runs_have_no_engine_track(tmp_path: Path) -> None:
    path = write_trace_events(client_run(tmp_path), tmp_path / "t.json")
    document = json.loads(path.read_text())
    check_format(document)
    assert _spans(document, ENGINE_PID, 1) == []
    assert [e["name"] for e in _spans(document, REQUESTS_PID, 1)] == [
        "request c0", "waiting for first token (client)", "streaming (client)"]
    assert document["otherData"]["timing"] == "client"


def _us(spans: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """(cat, ts, dur) of segments given in seconds, rounded as the file rounds them."""
    return [(kind.removesuffix("_s"), round(a * 1e6, 3), round(round(b * 1e6, 3) -
                                                             round(a * 1e6, 3), 3))
            for kind, a, b in spans]


def _segments_and_chunks(document: dict[str, Any], tid: int
                         ) -> tuple[list[tuple[str, float, float]], list[tuple[int, int]]]:
    spans = _spans(document, REQUESTS_PID, tid)[1:]  # after the whole request
    segments = [(e["cat"], e["ts"], e["dur"]) for e in spans if e["cat"] != "prefill_chunk"]
    chunks = [(e["args"]["replica"], e["args"]["step"]) for e in spans
              if e["cat"] == "prefill_chunk"]
    return segments, chunks


def _processes(document: dict[str, Any]) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in document["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


def test_a_fleet_has_an_engine_process_per_replica(tmp_path: Path) -> None:
    document = trace_events(fleet_run(tmp_path), max_steps=None)
    check_format(document)
    assert _processes(document) == {REPLICA_PID: "replica 0", REPLICA_PID + 1: "replica 1",
                                    REQUESTS_PID: "requests"}
    zero, one = (_spans(document, REPLICA_PID + r, 1) for r in (0, 1))
    assert [e["dur"] for e in zero] == [10000.0] * 13
    assert [(e["name"], e["ts"], e["dur"]) for e in one] == [
        ("P 100", 5000.0, 25000.0), ("D 1", 30000.0, 25000.0), ("P 50 + D 1", 55000.0, 25000.0),
        ("D 1", 80000.0, 25000.0)]
    kv = [(e["pid"], e["ts"], e["args"]["kv"]) for e in document["traceEvents"]
          if e["ph"] == "C" and e["name"] == "KV cache usage (%)" and e["pid"] == REPLICA_PID + 1]
    assert kv == [(101, 30000.0, 25.0), (101, 55000.0, 50.0), (101, 80000.0, 75.0),
                  (101, 105000.0, 100.0)]


def test_fleet_request_spans_come_from_their_own_replicas_steps(tmp_path: Path) -> None:
    document = trace_events(fleet_run(tmp_path))
    names = {e["tid"]: e["args"]["name"] for e in document["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == REQUESTS_PID}
    for tid, name in names.items():
        rid = name.removeprefix("req ")
        segments, chunks = _segments_and_chunks(document, tid)
        assert segments == _us(FLEET_EXPECTED[rid]), rid
        assert chunks == FLEET_CHUNKS[rid], rid
        root = _spans(document, REQUESTS_PID, tid)[0]
        assert root["args"]["replica"] == (0 if rid == "R" else 1)
        assert root["args"]["routing_ms"] == pytest.approx(1.0)


def test_pd_spans_prefill_transfer_and_decode(tmp_path: Path) -> None:
    document = trace_events(pd_run(tmp_path))
    check_format(document)
    assert _processes(document) == {REPLICA_PID: "replica 0 (p, prefill)",
                                    REPLICA_PID + 1: "replica 1 (d, decode)",
                                    REQUESTS_PID: "requests"}
    segments, chunks = _segments_and_chunks(document, 1)
    assert segments == _us(PD_EXPECTED)
    assert chunks == PD_CHUNKS
    transfer = next(e for e in _spans(document, REQUESTS_PID, 1) if e["cat"] == "kv_transfer")
    assert (transfer["name"], transfer["args"]) == (
        "KV transfer", {"bytes": 26_214_400, "from": 0, "to": 1})
    root = _spans(document, REQUESTS_PID, 1)[0]
    assert {k: root["args"][k] for k in ("replica", "prefill_replica", "kv_transfer_ms")} == \
        {"replica": 1, "prefill_replica": 0, "kv_transfer_ms": 5.0}
