"""Scheduler semantics from the spec (sections 4-7, 10), a request's life after admission:
stop checks, aborts, requests that cannot fit, config errors, block and token accounting."""

from __future__ import annotations

import pickle
from array import array

import pytest

from runtime import Request, RequestStatus, SamplingParams
from tests.runtime.helpers import (
    free_ids,
    ids,
    make_request,
    make_scheduler,
    run_until_idle,
    step,
)

# ---- update_from_output: stop checks -----------------------------------------------------


def run_one(tokens: list[int], **kwargs: object) -> tuple[RequestStatus, int | str | None, list]:
    s = make_scheduler()
    request = make_request("A", 3, **kwargs)  # type: ignore[arg-type]
    s.add_request(request)
    plan = {"A": tokens}
    while s.has_unfinished_requests():
        step(s, plan=plan)
    return request.status, request.stop_reason, request.output_token_ids


def test_eos_stops_unless_ignored() -> None:
    assert run_one([7, 2, 9], max_tokens=5, ignore_eos=False) == (
        RequestStatus.FINISHED_STOPPED, None, [7, 2])
    status, _, out = run_one([7, 2, 9], max_tokens=3, ignore_eos=True)
    assert status == RequestStatus.FINISHED_LENGTH_CAPPED and out == [7, 2, 9]


def test_stop_token_sets_stop_reason() -> None:
    assert run_one([7, 8, 9], max_tokens=5, stop_token_ids=(8,)) == (
        RequestStatus.FINISHED_STOPPED, 8, [7, 8])


def test_eos_is_checked_before_the_length_cap_and_min_tokens_does_not_mask_it() -> None:
    assert run_one([7, 2], max_tokens=2, ignore_eos=False, min_tokens=2) == (
        RequestStatus.FINISHED_STOPPED, None, [7, 2])


def test_max_model_len_caps_the_sequence() -> None:
    s = make_scheduler(max_model_len=8)
    s.add_request(make_request("A", 5, 100))
    steps = [step(s) for _ in range(3)]
    assert steps[-1].finished == ["A"]
    assert s.requests["A"].num_tokens == 8
    assert s.requests["A"].status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_tokens_after_a_stop_are_dropped_and_uncomputed() -> None:
    s = make_scheduler()
    s.add_request(make_request("A", 3, 5, ignore_eos=False))
    out = s.schedule()
    finished = s.update_from_output(out, {"A": [7, 2, 9, 9]})
    assert ids(finished) == ["A"]
    assert s.requests["A"].output_token_ids == [7, 2]
    assert s.requests["A"].num_computed_tokens == 1  # 3 scheduled, 2 trailing tokens dropped
    s.check_invariants()


# ---- aborts, reset, ignored requests, bad input ------------------------------------------


def test_abort_running_and_waiting_requests() -> None:
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("A", 6, 5))
    s.add_request(make_request("B", 6, 5))
    step(s)
    s.finish_requests(["A", "B", "unknown"], RequestStatus.FINISHED_ABORTED)
    s.check_invariants()
    assert free_ids(s) == list(range(2, 20)) + [1]  # A's partial block 2 to the head
    assert not s.has_unfinished_requests()
    assert s.requests["B"].status == RequestStatus.FINISHED_ABORTED
    s.add_request(make_request("C", 2, 1))
    assert step(s).output.finished_req_ids == ["A", "B"]
    s.finish_requests("C", RequestStatus.FINISHED_ABORTED)  # already finished: ignored
    assert s.requests["C"].status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_tokens_for_a_request_aborted_during_its_step_are_ignored() -> None:
    s = make_scheduler()
    s.add_request(make_request("A", 3, 5))
    out = s.schedule()
    s.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    assert s.update_from_output(out, {"A": [7]}) == []
    assert s.requests["A"].output_token_ids == []
    s.check_invariants()


def test_reset_prefix_cache() -> None:
    s = make_scheduler()
    s.add_request(make_request("A", 9, 3))
    step(s)
    assert s.reset_prefix_cache() is False  # A holds blocks
    assert s.reset_prefix_cache(reset_running_requests=True) is True
    assert ids(s.waiting) == ["A"] and s.requests["A"].status == RequestStatus.PREEMPTED
    st = step(s)
    assert st.output.preempted_req_ids == ["A"]
    # No hit although blocks 1 and 2 still hold A's prefix: the cache was dropped. The free
    # queue kept its order: A's partial block 3 at the head, its cached blocks at the tail.
    assert st.new == [("A", [3, 4, 5], 0)]


def test_request_that_can_never_fit_is_ignored_without_blocking_the_queue() -> None:
    s = make_scheduler(num_blocks=5, max_model_len=32)  # 4 blocks = 16 tokens
    s.add_request(make_request("huge", 17, 1))
    s.add_request(make_request("long", 32, 1))
    s.add_request(make_request("empty", [], 1))
    s.add_request(make_request("ok", 4, 1))
    for req_id in ("huge", "long", "empty"):
        request = s.requests[req_id]
        assert request.status == RequestStatus.FINISHED_IGNORED
        assert isinstance(request.stop_reason, str)
    assert "pool has 4" in str(s.requests["huge"].stop_reason)
    assert "max_model_len=32" in str(s.requests["long"].stop_reason)
    st = step(s)
    assert st.tokens == {"ok": 4}
    assert st.output.finished_req_ids == ["huge", "long", "empty"]


