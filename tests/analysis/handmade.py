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

from analysis.rundir import Run, load_run, run_info, write_run

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
              run_info("simulate", "timeline", {"name": "hand", "requests": 1, "digest": "t"},
                       model={"name": "Llama-3.1-8B"}))
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
    write_run(path, rows, {}, run_info(
        "endpoint", "client", {"name": "hand", "requests": 2, "digest": "c"}, timing="client",
        endpoint={"url": "http://127.0.0.1:8000/v1/completions"}))
    return load_run(path)


# ---- a fleet of two replicas ----------------------------------------------------------------
# Replica 0: the thirteen steps above, request R routed to it in 1 ms (the API server's 2 ms
# become routing 1 ms + API server 1 ms; the rest as above). Replica 1: four 25 ms steps from
# 0.005 (step k is [0.005 + k/40, 0.03 + k/40)), interleaved with replica 0's, serving
#   F1  arrives 0, routing 1 ms, API server 2 ms, taken in at 0.005 (step boundary 2 ms),
#       prefills in step 0, tokens at 0.03, 0.055, 0.08
#   F2  arrives 0.05, routing 1 ms, API server 1 ms, taken in at 0.055 (3 ms), prefills in
#       step 2 (with F1's last decode), tokens at 0.08, 0.105
# Shares: replica 0 1/3, replica 1 2/3; Jain's index of requests (1 + 2)^2 / (2 * 5) = 0.9,
# imbalance 2 / 1.5; prompt tokens 200 and 150.


def replica1_step(k: int) -> dict[str, Any]:
    prefill = {0: 100, 2: 50}.get(k, 0)
    decode = {0: 0, 1: 1, 2: 1, 3: 1}[k]
    return {**step(k), "start_s": 0.005 + k / 40, "end_s": 0.03 + k / 40, "duration_s": 0.025,
            "num_prefill_tokens": prefill, "num_decode_tokens": decode,
            "num_seqs": 2 if k == 2 else 1, "num_prefill_seqs": 1 if prefill else 0,
            "kv_usage": 0.25 * (k + 1), "num_running": 1 if k != 2 else 2, "num_waiting": 0,
            "num_preempted": 0, "num_finished": 1 if k in (2, 3) else 0, "wait_reason": None,
            "replica": 1}


def fleet_request(rid: str, arrival: float, tokens: list[float], prompt_len: int,
                  **parts: float) -> dict[str, Any]:
    """A request served on replica 1 without waiting (parts: routing, API server, step
    boundary; prefill and decode follow from the tokens)."""
    routing, api, boundary = parts["routing_s"], parts["api_server_s"], parts["step_boundary_s"]
    queued = arrival + routing + api
    entry = queued + boundary
    return {**REQUEST, "request_id": rid, "arrival_s": arrival, "prompt_len": prompt_len,
            "max_tokens": len(tokens), "queued_s": queued, "engine_queued_s": entry,
            "first_scheduled_s": entry, "first_token_s": tokens[0], "finish_s": tokens[-1],
            "output_len": len(tokens), "num_preemptions": 0, "token_times_s": tokens,
            **{p: 0.0 for p in PARTS}, "api_server_s": api, "step_boundary_s": boundary,
            "prefill_s": tokens[0] - entry, "decode_s": tokens[-1] - tokens[0],
            "replica": 1, "routing_s": routing}


FLEET_REQUESTS = [
    {**REQUEST, "api_server_s": 0.001, "replica": 0, "routing_s": 0.001},
    fleet_request("F1", 0.0, [0.03, 0.055, 0.08], 100, routing_s=0.001, api_server_s=0.002,
                  step_boundary_s=0.002),
    fleet_request("F2", 0.05, [0.08, 0.105], 50, routing_s=0.001, api_server_s=0.001,
                  step_boundary_s=0.003),
]
# (kind, start, end) of each request's segments, each from its own replica's steps.
FLEET_EXPECTED = {
    "R": [("routing_s", 0.0, 0.001), ("api_server_s", 0.001, 0.002), *EXPECTED[1:]],
    "F1": [("routing_s", 0.0, 0.001), ("api_server_s", 0.001, 0.003),
           ("step_boundary_s", 0.003, 0.005), ("prefill_s", 0.005, 0.03),
           ("decode_s", 0.03, 0.08)],
    "F2": [("routing_s", 0.05, 0.051), ("api_server_s", 0.051, 0.052),
           ("step_boundary_s", 0.052, 0.055), ("prefill_s", 0.055, 0.08),
           ("decode_s", 0.08, 0.105)],
}
FLEET_CHUNKS = {"R": [(0, 3), (0, 4)], "F1": [(1, 0)], "F2": [(1, 2)]}  # (replica, step)


