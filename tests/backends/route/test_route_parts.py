"""The router's parts without servers: metrics parsing, the signals a policy needs, what is
read of a request, metric labels, flags passed on to replicas."""

from __future__ import annotations

import pytest

from backends.route.backends import needed_signals, normalize_url, parse_metrics
from backends.route.fleet import flag_argv
from backends.route.metrics import reason_label
from backends.route.prompt import routing_request
from runtime.config import EngineFlags
from runtime.router import make_policy

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="57429"} 1.0
"""


def test_vllm_gauges_are_summed_over_engines_and_kv_usage_averaged() -> None:
    g = parse_metrics(VLLM_METRICS)
    assert (g.num_running, g.num_waiting, g.kv_usage, g.num_gpu_blocks) == (5.0, 4.0, 0.375,
                                                                             57429)
    assert parse_metrics("up 1\n").num_running is None


@pytest.mark.parametrize(("name", "args", "needed"), [
    ("round-robin", [], ()),
    ("prefix-aware", [], ()),
    ("vllm-dp", [], ("vllm:num_requests_waiting", "vllm:num_requests_running",
                     "vllm:kv_cache_usage_perc")),
    ("vllm-dp", ["formula=legacy"], ("vllm:num_requests_waiting", "vllm:num_requests_running")),
    ("llm-d", [], ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")),
    ("llm-d", ["queue=0", "kv-cache-utilization=0"], ()),
    ("power-of-two", ["load=snapshot"], ("vllm:kv_cache_usage_perc",)),
    ("power-of-two", [], ()),
])
def test_the_metrics_a_policy_reads(name: str, args: list[str], needed: tuple) -> None:
    assert needed_signals(make_policy(name, args)) == needed


@pytest.mark.parametrize(("name", "args"), [("dynamo-kv", []), ("kv-aware", []),
                                            ("llm-d", ["precise-prefix-cache=1"])])
def test_policies_needing_kv_events_are_refused(name: str, args: list[str]) -> None:
    with pytest.raises(ValueError, match="KV events"):
        needed_signals(make_policy(name, args))


def test_prompt_bytes_are_rt_serves_byte_tokens() -> None:
    r = routing_request({"prompt": "ab"}, False, {}, "r0", 1.5)
    assert (r.token_ids, r.prompt_len, r.now_s, r.session_id) == ((100, 101), 2, 1.5, None)
    chat = routing_request({"messages": [{"role": "user", "content": "hi"}], "user": "u7"},
                           True, {}, "r1", 0.0)
    assert bytes(t - 3 for t in chat.token_ids or ()) == b"user: hi\nassistant:"
    assert chat.session_id == "u7"
    ids = routing_request({"prompt": [5, 6, 7]}, False, {"x-session-id": "s"}, "r2", 0.0)
    assert (ids.token_ids, ids.session_id) == ((5, 6, 7), "s")
    empty = routing_request({"prompt": ""}, False, {}, "r3", 0.0)
    assert (empty.token_ids, empty.prompt_len) == (None, 1)


def test_urls_lose_the_v1_suffix_and_must_be_http() -> None:
    assert normalize_url("http://h:1/v1/") == "http://h:1"
    with pytest.raises(ValueError, match="not an http"):
        normalize_url("h:1")
    assert normalize_url("http://h:1/a@b") == "http://h:1/a@b"  # an @ in the path only


def test_a_backend_url_with_credentials_is_refused_unshown() -> None:
    """They would not be sent (the relay forwards the client's Authorization), and the
    refusal does not print them."""
    for url, shown in (("http://u:pw@h:1/v1", "http://***@h:1/v1"),
                       ("https://tok@h", "https://***@h")):
        with pytest.raises(ValueError) as err:
            normalize_url(url)
        assert str(err.value) == (f"--backend {shown!r}: credentials in a backend URL are not "
                                  "sent (the router forwards each client's Authorization)")


def test_reason_labels_drop_numbers_and_tie_notes() -> None:
    assert reason_label("less loaded of 0 and 3 (tie of 2, seeded draw)") == \
        "less loaded of N and N"


def test_flags_passed_on_to_replicas_are_those_changed() -> None:
    assert flag_argv(EngineFlags()) == []
    argv = flag_argv(EngineFlags(max_num_seqs=8, enable_prefix_caching=False))
    assert argv == ["--max-num-seqs", "8", "--no-enable-prefix-caching"]


def test_policies_the_router_builds_no_token_ids_for_never_read_them() -> None:
    import inspect

    from runtime.router import policy_names

    blind = set()
    for name in policy_names():  # a policy that says it reads no ids never touches them
        policy = make_policy(name, [], 0)
        if not policy.reads_token_ids:
            blind.add(name)
            assert ".token_ids" not in inspect.getsource(type(policy)), name
    assert {"round-robin", "session-hash"} <= blind
    assert not {"prefix-aware", "llm-d", "sglang-cache-aware"} & blind
    body = {"prompt": "héllo", "user": "u"}
    full = routing_request(body, False, {}, "r", 1.0)
    bare = routing_request(body, False, {}, "r", 1.0, with_ids=False)
    assert (bare.prompt_len, bare.token_ids, bare.session_id) == (6, None, "u")
    assert full.prompt_len == 6 and full.token_ids is not None and len(full.token_ids) == 6
    ids = routing_request({"prompt": [5, 6, 7]}, False, {}, "r", 1.0, with_ids=False)
    assert (ids.prompt_len, ids.token_ids) == (3, None)


def test_loopback_replicas_are_bounded_by_memory_and_processes() -> None:
    """`rt fleet up --replicas 4096` once planned 4096 `rt serve` processes (~12,000 with
    their engines, ~1.4 TB resident) on one machine; now what its memory and process limit
    hold at one replica's measured footprint."""
    from backends.route.fleet import REPLICA_RSS_BYTES, check_loopback_replicas

    memory = 10 * REPLICA_RSS_BYTES + 1
    check_loopback_replicas(10, memory, nproc=None)
    with pytest.raises(ValueError, match=r"^--replicas 11: this machine holds at most 10 "):
        check_loopback_replicas(11, memory, nproc=None)
    with pytest.raises(ValueError, match=r"^--replicas 4: this machine holds at most 3 .*"
                       r"process limit 9"):
        check_loopback_replicas(4, memory, nproc=9)


def test_a_backend_that_drips_its_answer_is_one_line_within_the_timeout() -> None:
    """`rt route --backend URL` where URL sent its headers, then a byte of body every 0.2 s,
    never started nor said a word (the start-up check's read timeout restarted on each
    byte; badinput23)."""
    from backends.route.backends import check_backends
    from tests.backends.drip_server import dripping_server

    # only the total limit's message: a per-read limit would wait out the 20 s drip and end
    # on the closed connection instead (no timed assertion needed)
    with dripping_server(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                         b"1\r\n \r\n", 0.2) as url, \
            pytest.raises(ValueError, match=f"^backend {url} is unreachable: no "
                          "complete answer in 1 s$"):
        check_backends([url], make_policy("round-robin", []), timeout_s=1.0)
