"""`rt bench serve`'s pieces that need no server: the command it starts, when it fails."""

from __future__ import annotations

from backends.bench.flags import ServeBenchFlags, ServeLoadFlags
from backends.bench.serve_run import SimulatedServer, failed


def test_load_config_starts_rt_serve_simulate_with_the_engine_limits() -> None:
    server = SimulatedServer("py", "llama-3.1-8b", "h200", None, 3, 4096, None)
    config = server.load_config(ServeLoadFlags(concurrency=7, timeout=9.0),
                                ServeBenchFlags(client="lean"), 500)
    assert config.server_command == ("py", "-m", "cli", "serve", "--simulate", "--sim-model",
                                     "llama-3.1-8b", "--gpu", "h200", "--seed", "3",
                                     "--max-model-len", "4096")
    assert (config.concurrency, config.vocab_size, config.seed, config.request_timeout_s,
            config.client) == (7, 500, 3, 9.0, "lean")


def test_failed_on_errors_mismatches_or_kv_left() -> None:
    ok = {"errors": 0, "token_count_mismatches": 0}
    assert not failed(ok) and not failed({**ok, "kv_blocks_in_use_after": 0})
    assert failed({**ok, "errors": 1}) and failed({**ok, "token_count_mismatches": 2})
    assert failed({**ok, "kv_blocks_in_use_after": 3})