def fleet_run(root: Path) -> Run:
    path = root / "fleet"
    steps = [{**step(k), "replica": 0} for k in range(13)] + [replica1_step(k)
                                                                for k in range(4)]
    write_run(path, FLEET_REQUESTS, steps,
              run_info("simulate", "fleet", {"name": "hand", "requests": 3, "digest": "f"},
                       model={"name": "Llama-3.1-8B"},
                       fleet={"replicas": 2, "router": "round-robin", "pools": None,
                              "routing_latency_ms": 1.0}))
    return load_run(path)


# ---- prefill/decode disaggregation ------------------------------------------------------------
# P is prefilled on replica 0 (pool "p", role prefill; 10 ms steps from 0) and decoded on
# replica 1 (pool "d", role decode; 10 ms steps from 0.005):
#   0      arrives; routing 1 ms; the prefill replica's API server 1 ms, handed over at 0.002
#   0.01   taken in at replica 0's next step (step boundary 8 ms); step 1 waits (KV capacity)
#   0.02   prefills in replica 0's steps 2 and 3; prefilled at 0.04
#   0.04   the decode replica's API server 2 ms; KV transfer 0.042 - 0.047 (5 ms)
#   0.047  taken in at replica 1's step 5 (0.055, step boundary 8 ms), which waits (token
#          budget); its step 6 [0.065, 0.075) samples the first token; decodes in 7 and 8
# Parts: routing 1, API server 1 + 2, step boundary 8 + 8, queue KV 10, queue token budget
# 10, prefill 20 + 10, KV transfer 5, decode 20 ms: 95 ms in all.
PD_TOKENS = [0.075, 0.085, 0.095]


def pd_step(replica: int, k: int) -> dict[str, Any]:
    offset = 0.005 * replica
    prefill = {(0, 2): 100, (0, 3): 100, (1, 6): 1}.get((replica, k), 0)
    waits = {(0, 1): "kv_capacity", (1, 5): "token_budget"}.get((replica, k))
    return {**step(k), "start_s": offset + k / 100, "end_s": offset + (k + 1) / 100,
            "num_prefill_tokens": prefill, "num_decode_tokens": 0 if prefill else 1,
            "num_prefill_seqs": 1 if prefill else 0, "kv_usage": 0.1 * replica + 0.05,
            "num_running": 1, "num_waiting": 1 if waits else 0, "num_preempted": 0,
            "num_finished": 0, "wait_reason": waits, "replica": replica}


PD_REQUEST: dict[str, Any] = {
    **REQUEST, "request_id": "P", "prompt_len": 200, "max_tokens": 3, "queued_s": 0.002,
    "engine_queued_s": 0.01, "first_scheduled_s": 0.02, "first_token_s": 0.075,
    "finish_s": 0.095, "output_len": 3, "num_preemptions": 0, "token_times_s": PD_TOKENS,
    "api_server_s": 0.003, "step_boundary_s": 0.016, "queue_token_budget_s": 0.01,
    "queue_kv_capacity_s": 0.01, "preempted_s": 0.0, "prefill_s": 0.03, "decode_s": 0.02,
    "replica": 1, "routing_s": 0.001, "prefill_replica": 0, "kv_transfer_s": 0.005,
    "kv_transfer_bytes": 26_214_400, "prefill_queue_s": 0.01, "decode_queue_s": 0.01,
}
PD_EXPECTED = [
    ("routing_s", 0.0, 0.001), ("api_server_s", 0.001, 0.002),
    ("step_boundary_s", 0.002, 0.01), ("queue_kv_capacity_s", 0.01, 0.02),
    ("prefill_s", 0.02, 0.04),  # replica 0
    ("api_server_s", 0.04, 0.042), ("kv_transfer_s", 0.042, 0.047),
    ("step_boundary_s", 0.047, 0.055), ("queue_token_budget_s", 0.055, 0.065),
    ("prefill_s", 0.065, 0.075), ("decode_s", 0.075, 0.095),  # replica 1
]
PD_CHUNKS = [(0, 2), (0, 3), (1, 6)]  # (replica, step)


def pd_run(root: Path) -> Run:
    path = root / "pd"
    pools = [{"name": "p", "count": 1, "role": "prefill"},
             {"name": "d", "count": 1, "role": "decode"}]
    steps = [pd_step(0, k) for k in range(4)] + [pd_step(1, k) for k in range(9)]
    write_run(path, [PD_REQUEST], steps,
              run_info("simulate", "pd", {"name": "hand", "requests": 1, "digest": "p"},
                       model={"name": "Llama-3.1-8B"},
                       fleet={"replicas": 2, "router": "round-robin", "pools": pools},
                       pd={"pd_decider": "always"}))
    return load_run(path)
