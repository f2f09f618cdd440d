"""The simulator's cases for sim_diff.py: tests/sim/oracle_sim.py's synthetic traces, plus the
head of the shared Mooncake conversation trace (hash ids naming 512-token blocks: prompts
of thousands of tokens, the simulator's trace block identities)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

from tests.sim.oracle_sim import SYNTHETIC, random_sim_case, sim_case
from workloads import ArrivalProcess, Trace
from workloads.loaders import load_trace
from workloads.transforms import first_n, scale_time

TRACES = Path("/work/shared/traces")


def _mooncake(rng: random.Random, max_len: int, arrivals: ArrivalProcess) -> Trace:
    trace = load_trace(TRACES / "mooncake_conversation_head.jsonl").trace
    return scale_time(first_n(trace, rng.randint(5, 25)), rng.choice((0.0001, 0.001)))


def case_for(seed: int) -> dict[str, Any]:
    trace, config = random_sim_case(seed, (*SYNTHETIC, _mooncake))
    return {"seed": seed, "kind": trace.name, "num_requests": len(trace.requests),
            **sim_case(trace, config)}


def edge_case_for(seed: int) -> dict[str, Any]:
    """A `case_for` trace under an edge-shaped config: chunked prefill off with a budget of
    exactly `max_model_len`, one sequence at a time, all arrivals tied, a watermark, the
    first-chunk admission gate, pools just big enough for the longest request."""
    trace, config = random_sim_case(seed, (*SYNTHETIC, _mooncake))
    rng = random.Random(seed + 10**6)
    if rng.random() < 0.5:  # every request at 0 s: ties broken by add order
        trace = Trace(tuple(dataclasses.replace(r, arrival_s=0.0) for r in trace.requests),
                      trace.name)
    sched, cache = config.scheduler, config.cache
    longest = max(r.prompt_len + r.output_len for r in trace.requests)
    chunked = rng.random() < 0.4
    seqs = rng.choice((1, 1, 2, sched.max_num_seqs))
    sched = dataclasses.replace(
        sched, enable_chunked_prefill=chunked, max_num_seqs=seqs,
        max_num_batched_tokens=max(seqs, sched.max_num_batched_tokens if chunked
                                   else sched.max_model_len),
        watermark=rng.choice((0.0, 0.0, 0.05, 0.3)),
        scheduler_reserve_full_isl=rng.random() < 0.6)
    cache = dataclasses.replace(cache, num_blocks=-(-longest // cache.block_size) + 1
                                + rng.choice((0, 0, 1, 4)))
    config = dataclasses.replace(config, scheduler=sched, cache=cache)
    return {"seed": seed, "kind": trace.name + "/edge", "num_requests": len(trace.requests),
            **sim_case(trace, config)}
