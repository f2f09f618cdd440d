"""A `vllm bench serve --save-result --save-detailed` JSON file read as a run, so `rt report`
and `rt compare` take it beside rt's run directories.

vLLM's per-request arrays (vllm 0.32 `benchmarks/serve.py`, `benchmark`; seconds, one entry
per request in the dataset's order, failed ones included): `start_times` (perf_counter when
sent), `ttfts`, `itls` (gaps between chunks), `latencies`, `input_lens`, `output_lens` (0 for a
failed request), `errors` ("" on success). They become the rows of a client-timed run
(`timing: client`, as `rt replay --endpoint`): `arrival_s` = start - the first start,
`first_token_s` = arrival + TTFT, `token_times_s` = the first token then each ITL gap added,
`finish_s` = arrival + latency. What only a server sees (queue, schedule, the attribution
parts) is NaN, and there are no steps. Request ids are the 0-based positions ("0", "1", ...),
as rt's traces number theirs, so `rt compare` can match a run of the same trace.
Without `--save-detailed` vLLM drops the arrays: such a file is refused with one line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.rundir import Run

DETAILED = ("start_times", "ttfts", "itls", "input_lens", "output_lens")
SERVER_COLUMNS = ("queued_s", "engine_queued_s", "first_scheduled_s", "api_server_s",
                  "step_boundary_s", "queue_token_budget_s", "queue_max_num_seqs_s",
                  "queue_kv_capacity_s", "queue_preempted_step_s", "preempted_s", "prefill_s",
                  "decode_s")
_CONFIG_KEYS = ("date", "backend", "endpoint_type", "label", "model_id", "tokenizer_id",
                "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
                "completed", "failed")


def is_vllm_bench_file(path: Path) -> bool:
    return path.is_file() and path.suffix == ".json"


def load_vllm_bench(path: Path) -> Run:
    """The run of a vLLM bench result file; ValueError (one line, naming the file and the
    field) when it is not one or lacks the per-request arrays."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict) or "completed" not in data:
        raise ValueError(f"{path}: not a vllm bench serve result (no 'completed' field)")
    arrays = {name: _array(data, name, path) for name in DETAILED}
    count = len(arrays["start_times"])
    for name, values in arrays.items():
        if len(values) != count:
            raise ValueError(f"{path}: field {name!r} has {len(values)} entries, "
                             f"'start_times' {count}")
    if count == 0:
        raise ValueError(f"{path}: field 'start_times' is empty (no requests)")
    latencies = _optional_array(data, "latencies", count, path)
    errors = _optional_array(data, "errors", count, path) or [""] * count
    t0 = min(float(t) for t in arrays["start_times"])
    rows = [_row(i, arrays, latencies, errors, t0, path) for i in range(count)]
    return Run(path, pd.DataFrame(rows), pd.DataFrame(), _info(data, path))


def _array(data: dict[str, Any], name: str, path: Path) -> list[Any]:
    if name not in data:
        raise ValueError(f"{path}: field {name!r} missing: vllm bench serve writes the "
                         "per-request arrays only with --save-detailed")
    value = data[name]
    if not isinstance(value, list):
        raise ValueError(f"{path}: field {name!r} must be a list, got {value!r:.60}")
    return value


def _optional_array(data: dict[str, Any], name: str, count: int,
                    path: Path) -> list[Any] | None:
    """Field `name` when it is a list (then of `count` entries, one a request), else None
    (vLLM leaves `latencies` and `errors` out of older files; a non-list is read as absent,
    as before)."""
    value = data.get(name)
    if not isinstance(value, list):
        return None
    if len(value) != count:
        raise ValueError(f"{path}: field {name!r} has {len(value)} entries, "
                         f"'start_times' {count}")
    return value


def _row(i: int, arrays: dict[str, list[Any]], latencies: list[Any] | None,
         errors: list[Any], t0: float, path: Path) -> dict[str, Any]:
    arrival = _seconds(arrays["start_times"][i], "start_times", i, path) - t0
    output = arrays["output_lens"][i]
    output_len = 0 if output is None else _count(output, "output_lens", i, path)
    ok = not errors[i] and output_len > 0
    ttft = _seconds(arrays["ttfts"][i], "ttfts", i, path)
    gaps = arrays["itls"][i] or []
    if not isinstance(gaps, list):
        raise ValueError(f"{path}: field 'itls' entry {i} must be a list, got {gaps!r:.60}")
    if ok:
        gaps = [_seconds(gap, "itls", i, path) for gap in gaps]  # names a bad gap's entry
    times = (arrival + ttft + np.concatenate([[0.0], np.cumsum(np.asarray(gaps, float))])
             ).tolist() if ok else []
    latency = _seconds(latencies[i], "latencies", i, path) if latencies else None
    finish = arrival + latency if latency is not None and ok else (times[-1] if times
                                                                    else arrival)
    prompt_len = _count(arrays["input_lens"][i], "input_lens", i, path)
    row: dict[str, Any] = {
        "request_id": str(i), "arrival_s": arrival, "prompt_len": prompt_len,
        "max_tokens": output_len, "first_token_s": times[0] if times else math.nan,
        "finish_s": finish, "status": "FINISHED_LENGTH_CAPPED" if ok else "FINISHED_ABORTED",
        "finish_reason": "length" if ok else "abort", "stop_reason": None,
        "output_len": output_len if ok else 0, "cached_tokens": 0, "num_preemptions": 0,
        "token_times_s": times,
    }
    row.update({column: math.nan for column in SERVER_COLUMNS})
    return row


def _seconds(value: Any, name: str, i: int, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value):
        raise ValueError(f"{path}: field {name!r} entry {i} must be a number of seconds, "
                         f"got {value!r}")
    return float(value)


def _count(value: Any, name: str, i: int, path: Path) -> int:
    """A token count: an int >= 0 (JSON's 3.0 is 3; a bool, a fraction or text is refused)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{path}: field {name!r} entry {i} must be a count of tokens "
                         f"(an integer >= 0), got {value!r:.60}")
    return value


def _info(data: dict[str, Any], path: Path) -> dict[str, Any]:
    rate = data.get("request_rate")
    return {
        "kind": "vllm-bench", "timing": "client", "name": str(data.get("label") or path.stem),
        "backend": data.get("backend"), "model": {"name": data.get("model_id")},
        "request_rate": None if rate is None else float(rate),  # "inf" -> inf
        "burstiness": data.get("burstiness", 1.0),
        "max_concurrency": data.get("max_concurrency"), "date": data.get("date"),
        "vllm_bench": {k: data[k] for k in _CONFIG_KEYS if k in data},
        "cached_tokens_reported": 0,
    }
