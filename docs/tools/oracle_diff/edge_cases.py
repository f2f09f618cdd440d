"""Edge-shaped scheduler cases in the vLLM oracle's format, the corners `cases.py` rarely
reaches: a pool just big enough for one request with many requests sharing long prefixes
(eviction of cached blocks under pressure), prompts of exact block multiples, chunked prefill
off with a budget of exactly `max_model_len`, one sequence at a time, a long-prefill
threshold with a single request, aborts right after a request's first schedule, stop tokens
and EOS as the first output, all arrivals tied (priority), and prompts one token short of
`max_model_len`. Standard library only; every case from its seed.
"""

from __future__ import annotations

import random
from typing import Any

from cases import EOS, STOP

SHAPES = ("shared_prefix_pressure", "no_chunk_budget_eq_len", "one_seq", "one_request_threshold",
          "abort_after_admit", "stop_first", "tied_priority", "near_max_len")


def _config(rng: random.Random, shape: str) -> dict[str, Any]:
    block_size = rng.choice((2, 4, 8, 16))
    max_model_len = block_size * rng.randint(2, 8)  # a block multiple
    chunked = shape not in ("no_chunk_budget_eq_len",) and rng.random() < 0.8
    num_seqs = 1 if shape in ("one_seq", "one_request_threshold") else rng.choice((1, 2, 4, 8))
    if chunked:
        budget = max(num_seqs, rng.choice((1, 2, block_size, max_model_len)))
    else:
        budget = max(num_seqs, max_model_len)
    min_blocks = -(-max_model_len // block_size) + 1
    num_blocks = min_blocks + (0 if shape == "shared_prefix_pressure"
                               else rng.choice((0, 1, 2, 4, 16)))
    threshold = 0
    if shape == "one_request_threshold" or rng.random() < 0.3:
        threshold = rng.choice((1, 2, block_size - 1 or 1, block_size, max_model_len))
    return {
        "block_size": block_size, "num_blocks": num_blocks,
        "max_num_batched_tokens": budget, "max_num_seqs": num_seqs,
        "max_model_len": max_model_len, "long_prefill_token_threshold": threshold,
        "long_prefill_token_threshold_adaptive": threshold > 0 and rng.random() < 0.5,
        "enable_chunked_prefill": chunked,
        "enable_prefix_caching": shape == "shared_prefix_pressure" or rng.random() < 0.7,
        "policy": "priority" if shape == "tied_priority" else rng.choice(("fcfs", "priority")),
        "scheduler_reserve_full_isl": rng.random() < 0.7,
        "watermark": rng.choice((0.0, 0.0, 0.1, 0.5)),
        "record_free_block_queue": True, "record_block_tables": True, "record_requests": True,
    }


def _prompt_len(rng: random.Random, cfg: dict[str, Any], shape: str) -> int:
    block, max_len = cfg["block_size"], cfg["max_model_len"]
    if shape == "near_max_len":
        return max_len - 1
    if rng.random() < 0.5:  # an exact block multiple, below max_model_len
        return block * rng.randint(1, max(1, (max_len - 1) // block))
    return rng.randint(1, max_len - 1)


def edge_case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    shape = SHAPES[seed % len(SHAPES)]
    cfg = _config(rng, shape)
    max_len = cfg["max_model_len"]
    prefixes = [[rng.randint(10, 400) for _ in range(max_len)] for _ in range(rng.randint(1, 2))]
    num_requests = 1 if shape == "one_request_threshold" else rng.randint(2, 14)
    events: list[dict[str, Any]] = []
    ids: list[str] = []
    for k in range(num_requests):
        req_id = f"R{k}"
        ids.append(req_id)
        length = _prompt_len(rng, cfg, shape)
        if shape == "shared_prefix_pressure" or rng.random() < 0.4:
            prefix = rng.choice(prefixes)
            prompt = prefix[:length]
        else:
            prompt = [rng.randint(10, 400) for _ in range(length)]
        event: dict[str, Any] = {
            "op": "add", "id": req_id, "prompt_token_ids": prompt,
            "max_tokens": rng.choice((1, 2, max_len)), "ignore_eos": rng.random() < 0.3,
            "priority": rng.choice((0, 1)) if cfg["policy"] == "priority" else 0,
            "arrival_time": 0.0 if shape == "tied_priority" else float(k // 2),
        }
        if shape == "stop_first" or rng.random() < 0.2:
            event["stop_token_ids"] = [STOP]
            event["output_token_ids"] = [rng.choice((EOS, STOP))] + [500] * rng.randint(0, 3)
            if rng.random() < 0.3:
                event["min_tokens"] = rng.randint(0, min(2, event["max_tokens"]))
        events.append(event)
        if shape == "abort_after_admit" and rng.random() < 0.5:
            events.append({"op": "step", "count": 1})
            events.append({"op": "abort", "ids": [req_id]})
        elif rng.random() < 0.4:
            events.append({"op": "step", "count": rng.randint(1, 3)})
    if shape == "abort_after_admit":
        events.append({"op": "step", "count": 1})
        events.append({"op": "abort", "ids": [rng.choice(ids)]})
    events.append({"op": "step", "count": 3000})
    return {"seed": seed, "shape": shape, "config": cfg, "events": events}
