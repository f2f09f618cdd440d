"""The simulator's cases for sim_diff.py: tests/sim/oracle_sim.py's synthetic traces, plus the
head of the shared Mooncake conversation trace (hash ids naming 512-token blocks: prompts
of thousands of tokens, the simulator's trace block identities)."""

from __future__ import annotations

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
