"""What an endpoint exports about its KV pool: `vllm:cache_config_info`'s labels on /metrics
(`backends.replay.endpoint_probe.cache_config_labels`, `metrics_url`)."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")

from backends.replay.endpoint_probe import cache_config_labels, metrics_url  # noqa: E402

# vLLM 0.x writes every CacheConfig field as a label, "None" when unset.
VLLM = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",calculate_kv_scales="False",\
enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",\
num_gpu_blocks="7281",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_vllm_cache_config_labels_are_read() -> None:
    assert cache_config_labels(VLLM) == {"block_size": 128, "num_gpu_blocks": 7281,
                                         "enable_prefix_caching": True}


def test_absent_or_unset_labels_are_left_out() -> None:
    assert cache_config_labels("vllm:num_requests_running 0.0\n") == {}
    assert cache_config_labels(
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="None",'
        'enable_prefix_caching="False"} 1.0\n') == {"block_size": 16,
                                                    "enable_prefix_caching": False}
    assert cache_config_labels('vllm:cache_config_info{block_size="x"} 1.0') == {}


def test_metrics_sit_beside_v1() -> None:
    assert metrics_url("http://h:8000/v1/completions") == "http://h:8000/metrics"
    assert metrics_url("http://h/p/v1/completions") == "http://h/p/metrics"
