"""The vLLM 0.32 metric families rt serve exports at vLLM's value for an engine without the
feature (sleep mode, KV connector, multimodal cache), the prompt tokens cached by source, the
admission rejections by reason, and the MFU estimates (--enable-mfu-metrics) from both
engines, step by step."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backends.serve.metrics import ServeMetrics
from runtime.perf import BatchContext, PerfShape, StepPerf, batch_perf
from tests.backends.serve.test_serve import Served

ESTIMATES = ("vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
             "vllm:estimated_write_bytes_per_gpu_total")


def _values(text: str) -> dict[str, float]:
    """`name{label="value",...}` (labels but model_name and engine, sorted) -> value, for
    every sample of a Prometheus text exposition (prometheus-client's parser)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                              if k not in ("model_name", "engine"))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def _metrics(metrics: ServeMetrics) -> dict[str, float]:
    return _values(generate_latest(metrics.registry).decode())


def test_the_families_of_absent_features_hold_vllms_values() -> None:
    """vLLM registers each with its children at start-up: an awake engine (sleep level 0),
    no external or multimodal cache traffic, no rejection yet, no estimate without the flag."""
    values = _metrics(ServeMetrics("m", 256, 64, 16, True))
    assert {k: v for k, v in values.items() if k.startswith("vllm:engine_sleep_state")} == {
        'vllm:engine_sleep_state{sleep_state="awake"}': 1.0,
        'vllm:engine_sleep_state{sleep_state="weights_offloaded"}': 0.0,
        'vllm:engine_sleep_state{sleep_state="discard_all"}': 0.0}
    for name in ("external_prefix_cache_queries", "external_prefix_cache_hits",
                 "mm_cache_queries", "mm_cache_hits"):
        assert values[f"vllm:{name}_total"] == 0.0
        assert f"vllm:{name}_created" in values
    for name in ESTIMATES:
        assert values[name] == 0.0
    assert {k: v for k, v in values.items() if k.startswith("vllm:admission_rejections_t")} \
        == {'vllm:admission_rejections_total{reason="max_num_queued_reqs"}': 0.0,
            'vllm:admission_rejections_total{reason="max_num_queued_tokens"}': 0.0}
    assert {k: v for k, v in values.items()
            if k.startswith("vllm:prompt_tokens_cached_by_source_total")} == {
        f'vllm:prompt_tokens_cached_by_source_total{{source="{s}"}}': 0.0
        for s in ("device", "host", "p2p", "disk", "external_unspecified")}


def test_cached_tokens_by_source_follow_the_prefix_cache_hits() -> None:
    """vLLM adds each step's prefix-cache hits (cumulative counters here) to the device tier;
    nothing reaches the other tiers without a KV connector."""
    metrics = ServeMetrics("m", 256, 64, 16, True)
    metrics.on_stats(1, 0, 0.5, 320, 0, 0)
    metrics.on_stats(1, 0, 0.5, 640, 304, 0)
    metrics.on_stats(1, 0, 0.5, 640, 304, 0)
    values = _metrics(metrics)
    assert values['vllm:prompt_tokens_cached_by_source_total{source="device"}'] == 304
    assert values["vllm:prefix_cache_hits_total"] == 304
    assert sum(v for k, v in values.items()
               if k.startswith("vllm:prompt_tokens_cached_by_source_total")) == 304


def test_admission_rejections_by_reason() -> None:
    metrics = ServeMetrics("m", 256, 64, 16, True)
    metrics.on_rejected()
    metrics.on_rejected()
    values = _metrics(metrics)
    assert values['vllm:admission_rejections_total{reason="max_num_queued_reqs"}'] == 2
    assert values['vllm:admission_rejections_total{reason="max_num_queued_tokens"}'] == 0
    with pytest.raises(KeyError):
        metrics.on_rejected("queue_full")


def test_estimates_add_up_and_an_all_zero_step_adds_nothing() -> None:
    metrics = ServeMetrics("m", 256, 64, 16, True)
    metrics.on_perf(StepPerf(10_627_072, 1_647_616, 195_584))
    metrics.on_perf(StepPerf(1, 2, 3))
    metrics.on_perf(None)
    metrics.on_perf(StepPerf(0, 0, 0))
    values = _metrics(metrics)
    assert [values[name] for name in ESTIMATES] == [10_627_073, 1_647_618, 195_587]


# ---- end to end: one request alone on a fresh server ----------------------------------------

LLAMA_8B = PerfShape(4096, 32, 32, 8, 128, 14336, 128256, 2, 2, 2)  # the simulator's default
TINY_FP32 = PerfShape(128, 2, 4, 2, 32, 256, 512, 4, 4, 4)  # the real engine's default, CPU


def _one_request(shape: PerfShape, prompt_len: int, max_tokens: int) -> list[float]:
    """The estimates of a request alone: its prefill step (context = prompt), one decode
    step per further token (context prompt + 1, + 2, ...), then vLLM's empty step once the
    engine is idle (the weights read once)."""
    steps = [[(prompt_len, prompt_len, True)]] + [[(1, prompt_len + k, False)]
                                                   for k in range(1, max_tokens)] + [[]]
    total = [0, 0, 0]
    for step in steps:
        ctx = BatchContext()
        for request in step:
            ctx.add(*request)
        perf = batch_perf(shape, ctx)
        total = [total[0] + perf.flops, total[1] + perf.read_bytes,
                 total[2] + perf.write_bytes]
    return [float(v) for v in total]


def _run(server: Served, prompt: str, max_tokens: int) -> tuple[int, list[float]]:
    done = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert done.status_code == 200, done.text
    values = _values(httpx.get(f"{server.url}/metrics", timeout=5).text)
    return done.json()["usage"]["prompt_tokens"], [values[name] for name in ESTIMATES]


@pytest.fixture()
def simulated_mfu() -> Iterator[Served]:
    server = Served(["--simulate", "--max-model-len", "4096", "--enable-mfu-metrics"])
    yield server
    server.stop()


def test_the_simulated_engine_estimates_each_step(simulated_mfu: Served) -> None:
    """llama-3.1-8b in bf16 on one GPU: 320 prompt tokens (one per byte), 4 tokens out."""
    prompt_len, got = _run(simulated_mfu, "x" * 320, 4)
    assert prompt_len == 320
    assert got == _one_request(LLAMA_8B, 320, 4)


def test_the_real_engine_estimates_as_vllm_did() -> None:
    """The tiny Llama in fp32 on the CPU. vLLM 0.32 (CPU, --dtype float32
    --enable-mfu-metrics) served the same directory the same request, 2026-12-04, and
    exported these three counters: 30,369,792 FLOPs, 7,878,656 bytes read (1,441,792 of them
    the weights of its empty step at the end) and 537,600 written."""
    server = Served(["--max-model-len", "256", "--num-gpu-blocks-override", "64",
                     "--enable-mfu-metrics"])
    try:
        prompt_len, got = _run(server, "hello world, this is a prompt of some length", 4)
        assert prompt_len == 44
        assert got == [30_369_792, 7_878_656, 537_600]
        assert got == _one_request(TINY_FP32, prompt_len, 4)
    finally:
        server.stop()


def test_without_the_flag_the_estimates_stay_at_zero() -> None:
    """vLLM's default (--enable-mfu-metrics off): registered, never moved."""
    server = Served(["--simulate", "--max-model-len", "4096"])
    try:
        _, got = _run(server, "x" * 32, 2)
        assert got == [0.0, 0.0, 0.0]
    finally:
        server.stop()
