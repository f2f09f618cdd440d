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


def test_a_server_that_drips_its_answer_is_bounded_by_the_timeout() -> None:
    """An endpoint that sent its headers, then a byte of body every 0.2 s forever, held
    `rt replay --endpoint` at the probe with no end: httpx's read timeout restarts on each
    byte (badinput23). The probe now gives up at --timeout in all."""
    from backends.replay.endpoint_probe import EndpointConfig, EndpointError, probe
    from tests.backends.drip_server import dripping_server

    # only the total limit's message: a per-read limit would wait out the 20 s drip and end
    # on the closed connection instead
    with dripping_server(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n", b"1\r\n \r\n", 0.2) as url, \
            pytest.raises(EndpointError, match="no complete answer in 1 s"):
        probe(EndpointConfig(url, timeout_s=1.0))


@pytest.mark.parametrize(("url", "shown"), [
    ("http://user:s3cret@127.0.0.1:9", "cannot reach http://***@127.0.0.1:9/v1/completions"),
    ("http://user:s3cret@h:99999", "--endpoint 'http://***@h:99999': port 99999"),
    ("ftp://user:s3cret@h", "--endpoint 'ftp://***@h': expected http(s)"),
    ("http://u:s3/c@ret@h:x", "--endpoint 'http://***@h:x': not a URL")])
def test_credentials_in_the_url_are_never_shown(url: str, shown: str) -> None:
    """badinput23b: `--endpoint http://user:pass@host` echoed the password in every error
    line (the request still sends them, as HTTP basic auth)."""
    from backends.replay.endpoint_probe import EndpointConfig, EndpointError, probe

    with pytest.raises(EndpointError) as err:
        probe(EndpointConfig(url, timeout_s=5.0))
    assert shown in str(err.value) and "s3" not in str(err.value), str(err.value)


def test_an_endpoint_runs_label_shows_no_credentials() -> None:
    from analysis.compare import kind_label

    assert kind_label({"kind": "endpoint", "endpoint": {"url": "http://u:s3cret@h:80/v1"}}) \
        == "endpoint h:80"
