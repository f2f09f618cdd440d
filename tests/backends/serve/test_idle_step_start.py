"""`rt serve --simulate` after an idle wait: the next step starts when its request arrives, so
the first token takes at least the profile's step time (a step used to start at the previous
step's end, seconds earlier, and the wall-clock executor then slept almost nothing)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.backends.replay.test_endpoint_replay import _rt_serve  # noqa: E402

STEP_S = 0.25  # every step takes at least this long under the profile below (s)


def test_a_request_after_an_idle_wait_takes_a_whole_step(tmp_path: Path) -> None:
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({
        "format": "rt-profile", "version": 1, "device": "test", "model": "test",
        "dtype": "float32", "versions": {}, "date": "2026-01-01",
        "coefficients": {"constant_s": STEP_S, "per_prefill_token_s": 0.0,
                         "per_decode_token_s": 0.0, "per_seq_s": 0.0,
                         "per_prefill_attention_pair_s": 0.0, "per_decode_kv_token_s": 0.0},
        "api_server": {"per_request_s": 0.0, "per_prompt_token_s": 0.0}}))
    with _rt_serve(["--simulate", "--profile", str(profile), "--max-model-len", "512"]) as url:
        body = {"model": "llama-3.1-8b", "prompt": [11, 12, 13, 14], "max_tokens": 1}
        httpx.post(f"{url}/v1/completions", json=body, timeout=30).raise_for_status()
        time.sleep(0.5)  # idle: the engine has nothing to do
        started = time.perf_counter()
        httpx.post(f"{url}/v1/completions", json=body, timeout=30).raise_for_status()
        elapsed = time.perf_counter() - started
    assert elapsed >= STEP_S, f"answered in {elapsed * 1e3:.1f} ms, under one step"
