"""Random scheduler cases in the vLLM oracle's format (shared/tools/vllm_oracle/README.md):
a config plus add / step / abort events. Standard library only; every case from its seed.

The generator aims at the places where a scheduler can differ while staying plausible:
small KV pools (preemption, admission refused for blocks), shared prompt prefixes (prefix
hits, evictions of cached blocks), chunked prefill under small budgets and per-request caps,
requests reaching `max_model_len`, EOS and stop tokens (forced in a step or planned), and
aborts of waiting, running, preempted and already finished requests.

Every config lets any single request fit the pool on its own (`max_model_len` tokens fit in
the usable blocks), so no case can stall for a reason vLLM's front end would have refused.
"""

from __future__ import annotations

import random
from typing import Any

EOS = 2  # the oracle's default eos_token_id
STOP = 7  # a stop token some requests name


def random_config(rng: random.Random, large: bool) -> dict[str, Any]:
    block_size = rng.choice((2, 4, 4, 8, 16))
    num_seqs = rng.choice((1, 2, 3, 4, 6, 8) + ((16, 32) if large else ()))
    chunked = rng.random() < 0.85
    # Usable blocks (ids 1..num_blocks-1) must hold max_model_len tokens.
    max_model_len = rng.choice((16, 24, 32, 48, 64, 96) + ((128, 200, 256) if large else ()))
    min_blocks = -(-max_model_len // block_size) + 1
    num_blocks = min_blocks + rng.choice((0, 1, 2, 3, 5, 8, 16, 40))
    if chunked:
        budget = max(num_seqs, rng.choice((4, 6, 8, 12, 16, 24, 32, 64)))
    else:
        budget = max(num_seqs, max_model_len + rng.choice((0, 0, 8, 32)))
    threshold = rng.choice((0, 0, 0, 2, 3, 5, 8))
    if threshold > max_model_len:
        threshold = 0
    return {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_num_batched_tokens": budget,
        "max_num_seqs": num_seqs,
        "max_model_len": max_model_len,
        "long_prefill_token_threshold": threshold,
        "enable_chunked_prefill": chunked,
        "enable_prefix_caching": rng.random() < 0.75,
        "policy": rng.choice(("fcfs", "fcfs", "priority")),
        "scheduler_reserve_full_isl": rng.random() < 0.8,
        "watermark": rng.choice((0.0, 0.0, 0.0, 0.05, 0.2)),
        "record_kv_events": rng.random() < 0.5,
        "record_free_block_queue": True,
        "record_block_tables": True,
        "record_requests": True,
    }


def _prompt(rng: random.Random, prefixes: list[list[int]], max_len: int) -> list[int]:
    length = rng.randint(1, max_len)
    tokens: list[int] = []
    if prefixes and rng.random() < 0.6:
        prefix = rng.choice(prefixes)
        tokens = prefix[: rng.randint(1, len(prefix))]
    while len(tokens) < length:
        tokens.append(rng.randint(10, 400))
    return tokens[:length]


def random_events(rng: random.Random, cfg: dict[str, Any], large: bool
                  ) -> list[dict[str, Any]]:
    max_len = cfg["max_model_len"]
    prefixes = [[rng.randint(10, 400) for _ in range(max_len)] for _ in range(rng.randint(0, 3))]
    num_requests = rng.randint(1, 40 if large else 10)
    events: list[dict[str, Any]] = []
    ids: list[str] = []
    added = 0
    clock = 0.0
    while added < num_requests or rng.random() < 0.3:
        roll = rng.random()
        if added < num_requests and roll < 0.45:
            req_id = f"R{added}"
            added += 1
            ids.append(req_id)
            clock += rng.choice((0.0, 0.0, 1.0))  # ties: broken by add order (as_received)
            prompt = _prompt(rng, prefixes, max_len - 1)
            event: dict[str, Any] = {
                "op": "add", "id": req_id, "prompt_token_ids": prompt,
                "max_tokens": rng.randint(1, max_len), "ignore_eos": rng.random() < 0.5,
                "priority": rng.choice((0, 0, 1, 2)) if cfg["policy"] == "priority" else 0,
                "arrival_time": clock,
            }
            if rng.random() < 0.3:
                event["stop_token_ids"] = [STOP]
            if rng.random() < 0.2:
                event["min_tokens"] = rng.randint(0, event["max_tokens"])
            if rng.random() < 0.3:
                event["output_token_ids"] = [rng.choice((EOS, STOP, 500, 501, 502))
                                             for _ in range(rng.randint(1, 6))]
            events.append(event)
        elif ids and roll < 0.52:
            # One id per abort: vLLM frees a multi-id abort's requests in the order of a
            # set of strings, which changes with the process's hash seed.
            events.append({"op": "abort", "ids": [rng.choice(ids)]})
        elif ids and roll < 0.62:
            events.append({"op": "step", "tokens": {rng.choice(ids): rng.choice((EOS, STOP))}})
        else:
            events.append({"op": "step", "count": rng.randint(1, 4)})
    events.append({"op": "step", "count": 8000 if large else 3000})  # run to the end
    return events


def random_case(seed: int, large: bool = False) -> dict[str, Any]:
    """A case from its seed; `large`: up to 40 requests, longer sequences, more running."""
    rng = random.Random(seed)
    cfg = random_config(rng, large)
    return {"seed": seed, "config": cfg, "events": random_events(rng, cfg, large)}
