"""`rt bench route`'s command lines: `rt serve --simulate` and `rt route` with the policy."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")

from backends.route.bench import route_bench_config  # noqa: E402
from backends.route.flags import RouteBenchFlags  # noqa: E402


def test_commands_carry_the_model_policy_and_load() -> None:
    config = route_bench_config(("py", "cli.py"), "qwen2.5-7b", "h100-sxm", "p.json", 3,
                                "kv-aware", ["a=1", "b=2"], 25.0,
                                RouteBenchFlags(num_requests=9, rounds=1))
    assert config.serve_command == ("py", "cli.py", "serve", "--simulate", "--sim-model",
                                    "qwen2.5-7b", "--gpu", "h100-sxm", "--seed", "3",
                                    "--max-model-len", "4096", "--profile", "p.json")
    assert config.route_command == ("py", "cli.py", "route", "--router", "kv-aware", "--seed",
                                    "3", "--router-refresh-ms", "25.0", "--router-arg", "a=1",
                                    "--router-arg", "b=2")
    assert (config.concurrencies, config.num_requests, config.max_tokens, config.rounds) == (
        (1, 200), 9, 4, 1)
