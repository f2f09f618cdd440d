"""Scheduler semantics from the spec (sections 4-7, 10) with exact per-step token counts: the
step budget, chunking, admission, preemption and priorities. Finishing, aborts, capacity and
block accounting: test_scheduler_lifecycle.py."""

from __future__ import annotations

import pytest

from runtime import WaitReason
from tests.runtime.helpers import free_ids, ids, make_request, make_scheduler, step, tables

# ---- budget, chunking, thresholds, max_num_seqs -------------------------------------------


def test_running_requests_are_served_first_in_admission_order() -> None:
    s = make_scheduler(max_num_batched_tokens=8, num_blocks=30)
    s.add_request(make_request("A", 12, 4))  # admitted first, still mid-prefill in step 2
    st = step(s)
    assert st.tokens == {"A": 8}
    s.add_request(make_request("B", 3, 4))
    st = step(s)
    assert list(st.tokens.items()) == [("A", 4), ("B", 3)]
    assert s.requests["A"].num_computed_tokens == 12
    assert s.requests["B"].num_computed_tokens == 3


@pytest.mark.parametrize(
    ("chunked", "expected"),
    [
        # Off: B's 10 tokens exceed the 6 left, and admission stops; C is not tried.
        (False, [{"A": 10}, {"A": 1, "B": 10, "C": 3}]),
        # On: B gets a 6-token chunk; the budget is spent, C waits.
        (True, [{"A": 10, "B": 6}, {"A": 1, "B": 4, "C": 3}]),
    ],
)
def test_chunked_prefill_on_and_off(chunked: bool, expected: list[dict[str, int]]) -> None:
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=16, num_blocks=30,
                       enable_chunked_prefill=chunked)
    for req_id, n in (("A", 10), ("B", 10), ("C", 3)):
        s.add_request(make_request(req_id, n, 4))
    first = step(s)
    assert first.tokens == expected[0]
    assert first.output.wait_reason is WaitReason.TOKEN_BUDGET
    assert step(s).tokens == expected[1]


def test_long_prefill_threshold_is_ignored_for_a_lone_request() -> None:
    s = make_scheduler(long_prefill_token_threshold=4)
    s.add_request(make_request("A", 10, 2))
    assert step(s).tokens == {"A": 10}


def test_long_prefill_threshold_caps_running_and_waiting_requests() -> None:
    s = make_scheduler(long_prefill_token_threshold=4)
    s.add_request(make_request("A", 10, 2))
    s.add_request(make_request("B", 10, 2))
    assert [step(s).tokens for _ in range(3)] == [
        {"A": 4, "B": 4}, {"A": 4, "B": 4}, {"A": 2, "B": 2}]


def test_adaptive_long_prefill_threshold_floor() -> None:
    s = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=2,
                       long_prefill_token_threshold_adaptive=True)
    s.add_request(make_request("A", 10, 2))
    s.add_request(make_request("B", 10, 2))
    # Cap = max(2, 16 // 2 requests) = 8.
    assert [step(s).tokens for _ in range(2)] == [{"A": 8, "B": 8}, {"A": 2, "B": 2}]


def test_max_num_seqs_stops_admission() -> None:
    s = make_scheduler(max_num_seqs=2)
    for req_id in "ABC":
        s.add_request(make_request(req_id, 3, 2))
    st = step(s)
    assert st.tokens == {"A": 3, "B": 3}
    assert st.output.wait_reason is WaitReason.MAX_NUM_SEQS
    assert st.output.num_waiting == 1
    st = step(s)
    assert st.tokens == {"A": 1, "B": 1} and st.finished == ["A", "B"]
    st = step(s)
    assert st.tokens == {"C": 3} and st.output.wait_reason is None


# ---- KV admission gates ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reserve_full", "tokens", "reason"),
    [
        (True, {"A": 1}, WaitReason.KV_CAPACITY),  # B's 12 tokens need 3 blocks, 2 are free
        (False, {"A": 1, "B": 7}, None),  # only the 7-token chunk's 2 blocks must fit
    ],
)
def test_full_sequence_admission_gate(
    reserve_full: bool, tokens: dict[str, int], reason: WaitReason | None
) -> None:
    s = make_scheduler(num_blocks=5, max_num_batched_tokens=8,
                       scheduler_reserve_full_isl=reserve_full)
    s.add_request(make_request("A", 7, 2))
    assert step(s).tokens == {"A": 7}  # A holds [1, 2]
    s.add_request(make_request("B", 12, 2))
    st = step(s)
    assert st.tokens == tokens and st.output.wait_reason is reason


