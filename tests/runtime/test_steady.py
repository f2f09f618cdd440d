"""Steady decodes (`runtime.steady`) give exactly the records and the scheduler state of
stepping one by one with plain `Scheduler.schedule()`: random traces with shared prefixes
(hits within a step), preemption, priorities, aborts, chunking caps and budgets that bind."""

from __future__ import annotations

import random
from array import array

import pytest

from runtime import CacheConfig, EngineCore, Request, SamplingParams, Scheduler, SchedulerConfig
from runtime.block_hash import own_block_name
from runtime.kv_events import observe_kv_events
from runtime.request import RequestStatus

Arrival = tuple[float, str, list[int], int, int]  # (time, id, prompt, output_len, priority)


def _trace(rng: random.Random, num: int, block_size: int) -> list[Arrival]:
    prefixes = [[rng.randrange(10, 500) for _ in range(rng.randint(1, 5) * block_size)]
                for _ in range(3)]
    t, trace = 0.0, []
    for i in range(num):
        t += rng.choice((0.0, 0.0, rng.expovariate(40.0)))  # bursts: several in one step
        prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
        prompt = prefix + [rng.randrange(10, 500) for _ in range(rng.randint(1, 60))]
        trace.append((t, f"r{i}", prompt, rng.randint(1, 40), rng.randint(0, 3)))
    return trace


