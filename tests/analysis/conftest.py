"""A hand-made run directory whose metrics are worked out by hand in the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from analysis.rundir import run_info, write_run

PARTS = ("api_server_s", "step_boundary_s", "queue_token_budget_s", "queue_max_num_seqs_s",
         "queue_kv_capacity_s", "queue_preempted_step_s", "preempted_s", "prefill_s",
         "decode_s")


def request(rid: str, arrival: float, tokens: list[float], *, status: str =
            "FINISHED_LENGTH_CAPPED", queued: float | None = None,
            scheduled: float | None = None, parts: dict[str, float] | None = None,
            prompt_len: int = 10, preemptions: int = 0, cached: int = 0) -> dict[str, Any]:
    row: dict[str, Any] = {
        "request_id": rid, "arrival_s": arrival, "prompt_len": prompt_len,
        "max_tokens": len(tokens), "queued_s": queued, "engine_queued_s": queued,
        "first_scheduled_s": scheduled, "first_token_s": tokens[0] if tokens else None,
        "finish_s": tokens[-1] if tokens else arrival, "status": status,
        "finish_reason": "length", "stop_reason": None, "output_len": len(tokens),
        "cached_tokens": cached, "num_preemptions": preemptions, "token_times_s": tokens,
    }
    row.update({p: 0.0 for p in PARTS})
    row.update(parts or {})
    return row


# A: TTFT 100, E2E 250, TPOT (250-100)/2 = 75, gaps 50 and 100 ms
# B: one output token: TTFT 100, E2E 100, no TPOT (0 for goodput)
# C: TTFT 300, E2E 320, TPOT 20, gap 20 ms
# D: refused (no output): failed; its finish (1.5 s) ends the run
HAND_REQUESTS = [
    request("A", 0.0, [0.1, 0.15, 0.25], queued=0.01, scheduled=0.02,
            parts={"api_server_s": 0.01, "queue_token_budget_s": 0.01, "prefill_s": 0.08,
                   "decode_s": 0.15}, preemptions=2),
    request("B", 0.5, [0.6], queued=0.51, scheduled=0.51,
            parts={"api_server_s": 0.01, "prefill_s": 0.09}, cached=5),
    request("C", 1.0, [1.3, 1.32], queued=1.01, scheduled=1.21,
            parts={"api_server_s": 0.01, "queue_kv_capacity_s": 0.2, "prefill_s": 0.09,
                   "decode_s": 0.02}),
    request("D", 1.5, [], status="FINISHED_IGNORED"),
]
HAND_STEPS = [
    {"step": i, "start_s": 0.1 * i, "end_s": 0.1 * i + 0.1, "duration_s": 0.1,
     "num_prefill_tokens": 10 if i % 2 == 0 else 0, "num_decode_tokens": 2, "num_seqs": 2,
     "num_prefill_seqs": 1, "prefill_attention_pairs": 0, "prefill_kv_tokens": 0,
     "decode_kv_tokens": 0, "context_tokens": 0, "kv_usage": 0.1 * (i % 5),
     "num_running": 2, "num_waiting": i % 3, "num_preempted": 0, "num_finished": 0,
     "wait_reason": None}
    for i in range(14)
]


@pytest.fixture
def hand_run(tmp_path: Path) -> Path:
    path = tmp_path / "hand"
    write_run(path, HAND_REQUESTS, HAND_STEPS,
              run_info("simulate", "hand", {"name": "hand", "requests": 4, "digest": "abc"},
                       prefix_cache={"queries": 30, "hits": 5},
                       engine_args={"max_num_batched_tokens": 512},
                       model={"name": "Llama-3.1-8B"}))
    return path