@pytest.mark.parametrize(("watermark", "admitted"), [(0.0, True), (0.25, False)])
def test_watermark_applies_only_while_another_request_runs(
    watermark: float, admitted: bool
) -> None:
    s = make_scheduler(num_blocks=8, max_num_batched_tokens=16, watermark=watermark)
    s.add_request(make_request("A", 12, 2))
    assert step(s).tokens == {"A": 12}  # nothing ran: no watermark for A
    s.add_request(make_request("B", 12, 2))
    st = step(s)  # A takes a 4th block; 3 free; B needs 3 (+ 2 watermark blocks)
    assert ("B" in st.tokens) is admitted
    assert st.finished == ["A"]
    if not admitted:
        assert st.output.wait_reason is WaitReason.KV_CAPACITY
        assert step(s).tokens == {"B": 12}  # alone now: the watermark no longer applies


# ---- preemption ----------------------------------------------------------------------------


def test_fcfs_preempts_newest_first_and_requeues_in_order() -> None:
    s = make_scheduler(num_blocks=4)  # 3 usable blocks
    for req_id in "ABC":
        s.add_request(make_request(req_id, 4, 3))
    assert step(s).new == [("A", [1], 0), ("B", [2], 0), ("C", [3], 0)]
    st = step(s)
    # A needs a second block: C is preempted, then B (the tail) preempts itself.
    assert st.tokens == {"A": 1}
    assert st.output.preempted_req_ids == ["C", "B"]
    assert ids(s.waiting) == ["B", "C"]
    assert tables(s) == {"A": [1, 3]}
    assert free_ids(s) == [2]
    assert [s.requests[r].num_preemptions for r in "ABC"] == [0, 1, 1]
    assert s.requests["B"].num_computed_tokens == 0
    assert s.requests["B"].output_token_ids == [1000]  # outputs are kept
    st = step(s)
    # B (5 tokens) hits its cached block 2 but needs a second block: 2 against 1 free.
    assert st.tokens == {"A": 1} and st.output.wait_reason is WaitReason.KV_CAPACITY


def test_no_admission_in_a_step_that_preempted() -> None:
    s = make_scheduler(num_blocks=4)
    s.add_request(make_request("A", 4, 3))
    s.add_request(make_request("B", 4, 3))
    step(s)
    s.add_request(make_request("W", 3, 3))
    st = step(s)
    assert st.tokens == {"A": 1}  # A took block 3; B preempted itself and freed block 2
    assert st.output.preempted_req_ids == ["B"]
    assert free_ids(s) == [2]  # W would fit in it, but admission is skipped this step
    assert st.output.wait_reason is WaitReason.PREEMPTED_THIS_STEP
    assert ids(s.waiting) == ["B", "W"]


def test_priority_victim_scheduled_earlier_in_the_step_is_undone() -> None:
    s = make_scheduler(num_blocks=5, policy="priority")  # 4 usable blocks
    s.add_request(make_request("L", 5, 10, priority=1, arrival_time=0.0))
    assert step(s).new == [("L", [1, 2], 0)]
    s.add_request(make_request("H", 8, 10, priority=0, arrival_time=1.0))
    assert step(s).tokens == {"L": 1, "H": 8}
    st = step(s)
    # L (first in running) decodes within its blocks; then H needs a third block. The victim
    # is L, the worst priority: its token is given back and its blocks freed (partial block 2
    # to the head, cached block 1 to the tail), and H takes block 2.
    assert st.tokens == {"H": 1}
    assert st.output.total_num_scheduled_tokens == 1
    assert st.output.scheduled_cached_reqs.req_ids == ["H"]
    assert st.output.scheduled_cached_reqs.new_block_ids == [[2]]
    assert st.output.preempted_req_ids == ["L"]
    assert tables(s) == {"H": [3, 4, 2]}
    assert free_ids(s) == [1]
    assert s.requests["L"].num_computed_tokens == 0


def test_priority_request_that_preempts_itself_lets_later_ones_run() -> None:
    s = make_scheduler(num_blocks=4, policy="priority")  # 3 usable blocks
    s.add_request(make_request("L", 3, 10, priority=1, arrival_time=0.0))
    step(s)
    s.add_request(make_request("H", 7, 10, priority=0, arrival_time=1.0))
    assert step(s).tokens == {"L": 1, "H": 7}  # L [1], H [2, 3]
    st = step(s)
    # L needs a second block; the worst running request is L itself. Under priority the loop
    # continues (spec, vLLM 0.33), so H still decodes.
    assert st.tokens == {"H": 1}
    assert st.output.preempted_req_ids == ["L"]


def test_priority_waiting_queue_orders_by_priority_then_arrival() -> None:
    s = make_scheduler(policy="priority", max_num_seqs=1)
    s.add_request(make_request("run", 2, 1, priority=0, arrival_time=0.0))
    step(s)  # "run" finishes at once; next admissions are one per step
    s.add_request(make_request("late-0", 2, 1, priority=0, arrival_time=5.0))
    s.add_request(make_request("p1", 2, 1, priority=1, arrival_time=1.0))
    s.add_request(make_request("early-0", 2, 1, priority=0, arrival_time=2.0))
    assert ids(s.waiting) == ["early-0", "late-0", "p1"]
    assert [list(step(s).tokens) for _ in range(3)] == [["early-0"], ["late-0"], ["p1"]]

