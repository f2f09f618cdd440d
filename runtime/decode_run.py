"""Runs of plain decode steps, advanced together with exactly the effects of one-by-one steps.

In a *plain decode step* every running request computes its one missing token, nothing is
admitted, preempted or finished, and the waiting queue (if any) stays blocked for a reason
the step cannot change. Such steps only grow context lengths, take a new block when a
request's computed tokens reach a block boundary, and register blocks that fill up. A
simulator spends most of its steps there, so it advances them here without building a
`SchedulerOutput` per step. The state after `run_decode_steps(m)` is identical to that after
m rounds of `schedule()` + `update_from_output()` with the same tokens (tested).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from runtime.outputs import WaitReason
from runtime.request import Request
from runtime.scheduler import Scheduler


def plain_decode_wait_reason(s: Scheduler) -> tuple[bool, WaitReason | None]:
    """(whether the next step would be plain decode as far as the queues go, and the wait
    reason it would report). Admission must be impossible whatever the KV state: the
    budget is spent by the decodes, or max_num_seqs requests run."""
    cfg = s.scheduler_config
    num_running = len(s.running)
    if num_running == 0 or num_running > cfg.max_num_batched_tokens:
        return False, None
    if not s.waiting:
        return True, None
    if cfg.max_num_batched_tokens - num_running <= 0:
        return True, WaitReason.TOKEN_BUDGET
    if num_running >= cfg.max_num_seqs:
        return True, WaitReason.MAX_NUM_SEQS
    return False, None


def all_decoding(s: Scheduler) -> bool:
    """Every running request has computed all but its last sampled token."""
    return all(r.num_tokens - r.num_computed_tokens == 1 and r.num_tokens > r.num_prompt_tokens
               for r in s.running)


def decode_run_limit(s: Scheduler) -> int:
    """How many plain decode steps can run from now by the requests' lengths and the free
    blocks: no request may reach a length stop within them (its stopping step runs
    normally), and the blocks they take must be free (no preemption). EOS and stop tokens
    are checked by `steps_before_token_stop` once the tokens are known."""
    plain, _ = plain_decode_wait_reason(s)
    if not plain or not all_decoding(s):
        return 0
    limit = min(_steps_before_length_stop(request) for request in s.running)
    return _steps_with_free_blocks(s, limit)


def _steps_before_length_stop(request: Request) -> int:
    # Appending the (stop_length - num_tokens)-th token from now stops the request by length;
    # the steps before it are safe.
    return request.stop_length - request.num_tokens - 1


def steps_before_token_stop(s: Scheduler, tokens: Mapping[str, Sequence[int]],
                            limit: int) -> int:
    """The largest m <= limit such that no request samples its EOS or a stop token in the
    first m steps (the step that does runs normally), and every request has m tokens."""
    for request in s.running:
        upcoming = tokens[request.request_id]
        limit = min(limit, len(upcoming))
        stops = request.stop_token_ids
        if request.eos_token_id is None and not stops:
            continue
        for j in range(limit):
            token = upcoming[j]
            if token == request.eos_token_id or (stops and token in stops):
                limit = j
                break
    return limit


def _steps_with_free_blocks(s: Scheduler, limit: int) -> int:
    """The largest m <= limit such that m steps' new blocks fit in the free blocks.

    Every request takes one new block per `block_size` steps, so whole cycles of
    `block_size` steps are skipped while they fit; only the last cycle is walked."""
    block_size = s.block_size
    free = s.kv_cache_manager.block_pool.num_free_blocks
    # need[k]: blocks taken in step k (mod block_size): requests with -c = k (mod block_size)
    need = [0] * block_size
    for request in s.running:
        need[-request.num_computed_tokens % block_size] += 1
    per_cycle = len(s.running)
    cycles = min(free // per_cycle, max(limit, 0) // block_size)
    step, used = cycles * block_size, cycles * per_cycle
    while step < limit:
        if used + need[step % block_size] > free:
            return step
        used += need[step % block_size]
        step += 1
    return limit


def _by_offset(s: Scheduler) -> dict[int, list[int]]:
    """Running-list indices grouped by num_computed_tokens mod block_size, in list order.
    Request i takes a new block in step k iff its group is (-k) mod block_size, and its
    current block fills up in step k iff its group is (-k - 1) mod block_size."""
    groups: dict[int, list[int]] = {}
    for i, request in enumerate(s.running):
        groups.setdefault(request.num_computed_tokens % s.block_size, []).append(i)
    return groups


def run_decode_steps(s: Scheduler, num_steps: int,
                     tokens: Mapping[str, Sequence[int]]) -> list[int]:
    """Advance `num_steps` plain decode steps (allowed by `decode_run_limit` and
    `steps_before_token_stop`), each appending the next of `tokens[request_id]`. Returns the
    free blocks after each step's scheduling (its KV usage).

    Work is per event, not per request and step: tokens are appended in bulk (hashing the
    blocks they fill), then each step pops the blocks of the requests crossing a block
    boundary, in running order, and registers the blocks that filled up. Pops are the only
    order-sensitive operations on the pool; registrations keep their (step, request) order.
    """
    kv = s.kv_cache_manager
    pool = kv.block_pool
    block_size = s.block_size
    running = s.running
    groups = _by_offset(s)
    computed = [r.num_computed_tokens for r in running]
    tables = [kv.req_to_blocks[r.request_id] for r in running]
    s.finished_req_ids = []  # a plain step reports them to no one: the run has no executor
    for request in running:
        request.extend_output_tokens(tokens[request.request_id][:num_steps])
        request.num_computed_tokens += num_steps
    free_after = []
    get_new_block = pool.get_new_block
    queue = pool.free_block_queue
    caching = kv.enable_caching
    cache_full_blocks = kv.cache_full_blocks
    for step in range(num_steps):
        takers = groups.get(-step % block_size)
        if takers is not None:
            for i in takers:
                tables[i].append(get_new_block())
        free_after.append(queue.num_free_blocks)
        if caching:
            fillers = groups.get((-step - 1) % block_size)
            if fillers is not None:
                for i in fillers:
                    cache_full_blocks(running[i], tables[i], computed[i] + step + 1)
    return free_after
