"""rt's scheduler against vLLM's own V1 scheduler on random cases, step for step: tokens per
request, block ids of new and running requests, the free-block queue in order, preemptions,
resumptions, finishes and their reasons, queues, request counters and prefix-cache counters.

The expected records are vLLM 0.32's (with the one 0.33 change rt's spec follows, the
priority self-preemption), frozen by `docs/tools/oracle_diff/freeze.py` from random cases:
the smallest case of each set of features (tests/fixtures/oracle/ATTRIBUTION.md), from
`cases.py`'s random cases and from `edge_cases.py`'s edge shapes.
"""

from __future__ import annotations

import gzip
import json
from itertools import zip_longest
from pathlib import Path
from typing import Any

import pytest

from tests.runtime.oracle_replay import differing_fields, run_events, trim_idle

FIXTURES = Path(__file__).parent.parent / "fixtures" / "oracle"


def _load(name: str) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = json.loads(gzip.decompress((FIXTURES / name).read_bytes()))
    return cases


CASES = _load("random_cases.json.gz")
EDGE_CASES = _load("edge_cases.json.gz")  # docs/tools/oracle_diff/edge_cases.py's shapes


def test_the_cases_cover_what_they_claim() -> None:
    assert len(CASES) >= 40
    records = [rec for case in CASES for rec in case["vllm"]]
    assert any(rec.get("preempted") for rec in records)
    assert any(rec.get("resumed") for rec in records)
    assert any(rec.get("aborted") for rec in records)
    assert {done["reason"] for rec in records for done in rec.get("finished", [])} == {
        "stop", "length"}  # an abort is no step's output
    assert {case["config"]["policy"] for case in CASES} == {"fcfs", "priority"}
    assert any(case["config"]["watermark"] > 0 for case in CASES)
    assert any(ev.get("min_tokens") for case in CASES for ev in case["events"])
    assert any(not case["config"]["enable_chunked_prefill"] for case in CASES)
    kv_kinds = {kind for rec in records for kind, _ in rec.get("kv_events", [])}
    assert kv_kinds == {"stored", "removed"}  # no case resets the prefix cache


def test_the_edge_cases_cover_every_shape() -> None:
    assert {case["shape"] for case in EDGE_CASES} == {
        "shared_prefix_pressure", "no_chunk_budget_eq_len", "one_seq", "one_request_threshold",
        "abort_after_admit", "stop_first", "tied_priority", "near_max_len"}
    assert any(case["config"]["long_prefill_token_threshold_adaptive"] for case in EDGE_CASES)
    assert any(rec.get("preempted") for case in EDGE_CASES for rec in case["vllm"])


@pytest.mark.parametrize("case", CASES + EDGE_CASES,
                         ids=[f"seed{case['seed']}" for case in CASES]
                         + [f"edge{case['seed']}" for case in EDGE_CASES])
def test_each_step_equals_vllms(case: dict[str, Any]) -> None:
    ours = trim_idle(run_events(case["config"], case["events"]))
    for i, (mine, theirs) in enumerate(zip_longest(ours, case["vllm"], fillvalue={})):
        fields = differing_fields(mine, theirs)
        assert not fields, (f"record {i} ({theirs.get('event')} {theirs.get('step')}) "
                            f"differs in {fields}: rt {mine} vLLM {theirs}")
