"""`rt bench route --soak SECONDS`: `rt bench serve --soak` through the router.

`soak_backends` `rt serve --simulate` backends and one `rt route` in front of them start on
free ports of 127.0.0.1; `backends.bench.soak` holds `concurrency` streams through the router
for the duration (each request: `SOAK_INPUT_LEN` random prompt token ids, `max_tokens` output
tokens with ignore_eos, so every answer must carry exactly that many) and reports errors,
token-count mismatches, the router process's resident memory (before the load, after the
warm-up, the peak, the end: the growth is end against after the warm-up) and open file
descriptors, and the KV blocks in use on the backends after the last request (summed).

The router keeps up to 128 idle keep-alive connections per backend (`app._MAX_IDLE`), so its
descriptors at the end of the load exceed those before it by the pool; the backends close
idle connections after their keep-alive timeout (uvicorn's 5 s), and `settled` is the
router's descriptors once back at the idle count (or after `SETTLE_S`): flat means not above.
The router's exit code after SIGTERM is reported too (0: drained). Every wait is bounded;
every process is always stopped.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.bench.serve_load import free_port
from backends.bench.soak import SoakConfig, process_stats, run_soak
from backends.route.fleet import Replica, stop_all, wait_healthy

if TYPE_CHECKING:
    from backends.route.bench import RouteBenchConfig

SOAK_INPUT_LEN = 256  # prompt tokens per request (rt bench serve --soak's default)
VOCAB_SIZE = 32000  # prompt token ids are drawn below it (any llama's vocabulary is larger)
SETTLE_S = 15.0  # at most this long after the load for the descriptors to settle


def run_route_soak(config: RouteBenchConfig) -> dict[str, Any]:
    """The soak's report (see the module docstring)."""
    assert config.soak_s is not None
    (concurrency,) = config.concurrencies
    soak = SoakConfig(config.soak_s, concurrency, SOAK_INPUT_LEN, config.max_tokens,
                      VOCAB_SIZE, request_timeout_s=config.request_timeout_s)
    started: list[Replica] = []
    with tempfile.TemporaryDirectory(prefix="rt-bench-route-soak-") as logs:
        try:
            backends = [Replica(config.serve_command, free_port(), Path(logs))
                        for _ in range(config.soak_backends)]
            started += backends
            wait_healthy(backends, 180)
            urls = [a for b in backends for a in ("--backend", b.url)]
            router = Replica((*config.route_command, *urls), free_port(), Path(logs))
            started.append(router)
            wait_healthy([router], 60)
            report = run_soak(router.url, {"router": router.proc.pid}, soak,
                              [b.url for b in backends])
            stats = report["processes"]["router"]
            stats["settled"] = _settled(router.proc.pid, int(stats["idle"]["fds"]))
        finally:
            stop_all(list(reversed(started)), 30)  # the router first: it drains
    return {"command": "rt bench route --soak", **dict(config.about),
            "backends": config.soak_backends, **report,
            "router_exit_code": router.proc.returncode}


def _settled(pid: int, idle_fds: int) -> dict[str, float]:
    """The router's stats once its descriptors are back to `idle_fds` (the pool's idle
    connections closed by the backends), or after SETTLE_S; with the seconds it took."""
    start = time.monotonic()
    stats = process_stats(pid)
    while stats["fds"] > idle_fds and time.monotonic() < start + SETTLE_S:
        time.sleep(0.5)
        with contextlib.suppress(OSError):
            stats = process_stats(pid)
    return {**stats, "after_s": round(time.monotonic() - start, 1)}