def _drive(trace: list[Arrival], scheduler_config: SchedulerConfig,
           cache_config: CacheConfig, steady: bool, abort_every: int,
           keyed: frozenset[str] = frozenset()) -> EngineCore:
    """`keyed`: requests whose blocks are named by `Request.block_key` (their own)."""
    outputs = {req_id: array("q", (1000 + (7 * j + len(req_id)) % 500 for j in range(n)))
               for _, req_id, _, n, _ in trace}

    def upcoming(request: Request, count: int) -> array[int]:
        start = request.num_output_tokens
        return outputs[request.request_id][start : start + count]

    core = EngineCore(Scheduler(scheduler_config, cache_config),
                      upcoming=upcoming if steady else None)
    scheduler, recorder = core.scheduler, core.recorder
    pending = list(trace)
    now, k = 0.0, 0
    while pending or core.has_work():
        while pending and pending[0][0] <= now:
            arrival, req_id, prompt, output_len, priority = pending.pop(0)
            recorder.arrived(req_id, arrival, len(prompt), output_len)
            key = b"own:" + req_id.encode() if req_id in keyed else None
            core.submit(Request(req_id, prompt, SamplingParams(output_len, ignore_eos=True),
                                arrival_time=arrival, priority=priority, block_key=key), now)
        k += 1
        if abort_every and k % abort_every == 0 and scheduler.running:
            core.sync()  # an abort reads and frees a running request
            victim = scheduler.running[len(scheduler.running) // 2]
            scheduler.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
            recorder.aborted(victim, now)
            scheduler.release([victim.request_id])
        step = core.begin_step(now)
        if step is None:
            now = pending[0][0] if pending else now
            continue
        requests = scheduler.requests
        sampled = {req_id: [outputs[req_id][requests[req_id].num_output_tokens]]
                   for req_id in step.output.num_scheduled_tokens
                   if requests[req_id].num_computed_tokens >= requests[req_id].num_tokens}
        duration = 1e-3 + 1e-6 * step.features.num_tokens + 1e-8 * step.features.kv_tokens_read
        core.end_step(step, sampled, now + duration, duration)
        now += duration
    core.sync()
    return core


CASES = [  # (max_num_batched_tokens, max_num_seqs, num_blocks, policy, long_prefill, abort)
    (512, 16, 400, "fcfs", 0, 0),  # ample KV
    (64, 16, 400, "fcfs", 0, 0),  # the budget binds (decodes and chunks)
    (256, 12, 40, "fcfs", 0, 0),  # preemption
    (256, 12, 45, "priority", 0, 0),  # priority preemption
    (128, 8, 60, "fcfs", 24, 0),  # per-request chunk cap: chunks beside later admissions
    (256, 12, 50, "fcfs", 0, 7),  # aborts
    (20, 16, 120, "priority", 8, 5),  # all of it
    (512, 32, 24, "fcfs", 0, 0),  # KV-bound: steady decodes preempt others and each other
    (512, 32, 30, "fcfs", 16, 9),  # the same with chunk caps and aborts
]


@pytest.mark.parametrize("seed", range(9))
@pytest.mark.parametrize("case", CASES)
def test_steady_decodes_equal_stepping_one_by_one(
        case: tuple[int, int, int, str, int, int], seed: int) -> None:
    """Seeds 6-8 (block sizes 4, 16, 1): half the requests have their blocks named
    (`Request.block_key`)."""
    budget, max_seqs, num_blocks, policy, long_prefill, abort_every = case
    block_size = (4, 16, 1)[seed % 3]
    trace = _trace(random.Random(seed), 60, block_size)
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=1024,
        policy=policy, long_prefill_token_threshold=long_prefill)  # type: ignore[arg-type]
    cache_config = CacheConfig(block_size=block_size,
                               num_blocks=num_blocks * (16 // block_size + 1) // 2)
    keyed = frozenset(req_id for _, req_id, _, _, _ in trace[::2]) if seed >= 6 else frozenset()
    slow, fast = (_drive(trace, scheduler_config, cache_config, steady, abort_every, keyed)
                  for steady in (False, True))
    assert fast.steady is not None and slow.steady is None
    assert fast.recorder.step_columns == slow.recorder.step_columns
    rows = [[r.to_row() for r in core.recorder.finished] for core in (slow, fast)]
    assert rows[0] == rows[1]
    pools = [core.scheduler.kv_cache_manager.block_pool for core in (slow, fast)]
    assert pools[0].free_block_ids() == pools[1].free_block_ids()
    assert pools[0].cached_block_ids() == pools[1].cached_block_ids()
    fast.scheduler.check_invariants()


def test_steady_decodes_take_over_and_skip_steps() -> None:
    """The fast path is really taken: nearly every request decodes as a steady decode."""
    trace = _trace(random.Random(1), 40, 16)
    config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=1024)
    core = _drive(trace, config, CacheConfig(block_size=16, num_blocks=2000), True, 0)
    assert core.steady is not None
    steps = core.recorder.step_columns
    decodes = sum(steps["num_decode_tokens"])  # type: ignore[arg-type]
    assert decodes > 0 and core.steady._seq >= 35  # joins, of 40 requests


def _two_decodes(steady: bool, num_blocks: int) -> tuple[EngineCore, dict[str, array[int]]]:
    """"b" (blocks hashed from its tokens), then "a" (blocks named by its own key): 6-token
    prompts, 12 output tokens, block size 4."""
    outputs = {"a": array("q", range(100, 120)), "b": array("q", range(200, 220))}

    def upcoming(request: Request, count: int) -> array[int]:
        start = request.num_output_tokens
        return outputs[request.request_id][start : start + count]

    core = EngineCore(Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
        CacheConfig(block_size=4, num_blocks=num_blocks)), upcoming=upcoming if steady else None)
    for req_id, first, key in (("b", 20, None), ("a", 10, b"own:a")):
        core.recorder.arrived(req_id, 0.0, 6, 12)
        core.submit(Request(req_id, list(range(first, first + 6)),
                            SamplingParams(12, ignore_eos=True), block_key=key), 0.0)
    return core, outputs


def _step(core: EngineCore, outputs: dict[str, array[int]], now: float) -> list[str]:
    """One step at `now` (0.01 s long); returns the ids it preempted."""
    step = core.begin_step(now)
    assert step is not None
    requests = core.scheduler.requests
    sampled = {req_id: [outputs[req_id][requests[req_id].num_output_tokens]]
               for req_id in step.output.num_scheduled_tokens
               if requests[req_id].num_computed_tokens >= requests[req_id].num_tokens}
    core.end_step(step, sampled, now + 0.01, 0.01)
    return list(step.output.preempted_req_ids)


