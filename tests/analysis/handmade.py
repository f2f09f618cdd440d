"""A hand-made run whose one request's timeline is worked out by hand, and a client-timed
run: shared by the timeline, trace-event and HTML tests.

Thirteen 10 ms steps, back to back from 0 (step k is [k/100, (k+1)/100)). Request R:
    0     arrives; 2 ms in the API server, handed over at 0.002
    0.01  taken in at the next step boundary (step boundary 8 ms)
    steps 1, 2   waiting: step 1's head waits for KV capacity, step 2's for the token budget
    steps 3, 4   admitted at 0.03, prefills in two chunks; first token at 0.05
    steps 5, 6   decodes: tokens at 0.06, 0.07
    step 7       preempted (num_preempted = 1); step 8 waits; step 9 recomputes: token 0.10
    step 10      decodes: token 0.11
    step 11      left out (token budget)
    step 12      decodes: token 0.13, finishes
Parts (s): api 0.002, step boundary 0.008, queue KV 0.01, queue token budget 0.01 + 0.01
(skipped step 11), prefill 0.02, decode 0.04, preempted 0.03: 0.13 in all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from analysis.rundir import Run, load_run, write_run

NAN = float("nan")
PARTS = ("api_server_s", "step_boundary_s", "queue_token_budget_s", "queue_max_num_seqs_s",
         "queue_kv_capacity_s", "queue_preempted_step_s", "preempted_s", "prefill_s",
         "decode_s")
REASONS = {1: "kv_capacity", 2: "token_budget"}
PREFILL_STEPS = (3, 4, 9)
TOKENS = [5 / 100, 6 / 100, 7 / 100, 10 / 100, 11 / 100, 13 / 100]


def step(k: int) -> dict[str, Any]:
    prefill = 100 if k in PREFILL_STEPS else 0
    return {"step": k, "start_s": k / 100, "end_s": (k + 1) / 100, "duration_s": 0.01,
            "num_prefill_tokens": prefill, "num_decode_tokens": 0 if prefill else 1,
            "num_seqs": 1, "num_prefill_seqs": 1 if prefill else 0,
            "prefill_attention_pairs": 0, "prefill_kv_tokens": 0, "decode_kv_tokens": 0,
            "context_tokens": 0, "kv_usage": 0.5 if 3 <= k <= 6 or k >= 9 else 0.0,
            "num_running": 0 if k in (0, 1, 2, 7, 8) else 1,
            "num_waiting": 1 if k in (1, 2, 7, 8) else 0,
            "num_preempted": 1 if k == 7 else 0, "num_finished": 1 if k == 12 else 0,
            "wait_reason": REASONS.get(k)}


REQUEST: dict[str, Any] = {
    "request_id": "R", "arrival_s": 0.0, "prompt_len": 200, "max_tokens": 6,
    "queued_s": 0.002, "engine_queued_s": 0.01, "first_scheduled_s": 0.03,
    "first_token_s": 0.05, "finish_s": 0.13, "status": "FINISHED_LENGTH_CAPPED",
    "finish_reason": "length", "stop_reason": None, "output_len": 6, "cached_tokens": 0,
    "num_preemptions": 1, "token_times_s": TOKENS, "api_server_s": 0.002,
    "step_boundary_s": 0.008, "queue_token_budget_s": 0.02, "queue_max_num_seqs_s": 0.0,
    "queue_kv_capacity_s": 0.01, "queue_preempted_step_s": 0.0, "preempted_s": 0.03,
    "prefill_s": 0.02, "decode_s": 0.04,
}
# (kind, start, end) of R's segments, in order.
EXPECTED = [
    ("api_server_s", 0.0, 0.002), ("step_boundary_s", 0.002, 0.01),
    ("queue_kv_capacity_s", 0.01, 0.02), ("queue_token_budget_s", 0.02, 0.03),
    ("prefill_s", 0.03, 0.05), ("decode_s", 0.05, 0.07), ("preempted_s", 0.07, 0.10),
    ("decode_s", 0.10, 0.11), ("skipped_s", 0.11, 0.12), ("decode_s", 0.12, 0.13),
]


def timeline_run(root: Path) -> Run:
    path = root / "timeline"
    write_run(path, [REQUEST], [step(k) for k in range(13)],
              {"kind": "simulate", "name": "timeline", "model": {"name": "Llama-3.1-8B"},
               "trace": {"name": "hand", "requests": 1, "digest": "t"}})
    return load_run(path)


def client_run(root: Path) -> Run:
    """Two requests as `rt replay --endpoint` records them: server-side columns NaN, no
    steps."""
    rows = []
    for rid, arrival, tokens in (("c0", 0.0, [0.2, 0.25, 0.3]), ("c1", 0.1, [0.5, 0.6])):
        row = {**REQUEST, "request_id": rid, "arrival_s": arrival, "first_token_s": tokens[0],
               "finish_s": tokens[-1], "token_times_s": tokens, "output_len": len(tokens),
               "num_preemptions": 0, "cached_tokens": 4, "queued_s": NAN,
               "engine_queued_s": NAN, "first_scheduled_s": NAN}
        row.update({p: NAN for p in PARTS})
        rows.append(row)
    path = root / "client"
    write_run(path, rows, {}, {"kind": "endpoint", "name": "client", "timing": "client",
                               "endpoint": {"url": "http://127.0.0.1:8000/v1/completions"}})
    return load_run(path)
