"""Test helpers: build a scheduler, and run steps with a stub executor that samples tokens.

The stub gives one token to every scheduled request whose computed tokens reach its length
after `schedule()` (a final prefill chunk or a decode): a per-step override if given, else the
next token of the request's plan, else `1000 + k % 1000` with k its output count so far.
Every step ends with `check_invariants()`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from runtime import (
    CacheConfig,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)


def make_scheduler(
    *,
    block_size: int = 4,
    num_blocks: int = 20,
    enable_prefix_caching: bool = True,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
    **scheduler_kwargs: object,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            **scheduler_kwargs,  # type: ignore[arg-type]
        ),
        CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
        ),
    )


def make_request(
    req_id: str,
    prompt: list[int] | int,
    max_tokens: int = 16,
    *,
    ignore_eos: bool = True,
    eos_token_id: int | None = 2,
    stop_token_ids: tuple[int, ...] = (),
    min_tokens: int = 0,
    **request_kwargs: object,
) -> Request:
    """`prompt` is a token list, or a length (tokens 100, 101, ... unique per request id)."""
    if isinstance(prompt, int):
        base = 10_000 * (1 + sum(map(ord, req_id)))
        prompt = list(range(base, base + prompt))
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        eos_token_id=eos_token_id,
        stop_token_ids=stop_token_ids,
    )
    return Request(req_id, prompt, params, **request_kwargs)  # type: ignore[arg-type]


@dataclass
class Step:
    output: SchedulerOutput
    sampled: dict[str, int]
    finished: list[str]
    free: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> dict[str, int]:
        return dict(self.output.num_scheduled_tokens)

    @property
    def new(self) -> list[tuple[str, list[int], int]]:
        return [(n.req_id, n.block_ids, n.num_computed_tokens)
                for n in self.output.scheduled_new_reqs]


def step(
    s: Scheduler,
    tokens: dict[str, int] | None = None,
    plan: dict[str, list[int]] | None = None,
) -> Step:
    output = s.schedule()
    sampled: dict[str, int] = {}
    for req_id in output.num_scheduled_tokens:
        request = s.requests[req_id]
        if request.num_computed_tokens < request.num_tokens:
            continue  # a non-final prefill chunk samples nothing
        k = request.num_output_tokens
        planned = (plan or {}).get(req_id, [])
        if tokens and req_id in tokens:
            sampled[req_id] = tokens[req_id]
        elif k < len(planned):
            sampled[req_id] = planned[k]
        else:
            sampled[req_id] = 1000 + k % 1000
    finished = s.update_from_output(output, {r: [t] for r, t in sampled.items()})
    s.check_invariants()
    free = s.kv_cache_manager.block_pool.free_block_ids()
    return Step(output, sampled, [r.request_id for r in finished], free)


def steps_of(s: Scheduler, pending: list[tuple[int, Request]], limit: int = 400
             ) -> Iterator[Step]:
    """Step `s` up to `limit` times, adding each (k, request) of `pending` before step k;
    stops once idle after step 20 (requests may still come later)."""
    for k in range(limit):
        for at, request in pending:
            if at == k:
                s.add_request(request)
        if not s.has_unfinished_requests() and k > 20:
            return
        yield step(s)


def run_until_idle(s: Scheduler, max_steps: int = 10_000) -> list[Step]:
    steps = []
    while s.has_unfinished_requests():
        assert len(steps) < max_steps, "the scheduler made no progress"
        steps.append(step(s))
    return steps


def free_ids(s: Scheduler) -> list[int]:
    return s.kv_cache_manager.block_pool.free_block_ids()


def tables(s: Scheduler) -> dict[str, list[int]]:
    return {r.request_id: s.get_block_ids(r.request_id) for r in s.running}


def ids(requests: object) -> list[str]:
    return [r.request_id for r in requests]  # type: ignore[attr-defined]
