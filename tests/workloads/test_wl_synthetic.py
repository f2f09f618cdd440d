"""Synthetic generators: vLLM's random-dataset lengths and arrivals, prefix sharing, turns."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from workloads import (
    ArrivalProcess,
    MultiTurn,
    PrefixRepetition,
    RandomLengths,
    TraceError,
    TraceRequest,
    multi_turn_trace,
    output_token_ids,
    prefix_repetition_trace,
    prompt_token_ids,
    random_trace,
    resample_like,
    resample_trace,
    trace_stats,
    vllm_arrival_times,
)
from workloads.trace import MAX_TOKENS

from .helpers import simple_trace

VOCAB = 50000


def test_vllm_length_bounds() -> None:
    lengths = RandomLengths(input_len=1024, output_len=128, range_ratio=0.25)
    assert lengths.input_bounds() == (768, 1280)
    assert lengths.output_bounds() == (96, 160)
    assert RandomLengths(10, 1, 0.5).output_bounds() == (1, 2)  # output floor of 1
    assert RandomLengths(101, 7, 0.3, num_special_tokens=1).input_bounds() == (70, 130)
    # float rounding as in vLLM: ceil(200 * 1.1) = ceil(220.00000000000003) = 221
    assert RandomLengths(200, 20, 0.1).input_bounds() == (180, 221)
    assert RandomLengths(200, 20, 0.1).output_bounds() == (18, 22)


def test_random_lengths_and_arrivals_follow_vllm_draw_order() -> None:
    trace = random_trace(5, RandomLengths(100, 10, 0.5), ArrivalProcess(2.0, 1.0, 0))
    rng = np.random.default_rng(0)
    inputs, outputs = rng.integers(50, 151, size=5), rng.integers(5, 16, size=5)
    assert [r.prompt_len for r in trace] == inputs.tolist() == [135, 114, 101, 77, 81]
    assert [r.output_len for r in trace] == outputs.tolist() == [5, 5, 5, 6, 13]
    assert [r.arrival_s for r in trace] == vllm_arrival_times(5, 2.0, 1.0, 0).tolist()
    assert [r.request_id for r in trace] == ["0", "1", "2", "3", "4"]


def test_fixed_lengths_without_range() -> None:
    trace = random_trace(3, RandomLengths(64, 8), ArrivalProcess())
    assert {(r.prompt_len, r.output_len, r.arrival_s) for r in trace} == {(64, 8, 0.0)}


def test_random_prefix_is_shared_and_the_rest_is_unique() -> None:
    trace = random_trace(4, RandomLengths(40, 4, 0.0, prefix_len=24), ArrivalProcess(1.0))
    prompts = [prompt_token_ids(r, VOCAB, 0) for r in trace]
    assert all(len(p) == 64 for p in prompts)
    assert len({tuple(p[:24]) for p in prompts}) == 1
    assert len({tuple(p[24:]) for p in prompts}) == 4


def test_prefix_repetition_is_balanced_and_shares_only_within_a_prefix() -> None:
    spec = PrefixRepetition(prefix_len=32, suffix_len=16, num_prefixes=3, output_len=7)
    trace = prefix_repetition_trace(10, spec, ArrivalProcess(5.0, 1.0, 1))
    assert all((r.prompt_len, r.output_len) == (48, 7) for r in trace)
    keys = [r.segments[0].key for r in trace if r.segments]
    assert sorted(Counter(keys).values()) == [3, 3, 4]
    prompts = {r.request_id: prompt_token_ids(r, VOCAB, 0) for r in trace}
    by_key: dict[str, set[tuple[int, ...]]] = {}
    for r, key in zip(trace, keys, strict=True):
        by_key.setdefault(key, set()).add(tuple(prompts[r.request_id][:32]))
    assert all(len(v) == 1 for v in by_key.values())
    assert len({next(iter(v)) for v in by_key.values()}) == 3
    stats = trace_stats(trace, block_size=16)
    assert stats.prefix is not None
    # 30 blocks; the first request of each prefix misses its 2 prefix blocks
    assert (stats.prefix.block_refs, round(stats.prefix.block_reuse, 4)) == (30, 0.4667)


def test_multi_turn_later_prompt_extends_earlier_prompt_and_output() -> None:
    spec = MultiTurn(num_turns=3, turn_gap_s=5.0, lengths=RandomLengths(20, 6, 0.5, 8))
    trace = multi_turn_trace(7, spec, ArrivalProcess(1.0, 1.0, 3))
    assert len(trace) == 7
    by_id = {r.request_id: r for r in trace}
    assert sorted(by_id) == ["0-0", "0-1", "0-2", "1-0", "1-1", "1-2", "2-0"]
    for conv in ("0", "1"):
        turns = [by_id[f"{conv}-{t}"] for t in range(3)]
        assert all(t.session_id == conv for t in turns)
        assert [t.arrival_s - turns[0].arrival_s for t in turns] == [0.0, 5.0, 10.0]
        for earlier, later in zip(turns, turns[1:], strict=False):
            head = prompt_token_ids(earlier, VOCAB, 9) + output_token_ids(earlier, VOCAB, 9)
            assert prompt_token_ids(later, VOCAB, 9)[:len(head)] == head
            assert later.prompt_len > len(head)
    system = {tuple(prompt_token_ids(r, VOCAB, 9)[:8]) for r in trace}
    assert len(system) == 1  # the shared system prompt


def test_multi_turn_starts_follow_the_arrival_process() -> None:
    spec = MultiTurn(num_turns=2, turn_gap_s=100.0, lengths=RandomLengths(8, 2))
    trace = multi_turn_trace(6, spec, ArrivalProcess(2.0, 1.0, 0))
    starts = sorted(r.arrival_s for r in trace if r.request_id.endswith("-0"))
    assert starts == vllm_arrival_times(3, 2.0, 1.0, 0).tolist()


def test_resample_draws_joint_pairs_from_the_source() -> None:
    source = simple_trace([0.0, 1.0, 2.0]).replace_requests(
        [TraceRequest("a", 0.0, 10, 1), TraceRequest("b", 1.0, 20, 2),
         TraceRequest("c", 2.0, 30, 3)])
    trace = resample_trace(source, 50, ArrivalProcess(10.0, 1.0, 4))
    pick = np.random.default_rng(4).integers(0, 3, size=50)
    assert [r.prompt_len for r in trace] == [(10, 20, 30)[i] for i in pick]
    assert all(r.output_len * 10 == r.prompt_len for r in trace)


def test_resample_like_keeps_the_count_and_the_mean_rate() -> None:
    source = simple_trace([0.0, 1.0, 2.0, 4.0])  # 4 requests over 4 s: 1 req/s
    trace = resample_like(source, 9)
    assert trace == resample_trace(source, 4, ArrivalProcess(1.0, 1.0, 9))
    at_once = resample_like(simple_trace([0.0, 0.0]), 9)  # no span: every arrival at t = 0
    assert [r.arrival_s for r in at_once] == [0.0, 0.0]


@pytest.mark.parametrize(("build", "column"), [
    (lambda: RandomLengths(range_ratio=1.0), "--random-range-ratio"),
    (lambda: RandomLengths(output_len=0), "--random-output-len"),
    (lambda: random_trace(0, RandomLengths(), ArrivalProcess()), "--num-prompts"),
    (lambda: random_trace(3, RandomLengths(0, 4), ArrivalProcess()), "--random-input-len"),
    (lambda: PrefixRepetition(num_prefixes=0), "--prefix-repetition-num-prefixes"),
    (lambda: MultiTurn(num_turns=0), "--multi-turn-num-turns"),
    (lambda: MultiTurn(turn_gap_s=-1.0), "--multi-turn-gap-s"),
])
def test_bad_parameters_name_the_flag(build, column: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TraceError) as info:
        build()
    assert info.value.column == column


def test_token_limits_hold_for_the_longest_request_the_flags_make() -> None:
    """Each length flag is capped at MAX_TOKENS, and so is the longest request the flags
    make together (once refused only later, naming the trace's column, not a flag)."""
    RandomLengths(input_len=MAX_TOKENS - 100, prefix_len=100)  # exactly MAX_TOKENS: fine
    for build, column in [
        (lambda: RandomLengths(input_len=MAX_TOKENS - 100, prefix_len=101),
         "--random-input-len"),
        (lambda: RandomLengths(input_len=MAX_TOKENS // 3 * 2 + 3, range_ratio=0.5),
         "--random-input-len"),  # x 1.5 at most: past MAX_TOKENS
        (lambda: RandomLengths(output_len=MAX_TOKENS, range_ratio=0.5), "--random-output-len"),
        (lambda: PrefixRepetition(prefix_len=MAX_TOKENS, suffix_len=1),
         "--prefix-repetition-suffix-len"),
        (lambda: PrefixRepetition(num_prefixes=(1 << 20) + 1),
         "--prefix-repetition-num-prefixes"),
    ]:
        with pytest.raises(TraceError) as info:
            build()
        assert info.value.column == column
    PrefixRepetition(num_prefixes=1 << 20)  # a count (once capped as if it were tokens)
    # the last turn quotes the system prompt, 3 messages and 2 outputs: 8 + 3 x 20 + 2 x 6
    spec = MultiTurn(num_turns=3, lengths=RandomLengths(20, 6, 0.0, 8))
    assert max(r.prompt_len for r in multi_turn_trace(3, spec, ArrivalProcess())) == 80
    turns = (MAX_TOKENS - 8 + 6) // 26  # the most turns of (20 + 6) that fit
    MultiTurn(num_turns=turns, lengths=RandomLengths(20, 6, 0.0, 8))
    with pytest.raises(TraceError) as info:
        MultiTurn(num_turns=turns + 1, lengths=RandomLengths(20, 6, 0.0, 8))
    assert info.value.column == "--multi-turn-num-turns"


def test_turn_gaps_past_194_days_name_the_flag() -> None:
    """Once "column 'arrival_s'" (a trace row's name) for a flag's fault."""
    with pytest.raises(TraceError) as info:
        MultiTurn(num_turns=3, turn_gap_s=1e7)
    assert str(info.value) == ("--multi-turn-gap-s: value 10000000.0: 3 turns span 2e+07 s, "
                               "past the 16,777,216 s (194 days) a trace may span")


def test_num_prompts_past_2_to_the_24_names_the_flag() -> None:
    """1e20 was numpy's "Maximum allowed dimension exceeded", naming nothing."""
    with pytest.raises(TraceError) as info:
        random_trace(10**20, RandomLengths(8, 2), ArrivalProcess())
    assert str(info.value) == "--num-prompts: value 100000000000000000000: must be <= 16,777,216"