def test_lone_request_outgrowing_the_pool_is_length_capped_not_livelocked() -> None:
    s = make_scheduler(num_blocks=3, max_model_len=64)  # 2 blocks = 8 tokens of KV
    s.add_request(make_request("A", 6, 50))
    steps = [step(s) for _ in range(3)]
    assert steps[-1].finished == ["A"]
    assert s.requests["A"].num_tokens == 9  # the 9th token's KV would need a 3rd block
    assert s.requests["A"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.requests["A"].stop_reason == "kv_pool_capacity"


def test_duplicate_request_id_is_refused() -> None:
    s = make_scheduler()
    s.add_request(make_request("A", 3, 1))
    with pytest.raises(ValueError, match="'A' was already added"):
        s.add_request(make_request("A", 3, 1))


def test_release_forgets_finished_requests_only() -> None:
    s = make_scheduler()
    s.add_request(make_request("A", 3, 1))
    s.add_request(make_request("B", 3, 5))
    step(s)
    s.release(["A", "B"])
    assert set(s.requests) == {"B"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "max_num_batched_tokens (4)"),
        ({"enable_chunked_prefill": False, "max_model_len": 128}, "with chunked prefill off"),
        ({"long_prefill_token_threshold": 100}, "long_prefill_token_threshold must be in"),
        ({"policy": "lifo"}, "policy must be 'fcfs' or 'priority', got 'lifo'"),
        ({"watermark": 1.5}, "watermark must be in [0, 1), got 1.5"),
        ({"num_blocks": 1}, "num_blocks must be >= 2"),
        ({"block_size": 0}, "block_size must be >= 1, got 0"),
    ],
)
def test_config_errors_name_the_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        make_scheduler(**kwargs)
    assert message in str(info.value)


def test_id_fields_are_ordered_lists_that_also_compare_as_sets() -> None:
    s = make_scheduler(num_blocks=4)
    for req_id in "ABC":
        s.add_request(make_request(req_id, 4, 3))
    step(s)
    out = step(s).output
    assert out.preempted_req_ids == ["C", "B"]
    assert out.preempted_req_ids == {"B", "C"}
    assert out.preempted_req_ids != ["B", "C"] and out.preempted_req_ids != {"B"}
    assert s.waiting[0].request_id == "B"


def test_decode_takes_a_new_block_exactly_when_computed_tokens_hit_a_multiple() -> None:
    s = make_scheduler()
    s.add_request(make_request("A", 4, 8))
    assert step(s).new == [("A", [1], 0)]
    new_blocks, computed_before = [], []
    for _ in range(5):
        cached = step(s).output.scheduled_cached_reqs
        new_blocks += cached.new_block_ids
        computed_before += cached.num_computed_tokens
    assert computed_before == [4, 5, 6, 7, 8]
    assert new_blocks == [[2], [], [], [], [3]]


def test_block_ids_are_the_table_when_scheduled_though_made_when_read() -> None:
    s = make_scheduler(num_blocks=8)
    s.add_request(make_request("A", 6, 8))  # block size 4: blocks [1, 2] at admission
    admitted = step(s).output.scheduled_new_reqs[0]
    grown = [step(s).output.scheduled_cached_reqs for _ in range(3)]  # token 9: block 3
    assert s.get_block_ids("A") == [1, 2, 3]
    run_until_idle(s)  # A finishes, its table is freed
    s.add_request(make_request("B", 24, 1))  # takes blocks 4-7, then A's freed 3 and 2
    assert step(s).new == [("B", [4, 5, 6, 7, 3, 2], 0)]
    block_ids = admitted.block_ids
    assert block_ids == [1, 2] and [1, 2] == block_ids and block_ids == (1, 2)
    assert block_ids != [1, 2, 3] and list(block_ids) == [1, 2] and len(block_ids) == 2
    assert (block_ids[-1], block_ids[:1], repr(block_ids)) == (2, [1], "[1, 2]")
    assert (block_ids[0], block_ids[-2], list(reversed(block_ids))) == (1, 1, [2, 1])
    with pytest.raises(IndexError):
        block_ids[2]  # the table holds 3 blocks now: the view ends where it was scheduled
    # pickles as its ids (a freed table's blocks link the free queue: not pickled)
    assert pickle.loads(pickle.dumps(block_ids)) == [1, 2]
    assert type(pickle.loads(pickle.dumps(block_ids))) is list
    assert [c.new_block_ids for c in grown] == [[[]], [[]], [[3]]]


