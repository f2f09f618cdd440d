"""A built-in scenario that shows the core's step decisions (until the full simulator lands).

The seed example of the spec: a 6-token budget, A and B decoding, and C's 10-token prompt
arriving after the first step, which chunked prefill splits 4, 4, 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig


@dataclass(frozen=True, slots=True)
class StepRow:
    step: int
    num_scheduled_tokens: dict[str, int]
    finished: list[str]
    free_blocks: int
    waiting: int
    wait_reason: str | None


def run_seed_example() -> list[StepRow]:
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=6, max_num_seqs=4, max_model_len=64),
        CacheConfig(block_size=4, num_blocks=20, enable_prefix_caching=False),
    )

    def add(req_id: str, prompt: list[int], max_tokens: int) -> None:
        s.add_request(Request(req_id, prompt, SamplingParams(max_tokens, ignore_eos=True)))

    add("A", [11, 12], 5)
    add("B", [21, 22], 5)
    rows = []
    while s.has_unfinished_requests():
        if len(rows) == 1:
            add("C", list(range(31, 41)), 3)
        output = s.schedule()
        sampled = {
            req_id: [1000 + s.requests[req_id].num_output_tokens]
            for req_id in output.num_scheduled_tokens
            if s.requests[req_id].num_computed_tokens >= s.requests[req_id].num_tokens
        }
        finished = s.update_from_output(output, sampled)
        s.check_invariants()
        rows.append(StepRow(
            step=len(rows) + 1,
            num_scheduled_tokens=dict(output.num_scheduled_tokens),
            finished=[r.request_id for r in finished],
            free_blocks=s.kv_cache_manager.block_pool.num_free_blocks,
            waiting=output.num_waiting,
            wait_reason=output.wait_reason.value if output.wait_reason else None,
        ))
    return rows
