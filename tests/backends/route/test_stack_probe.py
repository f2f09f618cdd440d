"""Where a real fleet's TTFT goes (`backends.route.stack_probe`): the replicas' histogram
sums and counts, the difference of two scrapes, and the split of the client's mean TTFT."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("prometheus_client")

from backends.route.stack_probe import ServerTotals, parse_server_totals, ttft_split  # noqa: E402


def replica_metrics(ttft: tuple[float, float], queue: tuple[float, float],
                    prefill: tuple[float, float]) -> str:
    """An `rt serve` /metrics text with these (sum, count) of three histograms."""
    lines = []
    for name, (total, count) in (("vllm:time_to_first_token_seconds", ttft),
                                 ("vllm:request_queue_time_seconds", queue),
                                 ("vllm:request_prefill_time_seconds", prefill)):
        lines += [f"# TYPE {name} histogram",
                  f'{name}_bucket{{le="+Inf",model_name="m"}} {count}',
                  f'{name}_count{{model_name="m"}} {count}',
                  f'{name}_sum{{model_name="m"}} {total}']
    lines += ["# TYPE vllm:num_requests_running gauge",
              'vllm:num_requests_running{model_name="m"} 0.0']
    return "\n".join(lines) + "\n"


def test_totals_sum_over_replicas_and_difference_two_scrapes() -> None:
    before = parse_server_totals([replica_metrics((0.1, 5), (0.01, 5), (0.05, 5))])
    after = parse_server_totals([replica_metrics((0.3, 15), (0.02, 15), (0.15, 15)),
                                 replica_metrics((0.4, 20), (0.04, 20), (0.2, 20))])
    assert after == ServerTotals(0.7, 35, 0.06, 35, 0.35, 35)
    delta = after.minus(before)
    assert delta.ttft_count == 30 and delta.mean_s("ttft") == pytest.approx(0.02)
    assert delta.mean_s("queue") == pytest.approx(0.05 / 30)
    assert math.isnan(ServerTotals().mean_s("prefill"))


def test_the_split_adds_up_to_the_client_ttft() -> None:
    servers = ServerTotals(ttft_sum=0.15, ttft_count=10, queue_sum=0.01, queue_count=10,
                           prefill_sum=0.09, prefill_count=10)
    split = ttft_split(0.021, 0.001, servers)
    assert split["engine_mean_ms"] == pytest.approx(10.0)  # queue 1 + prefill 9
    assert split["api_ipc_mean_ms"] == pytest.approx(5.0)  # serve 15 - engine 10
    assert split["hops_mean_ms"] == pytest.approx(5.0)  # client 21 - serve 15 - routing 1
    parts = ("routing_mean_ms", "hops_mean_ms", "api_ipc_mean_ms", "engine_mean_ms")
    assert sum(split[p] for p in parts) == pytest.approx(split["client_ttft_mean_ms"])
