"""`rt simulate`'s engine as a vLLM-oracle case: run a small random trace through the simulator
(every fast path on: steady decodes, fast-forwarded decode runs, trace block identities) and
describe, for vLLM's own scheduler, the same requests, each added before the step the
simulator took it in at, with the simulator's own prompt and output tokens. The oracle's
steps must then match the simulator's records (`docs/tools/oracle_diff/sim_diff.py` runs
vLLM; `tests/sim/test_oracle_sim.py` checks its frozen answers).

Compared, per step: tokens and sequences scheduled, preemptions, finishes, running and
waiting after the step, KV usage; per request: the steps of its first schedule and of its
finish, its prefix hit at first admission, its preemptions and output tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from typing import Any

from runtime import CacheConfig, SchedulerConfig
from sim.cost.roofline import RooflineCostModel
from sim.hardware import resolve_gpu
from sim.model_presets import resolve_model
from sim.simulator import SimConfig, simulate
from tests.runtime.oracle_replay import as_received
from workloads import (
    ArrivalProcess,
    MultiTurn,
    PrefixRepetition,
    RandomLengths,
    Trace,
    multi_turn_trace,
    prefix_repetition_trace,
    random_trace,
)
from workloads.tokens import request_token_arrays

COST = RooflineCostModel(resolve_model("llama-3.1-8b"), resolve_gpu("h200"))
TraceMaker = Callable[[random.Random, int, ArrivalProcess], Trace]  # (rng, max_len, arrivals)


def _random(rng: random.Random, max_len: int, arrivals: ArrivalProcess) -> Trace:
    quarter = max_len // 4
    return random_trace(rng.randint(5, 40), RandomLengths(
        quarter, quarter, range_ratio=0.9, prefix_len=rng.choice((0, 0, quarter // 2))),
        arrivals)


def _prefix(rng: random.Random, max_len: int, arrivals: ArrivalProcess) -> Trace:
    quarter = max_len // 4
    return prefix_repetition_trace(rng.randint(5, 40), PrefixRepetition(
        prefix_len=quarter, suffix_len=quarter // 2 + 1, num_prefixes=rng.randint(1, 3),
        output_len=quarter), arrivals)


def _multi_turn(rng: random.Random, max_len: int, arrivals: ArrivalProcess) -> Trace:
    turn = max_len // 16
    return multi_turn_trace(rng.randint(2, 13), MultiTurn(
        num_turns=3, turn_gap_s=0.01, lengths=RandomLengths(turn, turn, prefix_len=turn)),
        arrivals)


SYNTHETIC: tuple[TraceMaker, ...] = (_random, _prefix, _multi_turn)


def random_sim_case(seed: int, makers: Sequence[TraceMaker] = SYNTHETIC
                    ) -> tuple[Trace, SimConfig]:
    """A trace from one of `makers` and a config with a pool small enough to preempt (at
    times), chunking caps, and under the priority policy random priorities."""
    rng = random.Random(seed)
    arrivals = ArrivalProcess(request_rate=rng.choice((20.0, 100.0, 1000.0)),
                              burstiness=rng.choice((0.3, 1.0)), seed=rng.randrange(1000))
    trace = rng.choice(list(makers))(rng, rng.choice((128, 256, 512)), arrivals)
    longest = max(r.prompt_len + r.output_len for r in trace.requests)
    block_size = rng.choice((16, 16, 32))
    num_blocks = -(-longest // block_size) + 1 + rng.choice((0, 2, 8, 32, 400))
    policy = rng.choice(("fcfs", "fcfs", "priority"))
    if policy == "priority":
        trace = Trace(tuple(dataclasses.replace(r, priority=rng.randint(0, 2))
                            for r in trace.requests), trace.name)
    num_seqs = rng.choice((2, 4, 8, 32))
    max_model_len = longest + rng.choice((0, 1, 100))
    config = SimConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max(num_seqs, rng.choice((32, 64, 256, 2048))),
            max_num_seqs=num_seqs, max_model_len=max_model_len,
            long_prefill_token_threshold=min(max_model_len, rng.choice((0, 0, 16, 100))),
            policy=policy),  # type: ignore[arg-type]
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          enable_prefix_caching=rng.random() < 0.8),
        seed=seed)
    return trace, config


def oracle_config(config: SimConfig) -> dict[str, Any]:
    """The oracle's config keys for the simulator's engine."""
    sched, cache = config.scheduler, config.cache
    return {
        "block_size": cache.block_size, "num_blocks": cache.num_blocks,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_num_seqs": sched.max_num_seqs, "max_model_len": sched.max_model_len,
        "long_prefill_token_threshold": sched.long_prefill_token_threshold,
        "enable_chunked_prefill": sched.enable_chunked_prefill,
        "enable_prefix_caching": cache.enable_prefix_caching, "policy": sched.policy,
        "watermark": sched.watermark,
        "scheduler_reserve_full_isl": sched.scheduler_reserve_full_isl,
        "record_free_block_queue": False, "record_block_tables": False,
        "record_requests": False,
    }


def _taken_in_at(starts: list[float], entry: float | None) -> int:
    """The step that took in a request the recorder has entering the core at `entry` (s):
    the first of those starting at its last start at or before `entry`. A hand-over may be a
    float's last bit after the server's wake that starts that step (`sim.api_server.
    server_wake`); the recorder then keeps the hand-over."""
    assert entry is not None
    k = bisect_right(starts, entry) - 1
    assert k >= 0 and math.isclose(starts[k], entry, rel_tol=1e-12), (entry, starts[k:k + 2])
    while k > 0 and starts[k - 1] == starts[k]:
        k -= 1
    return k


def sim_case(trace: Trace, config: SimConfig) -> dict[str, Any]:
    """Simulate; return the oracle's input (`config`, `adds`: the add events before each
    step) and rt's records in the oracle's terms (`rt`)."""
    result = simulate(trace, config, COST)
    steps = result.steps
    starts = [s.start_s for s in steps]
    step_ending = {s.end_s: k for k, s in enumerate(steps)}
    records = {r.request_id: r for r in result.requests}
    adds: list[list[tuple[tuple[float, int], dict[str, Any]]]] = [[] for _ in steps]
    for order, req in enumerate(trace.requests):
        rec = records[req.request_id]
        prompt, output = request_token_arrays(req, config.vocab_size, config.seed)
        adds[_taken_in_at(starts, rec.engine_queued_s)].append(((rec.queued_s or 0.0, order), {
            "op": "add", "id": req.request_id, "prompt_token_ids": list(prompt),
            "output_token_ids": list(output), "max_tokens": req.output_len,
            "ignore_eos": True, "priority": req.priority, "arrival_time": req.arrival_s}))
    rt_steps = [{
        "tokens": s.num_prefill_tokens + s.num_decode_tokens, "seqs": s.num_seqs,
        "preempted": s.num_preempted, "finished": s.num_finished,
        "running": s.num_running, "waiting": s.num_waiting, "kv_usage": round(s.kv_usage, 6),
    } for s in steps]
    rt_requests = {r.request_id: {
        "first_step": (None if r.first_scheduled_s is None  # a step's own start
                       else bisect_left(starts, r.first_scheduled_s)),
        "cached": r.cached_tokens, "finish_step": step_ending.get(r.finish_s),
        "preemptions": r.num_preemptions, "outputs": r.output_len,
    } for r in result.requests}
    groups = [[ev for _, ev in sorted(group, key=lambda x: x[0])] for group in adds]
    # Arrival stamps as a server receiving the requests in add order gives them.
    stamped = iter(as_received([ev for group in groups for ev in group]))
    groups = [[next(stamped) for _ in group] for group in groups]
    return {"config": oracle_config(config), "adds": groups,
            "rt": {"steps": rt_steps, "requests": rt_requests}}


def inputs_digest(case: dict[str, Any]) -> str:
    """SHA-256 of what `sim_case` hands vLLM (`config`, `adds`): a frozen answer holds only
    for the inputs it was computed from."""
    text = json.dumps({"config": case["config"], "adds": case["adds"]}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()