def test_own_named_fills_are_registered_when_the_member_is_materialised() -> None:
    """A steady decode whose blocks its own key names ("a") registers the blocks it fills
    when it is materialised (`sync`, a finish, a preemption), in one call; one whose
    blocks are hashed ("b") registers each in its step. Then the pool is stepping's."""
    fast, outputs = _two_decodes(True, 20)
    for k in range(5):
        _step(fast, outputs, k * 0.01)
    assert fast.steady is not None and len(fast.steady) == 2
    tables = fast.scheduler.kv_cache_manager.req_to_blocks
    # block 1 of each (tokens 4-7) was filled in step 2, as a member
    assert [(b.block_id, b.block_hash is not None) for b in tables["b"]] == [
        (1, True), (2, True), (5, False)]
    assert [(b.block_id, b.block_hash is not None) for b in tables["a"]] == [
        (3, True), (4, False), (6, False)]
    fast.sync()
    assert [b.block_id for b in tables["a"] if b.block_hash is not None] == [3, 4]
    assert tables["a"][1].own_seq is not None
    slow, _ = _two_decodes(False, 20)
    for k in range(5):
        _step(slow, outputs, k * 0.01)
    pools = [core.scheduler.kv_cache_manager.block_pool for core in (fast, slow)]
    assert pools[0].cached_block_ids() == pools[1].cached_block_ids()
    assert pools[0].free_block_ids() == pools[1].free_block_ids()


def test_a_preempted_own_named_member_registers_its_fills_before_the_free() -> None:
    """With 6 blocks, "a" (the newest) is preempted in step 7 for "b"'s third block: its
    block 4, filled as a member and not yet registered, is registered before the free (so
    it goes to the free queue's tail, cached under "a"'s own name of block 1), then
    evicted by "b"'s fifth block; "a", readmitted after "b" finishes, hits block 3. Every
    step as stepping one by one's."""
    runs = []
    for steady in (True, False):
        core, outputs = _two_decodes(steady, 7)
        pool = core.scheduler.kv_cache_manager.block_pool
        tables = core.scheduler.kv_cache_manager.req_to_blocks
        rows: list[object] = []
        for k in range(13):
            preempted = _step(core, outputs, k * 0.01)
            rows.append((preempted, pool.free_block_ids(),
                         {req_id: [b.block_id for b in t] for req_id, t in tables.items()},
                         core.scheduler.prefix_cache_stats.preempted_hits))
            if k == 7:  # "a" materialised, "b" eager: every fill registered
                rows.append(pool.cached_block_ids())
        runs.append((rows, core.recorder.step_columns))
    assert runs[0] == runs[1]
    rows = runs[0][0]
    assert rows[7] == (["a"], [4, 3], {"b": [1, 2, 5, 6]}, 0)
    assert rows[8][own_block_name(b"own:a", 1)] == [4]  # type: ignore[index]
    assert rows[13] == ([], [2, 1], {"a": [3, 4, 6, 5]}, 4)  # block 3 hit: 4 tokens


def test_kv_events_observed_mid_run_after_deferred_fills() -> None:
    """KV events observed from step 5 on, after "a" (own names) deferred its fills: its
    block 1, filled in step 2, is registered without an event; from then on each fill of
    "a" (blocks 2, 3) and of "b" is logged in its step. Events, pool and records as
    stepping one by one's."""
    runs = []
    for steady in (True, False):
        core, outputs = _two_decodes(steady, 20)
        for k in range(5):
            _step(core, outputs, k * 0.01)
        pool = core.scheduler.kv_cache_manager.block_pool
        log = observe_kv_events(pool)
        for k in range(5, 12):
            _step(core, outputs, k * 0.01)
        core.sync()
        runs.append(([(e.kind, e.block_hashes) for e in log.events], pool.cached_block_ids(),
                     pool.free_block_ids(), core.recorder.step_columns))
    assert runs[0] == runs[1]
    names = {own_block_name(b"own:a", index): index for index in range(5)}
    events = [(kind, [names.get(name, "b") for name in hashes]) for kind, hashes in runs[0][0]]
    assert events == [("stored", ["b"]), ("stored", [2]), ("stored", ["b"]), ("stored", [3])]


def test_forget_steps_numbers_the_next_step_zero() -> None:
    """`rt serve`'s trim: after `forget_steps` the columns hold only the steps since, the
    first numbered 0, as in a new recorder."""
    core, outputs = _two_decodes(steady=False, num_blocks=16)
    for k in range(3):
        _step(core, outputs, k * 0.01)
    recorder = core.recorder
    assert (recorder.num_steps, list(recorder.step_columns["step"])) == (3, [0, 1, 2])
    recorder.forget_steps()
    _step(core, outputs, 0.03)
    assert (recorder.first_row, recorder.num_steps) == (0, 1)
    assert list(recorder.step_columns["step"]) == [0]
    assert list(recorder.step_columns["end_s"]) == [0.04]
    assert [step.step for step in recorder.steps] == [0]