def test_num_computed_tokens_lifecycle() -> None:
    s = make_scheduler(max_num_batched_tokens=8, num_blocks=8)
    s.add_request(make_request("A", list(range(100, 112)), 6))
    request = s.requests["A"]
    assert request.num_computed_tokens == 0
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert request.num_computed_tokens == 8  # advanced at schedule time, before execution
    s.update_from_output(out, {})  # a non-final chunk samples nothing
    step(s)
    assert (request.num_computed_tokens, request.num_tokens) == (12, 13)  # steady decode: +1
    s.add_request(make_request("B", list(range(100, 112)), 2))  # same prompt: hits 2 blocks
    st = step(s)
    assert st.new == [("B", [1, 2, 5], 8)]  # admitted at its hit, then advanced by 4
    assert s.requests["B"].num_computed_tokens == 12


def test_resumed_requests_are_listed_after_new_ones() -> None:
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=16)
    s.add_request(make_request("A", 4, 2))
    s.add_request(make_request("B", 4, 3))
    step(s)
    assert step(s).output.preempted_req_ids == ["B"]  # A took the last block
    s.add_request(make_request("N", 2, 2))
    st = step(s)  # A finishes; B (resumed, at the queue's head) and N are admitted
    assert list(st.tokens) == ["B", "N"]
    assert [n.req_id for n in st.output.scheduled_new_reqs] == ["N", "B"]
    assert st.output.scheduled_resumed_req_ids == ["B"]
    new_n, resumed_b = st.output.scheduled_new_reqs
    b_prompt = list(s.requests["B"].prompt_token_ids)
    assert new_n.prefill_token_ids is None and len(b_prompt) == 4
    assert list(resumed_b.prefill_token_ids or ()) == b_prompt + [1000]  # prompt + output


def test_token_ids_join_prompt_and_outputs_leaving_the_prompt_as_given() -> None:
    prompt = array("q", [5, 6, 7])
    request = Request("A", prompt, SamplingParams(max_tokens=4))
    assert request.last_token_id == 7 and request.all_token_ids.tolist() == [5, 6, 7]
    request.append_output_token(8)
    request.extend_output_tokens([9, 10])
    assert request.prompt_token_ids is prompt and prompt.tolist() == [5, 6, 7]
    assert request.all_token_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert [request.token_ids(a, b).tolist() for a, b in ((0, 2), (1, 5), (3, 6), (2, 3))] \
        == [[5, 6], [6, 7, 8, 9], [8, 9, 10], [7]]
    assert (request.last_token_id, request.output_token_ids) == (10, [8, 9, 10])
    from_tuple = Request("B", (1, 2), SamplingParams(max_tokens=1))
    from_tuple.append_output_token(3)
    assert from_tuple.token_ids(1, 3) == array("q", [2, 3])


def test_tied_priority_requests_do_not_preempt_each_other_forever() -> None:
    # Found by the property test: equal priority and arrival time, a pool too small for both
    # at full length, first chunks admitted without the full-sequence gate. With vLLM's
    # victim key the two preempt each other forever (confirmed with vLLM's own scheduler);
    # rt's tie-break by add order lets r0 finish.
    s = make_scheduler(block_size=2, num_blocks=8, enable_prefix_caching=False,
                       max_num_batched_tokens=11, max_num_seqs=2, max_model_len=11,
                       enable_chunked_prefill=False, long_prefill_token_threshold=3,
                       policy="priority", scheduler_reserve_full_isl=False)
    for req_id, max_tokens in (("r0", 10), ("r1", 1), ("r2", 10)):
        s.add_request(make_request(req_id, 1, max_tokens, arrival_time=0.0))
    steps = 0
    while s.has_unfinished_requests():
        step(s)
        steps += 1
        assert steps < 200, "livelock"
    assert [s.requests[r].num_output_tokens for r in ("r0", "r1", "r2")] == [10, 1, 10]


def test_arrival_ties_are_broken_by_add_order_in_the_queue() -> None:
    # A server stamps requests as it receives them: r9, added first, arrived first. Request
    # ids would order them the other way ("r10" < "r9").
    s = make_scheduler(max_num_seqs=1, policy="priority")
    for req_id in ("r9", "r10"):
        s.add_request(make_request(req_id, 3, 2, arrival_time=5.0))
    assert [r.request_id for r in s.waiting] == ["r9", "r10"]
    assert list(step(s).tokens) == ["r9"]


def test_arrival_ties_are_broken_by_add_order_for_the_victim() -> None:
    # 4 usable blocks of 2 tokens: both 3-token prompts fit (2 blocks each); the fifth token
    # needs a third block. The victim is the worst by (priority, arrival, add order): r10.
    s = make_scheduler(block_size=2, num_blocks=5, max_num_batched_tokens=16, max_num_seqs=2,
                       max_model_len=16, policy="priority")
    for req_id in ("r9", "r10"):
        s.add_request(make_request(req_id, 3, 8, arrival_time=5.0))
    steps = [step(s) for _ in range(3)]
    assert [st.output.preempted_req_ids for st in steps] == [[], [], ["r10"]]
    assert steps[2].tokens == {"r9": 1}
