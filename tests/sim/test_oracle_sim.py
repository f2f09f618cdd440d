"""`rt simulate`'s engine against vLLM's own V1 scheduler: small random traces simulated with
every fast path on (steady decodes, decode runs, trace block identities), and vLLM's
scheduler given the same requests before the same steps (tests/sim/oracle_sim.py). Each
step's tokens, sequences, preemptions, finishes, queue lengths and KV usage, and each
request's first and last step, prefix hit, preemptions and outputs, equal vLLM's frozen
answers (docs/tools/oracle_diff/freeze.py; tests/fixtures/oracle/ATTRIBUTION.md)."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from tests.sim.oracle_sim import (
    SYNTHETIC,
    inputs_digest,
    oracle_config,
    random_sim_case,
    sim_case,
)

FIXTURE = Path(__file__).parent.parent / "fixtures" / "oracle" / "sim_cases.json.gz"
CASES: list[dict[str, Any]] = json.loads(gzip.decompress(FIXTURE.read_bytes()))


def test_some_cases_preempt_and_hit() -> None:
    steps = [s for case in CASES for s in case["vllm"]["steps"]]
    requests = [r for case in CASES for r in case["vllm"]["requests"].values()]
    assert len(CASES) >= 10
    assert sum(s["preempted"] for s in steps) > 0
    assert sum(r["cached"] for r in requests) > 0


@pytest.mark.parametrize("case", CASES, ids=[f"seed{case['seed']}" for case in CASES])
def test_the_simulator_steps_as_vllm(case: dict[str, Any]) -> None:
    mine = sim_case(*random_sim_case(case["seed"]))
    assert inputs_digest(mine) == case["inputs_sha256"], (
        "the simulator hands vLLM other requests or steps than those frozen: re-freeze "
        "(docs/tools/oracle_diff/freeze.py) before comparing")
    ours, theirs = mine["rt"], case["vllm"]
    assert len(ours["steps"]) == len(theirs["steps"])
    for k, (mine, vllm) in enumerate(zip(ours["steps"], theirs["steps"], strict=True)):
        assert mine == vllm, f"step {k}"
    assert ours["requests"] == theirs["requests"]


def test_the_oracle_gets_every_admission_setting() -> None:
    # A config vLLM's scheduler would read with its own defaults if left out: the watermark
    # and the first-chunk admission gate change admissions.
    trace, config = random_sim_case(0)
    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, watermark=0.3, scheduler_reserve_full_isl=False))
    cfg = oracle_config(config)
    assert (cfg["watermark"], cfg["scheduler_reserve_full_isl"]) == (0.3, False)


def test_a_request_handed_over_a_bit_after_the_wake_maps_to_the_step_it_entered() -> None:
    # Seed 14 with a fourth trace maker (sim_side.py's Mooncake): a multi-turn trace whose
    # request "3-0" is handed over at 0.18023532216880564 s, one float bit after the
    # server's wake that starts the step taking it in (`sim.api_server.server_wake`).
    case = sim_case(*random_sim_case(14, (*SYNTHETIC, SYNTHETIC[0])))
    [k] = [k for k, group in enumerate(case["adds"]) for ev in group if ev["id"] == "3-0"]
    assert case["rt"]["requests"]["3-0"]["first_step"] == k  # admitted as it entered
