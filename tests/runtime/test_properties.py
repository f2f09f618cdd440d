"""Property test: random configs and request mixes (shared prefixes, tiny pools that force
preemption, priorities, aborts) run to completion with invariants checked after every step,
no leaked blocks, and each request's exact output length."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime import RequestStatus
from tests.runtime.helpers import make_request, make_scheduler, step

PREFIXES = [list(range(1000 * k + 10, 1000 * k + 60)) for k in range(3)]


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(3, 24))
    max_model_len = draw(st.integers(8, 64))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max(max_num_seqs, 1), 48))
    if not chunked:
        budget = max(budget, max_model_len)
    config = dict(
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=draw(st.booleans()),
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 7])),
        long_prefill_token_threshold_adaptive=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])),
        scheduler_reserve_full_isl=draw(st.booleans()),
    )
    requests = []
    for i in range(draw(st.integers(1, 8))):
        prefix = PREFIXES[draw(st.integers(0, 2))][: draw(st.integers(0, 20))]
        suffix = [50_000 + 100 * i + j for j in range(draw(st.integers(0, 20)))]
        requests.append(dict(
            req_id=f"r{i}",
            prompt=prefix + suffix,
            max_tokens=draw(st.integers(1, 12)),
            priority=draw(st.integers(0, 2)),
            arrive_at_step=draw(st.integers(0, 6)),
            abort_at_step=draw(st.one_of(st.none(), st.integers(0, 12))),
        ))
    return {"config": config, "requests": requests}


def expected_output_len(prompt_len: int, max_tokens: int, max_model_len: int,
                        pool_tokens: int) -> int:
    """Every request stops at max_tokens, at max_model_len, or one token past the pool."""
    return min(max_tokens, max_model_len - prompt_len, pool_tokens + 1 - prompt_len)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_complete_without_leaks(scenario: dict) -> None:
    cfg = scenario["config"]
    s = make_scheduler(**cfg)
    pool_tokens = (cfg["num_blocks"] - 1) * cfg["block_size"]
    added = {}
    aborted = set()
    step_no = 0
    pending = list(scenario["requests"])
    while pending or s.has_unfinished_requests():
        for spec in [p for p in pending if p["arrive_at_step"] <= step_no]:
            pending.remove(spec)
            request = make_request(spec["req_id"], spec["prompt"], spec["max_tokens"],
                                   priority=spec["priority"], arrival_time=float(step_no))
            s.add_request(request)
            added[spec["req_id"]] = (spec, request)
        for spec, request in added.values():
            if spec["abort_at_step"] == step_no and not request.is_finished():
                s.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
                aborted.add(request.request_id)
        s.check_invariants()
        step(s)
        step_no += 1
        assert step_no < 2_000, "no progress"

    pool = s.kv_cache_manager.block_pool
    assert pool.num_free_blocks == cfg["num_blocks"] - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert s.kv_cache_manager.req_to_blocks == {}
    for req_id, (spec, request) in added.items():
        prompt_len = len(spec["prompt"])
        if request.status == RequestStatus.FINISHED_IGNORED:
            assert (prompt_len == 0 or prompt_len >= cfg["max_model_len"]
                    or prompt_len > pool_tokens)
            continue
        if req_id in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            continue
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert request.num_output_tokens == expected_output_len(
            prompt_len, spec["max_tokens"], cfg["max_model_len"], pool_tokens)
