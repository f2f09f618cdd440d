"""Four hand-worked cases whose every checked value was confirmed against vLLM's own V1
scheduler (see tests/fixtures/oracle/ATTRIBUTION.md). Case 1 is the seed example: budget 6,
A and B decoding, C's 10-token prompt scheduled 4, 4, 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runtime import RequestStatus
from tests.runtime.helpers import Step, make_request, make_scheduler, step

CASES = Path(__file__).parent.parent / "fixtures" / "oracle"


def R(a: int, b: int) -> list[int]:
    return list(range(a, b))


def run_case(name: str) -> tuple[dict[int, Step], dict[str, Any]]:
    """Replay a case's events; returns each step's result and the snapshot after the abort."""
    case = json.loads((CASES / name).read_text())
    cfg = case["config"]
    s = make_scheduler(
        block_size=cfg["block_size"],
        num_blocks=cfg["num_blocks"],
        enable_prefix_caching=cfg["enable_prefix_caching"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_num_seqs=cfg["max_num_seqs"],
        max_model_len=cfg["max_model_len"],
        enable_chunked_prefill=cfg["enable_chunked_prefill"] if "enable_chunked_prefill" in cfg
        else True,
        long_prefill_token_threshold=cfg.get("long_prefill_token_threshold", 0),
        policy=cfg["policy"],
    )
    steps: dict[int, Step] = {}
    after_abort: dict[str, Any] = {}
    for event in case["events"]:
        if event["op"] == "add":
            s.add_request(make_request(
                event["id"], event["prompt_token_ids"], event["max_tokens"],
                ignore_eos=event["ignore_eos"], priority=event.get("priority", 0),
                arrival_time=event.get("arrival_time", 0.0)))
        elif event["op"] == "step":
            for _ in range(event.get("count", 1)):
                if s.has_unfinished_requests():  # an idle engine does not schedule
                    steps[len(steps) + 1] = step(s)
        else:
            s.finish_requests(event["ids"], RequestStatus.FINISHED_ABORTED)
            s.check_invariants()
            after_abort = {
                "free": s.kv_cache_manager.block_pool.free_block_ids(),
                "tables": {r.request_id: s.get_block_ids(r.request_id) for r in s.running},
            }
    return steps, after_abort


def test_case1_chunked_prefill_seed_example() -> None:
    steps, _ = run_case("case1_chunking.json")
    assert [list(st.tokens.items()) for st in steps.values()] == [
        [("A", 2), ("B", 2)],
        [("A", 1), ("B", 1), ("C", 4)],
        [("A", 1), ("B", 1), ("C", 4)],
        [("A", 1), ("B", 1), ("C", 2)],
        [("A", 1), ("B", 1), ("C", 1)],
        [("C", 1)],
    ]
    assert steps[1].new == [("A", [1], 0), ("B", [2], 0)]
    assert steps[1].free == R(3, 20)
    assert steps[2].new == [("C", [3], 0)]
    assert steps[2].sampled == {"A": 1001, "B": 1001}
    assert steps[2].free == R(4, 20)
    assert steps[3].sampled == {"A": 1002, "B": 1002}
    assert steps[4].sampled == {"A": 1003, "B": 1003, "C": 1000}
    assert steps[4].free == R(8, 20)
    assert steps[5].finished == ["A", "B"]
    # Unhashed blocks (caching is off) are prepended, each table reversed: A=[1,5], B=[2,6].
    assert steps[5].free == [6, 2, 5, 1] + R(8, 20)
    assert steps[6].finished == ["C"]
    assert steps[6].output.finished_req_ids == ["A", "B"]
    assert steps[6].free == [7, 4, 3, 6, 2, 5, 1] + R(8, 20)


def test_case2_prefix_hits_and_abort() -> None:
    steps, after_abort = run_case("case2_prefix_hit.json")
    assert steps[1].tokens == {"R1": 58}
    assert steps[1].new == [("R1", [1, 2, 3, 4], 0)]
    assert steps[1].free == R(5, 20)
    # R2 shares R1's three full blocks (48 tokens) and computes its 10-token tail.
    assert list(steps[2].tokens.items()) == [("R1", 1), ("R2", 10)]
    assert steps[2].new == [("R2", [1, 2, 3, 5], 48)]
    assert steps[2].free == R(6, 20)
    # R3 is block-aligned (48 tokens): the hit stops at 47 tokens, i.e. 2 whole blocks.
    assert list(steps[3].tokens.items()) == [("R1", 1), ("R2", 1), ("R3", 16)]
    assert steps[3].new == [("R3", [1, 2, 6], 32)]
    assert steps[3].free == R(7, 20)
    # Aborting R1 frees only its unshared partial block 4, to the head.
    assert after_abort["free"] == [4] + R(7, 20)
    assert after_abort["tables"] == {"R2": [1, 2, 3, 5], "R3": [1, 2, 6]}
    assert steps[4].tokens == {"R2": 1, "R3": 1}
    assert steps[4].output.finished_req_ids == ["R1"]
    assert steps[4].free == R(7, 20)


def test_case2_prefix_cache_stats_are_recorded_at_admission() -> None:
    case = json.loads((CASES / "case2_prefix_hit.json").read_text())
    s = make_scheduler(block_size=16, num_blocks=20, max_num_batched_tokens=8192,
                       max_num_seqs=16, max_model_len=256)
    seen = []
    for event in case["events"]:
        if event["op"] == "add":
            s.add_request(make_request(event["id"], event["prompt_token_ids"], 50))
        elif event["op"] == "step":
            step(s)
            stats = s.prefix_cache_stats
            seen.append((stats.requests, stats.queries, stats.hits))
    assert seen[:3] == [(1, 58, 0), (2, 116, 48), (3, 164, 80)]


def test_case3_fcfs_preemption_and_resume() -> None:
    steps, _ = run_case("case3_preemption.json")
    assert steps[1].tokens == {"A": 7, "B": 8}
    assert steps[1].new == [("A", [1, 2], 0), ("B", [3, 4], 0)]
    assert steps[1].free == [5]
    assert steps[2].tokens == {"A": 1, "B": 1}
    assert steps[2].free == []
    # A needs a third block: B, the newest running request, is preempted; its blocks
    # (no hashes: caching off) go to the head, reversed.
    assert steps[3].tokens == {"A": 1}
    assert steps[3].output.preempted_req_ids == ["B"]
    assert steps[3].free == [4, 3]
    assert [r.request_id for r in steps[3].output.scheduled_new_reqs] == []
    for n in (4, 5, 6):
        assert steps[n].tokens == {"A": 1} and steps[n].free == [4, 3]
    assert steps[7].finished == ["A"]
    assert steps[7].free == [4, 5, 2, 1, 3]
    # B resumes and recomputes prompt + its 2 outputs as one 10-token prefill.
    assert steps[8].tokens == {"B": 10}
    assert steps[8].output.scheduled_resumed_req_ids == ["B"]
    assert steps[8].new == [("B", [4, 5, 2], 0)]
    assert steps[8].sampled == {"B": 1002}
    assert steps[8].free == [1, 3]


def test_case4_priority_preemption() -> None:
    steps, _ = run_case("case4_priority_preemption.json")
    assert list(steps[2].tokens.items()) == [("L", 1), ("H", 8)]
    assert steps[2].new == [("H", [4, 5], 0)]
    assert steps[2].free == []
    # L (priority 1) is running first; H (priority 0) needs a block: L is the victim.
    assert steps[3].tokens == {"H": 1}
    assert steps[3].output.preempted_req_ids == ["L"]
    assert steps[3].free == [2, 1]
    assert steps[4].finished == ["H"]
    assert steps[4].free == [3, 5, 4, 2, 1]
    assert steps[5].tokens == {"L": 10}
    assert steps[5].output.scheduled_resumed_req_ids == ["L"]
    assert steps[5].new == [("L", [3, 5, 4], 0)]
    assert steps[5].free == [2, 1]


@pytest.mark.parametrize("name", sorted(p.name for p in CASES.glob("case*.json")))
def test_cases_keep_invariants_and_finish(name: str) -> None:
    steps, _ = run_case(name)
    assert steps  # every step already ran check_invariants()
