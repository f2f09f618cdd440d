"""A request admitted with KV computed elsewhere (vLLM's KV-connector path, as a P/D decode
replica sees it): `num_external_computed_tokens` leading tokens get blocks past the local
prefix hit and count as computed, without token budget; the rest is scheduled as usual."""

from __future__ import annotations

from tests.runtime.helpers import free_ids, make_request, make_scheduler, step


def test_external_tokens_are_computed_on_admission() -> None:
    s = make_scheduler(block_size=4, num_blocks=20, max_num_batched_tokens=8)
    request = make_request("d", 10, max_tokens=3)
    request.num_external_computed_tokens = 9  # the whole prompt but its last token
    s.add_request(request)
    first = step(s)
    # 10 tokens need 3 blocks; only the last prompt token is scheduled (no budget for the 9)
    assert first.new == [("d", [1, 2, 3], 9)]
    assert first.tokens == {"d": 1}
    assert first.output.total_num_scheduled_tokens == 1
    assert first.sampled == {"d": 1000}  # the first output token, from this one step
    assert request.num_external_computed_tokens == 0  # consumed
    assert request.num_cached_tokens == 0  # prefix-cache hits only
    assert s.prefix_cache_stats.hits == 0
    assert step(s).tokens == {"d": 1}  # then it decodes


def test_external_tokens_start_after_the_local_hit() -> None:
    s = make_scheduler(block_size=4, num_blocks=20, max_num_batched_tokens=16)
    prompt = list(range(100, 112))  # 12 tokens, 3 full blocks
    s.add_request(make_request("a", prompt, max_tokens=1))
    step(s)
    assert not s.has_unfinished_requests()
    request = make_request("d", prompt + [7, 8], max_tokens=2)
    request.num_external_computed_tokens = 13
    s.add_request(request)
    first = step(s)
    # local hit: the 3 cached blocks (12 tokens); external: token 12; scheduled: token 13
    req_id, blocks, computed = first.new[0]
    assert (req_id, computed) == ("d", 13)
    assert blocks[:3] == [1, 2, 3] and len(blocks) == 4
    assert first.tokens == {"d": 1}
    assert request.num_cached_tokens == 12


def test_external_tokens_never_cover_the_last_token() -> None:
    s = make_scheduler(block_size=4, num_blocks=20)
    request = make_request("d", 8, max_tokens=2)
    request.num_external_computed_tokens = 8  # capped at num_tokens - 1
    s.add_request(request)
    assert step(s).tokens == {"d": 1}


def test_without_room_the_request_waits_holding_nothing() -> None:
    s = make_scheduler(block_size=4, num_blocks=4, max_num_batched_tokens=8,
                       max_model_len=64)  # 3 usable blocks: 12 tokens
    s.add_request(make_request("a", 8, max_tokens=8))
    step(s)
    request = make_request("d", 8, max_tokens=2)
    request.num_external_computed_tokens = 7
    s.add_request(request)
    out = step(s)
    assert "d" not in out.tokens and request.num_external_computed_tokens == 7
    assert s.get_block_ids("d") == [] and len(free_ids(s)) == 0
