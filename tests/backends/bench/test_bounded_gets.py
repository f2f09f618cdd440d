"""GETs of rt's own replicas' /metrics and /health (fleet fidelity, `rt bench serve`, the
soak) bounded in all, as the endpoint probe's (ef5808d): a replica that sends its headers,
then a byte a second, once held them forever (httpx's read timeout restarts per byte)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")

from backends.bench import serve_load, soak  # noqa: E402
from backends.replay import endpoint_probe  # noqa: E402
from backends.route import fleet_fidelity  # noqa: E402
from tests.backends.drip_server import DRIP_FOR_S, dripping_server  # noqa: E402


@pytest.fixture
def dripping() -> Iterator[str]:
    """A replica's URL that answers 200, then one byte of body every 0.1 s (for 20 s)."""
    with dripping_server(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                         b"x-engine-pid: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
                         b"1\r\n#\r\n", 0.1) as url:
        yield url


def _fleet_totals(url: str) -> object:
    failed: list[str] = []
    fleet_fidelity._server_totals([url], failed)
    assert failed and "no complete answer" in failed[0], failed
    return failed


def _router(url: str) -> object:
    _, failure = fleet_fidelity._router_overheads(url, ["b"])
    assert failure is not None and "no complete answer" in failure, failure
    return failure


def _counters(url: str) -> object:
    return serve_load.ServerProcess.counters(SimpleNamespace(url=url))  # type: ignore[arg-type]


def _pid(url: str) -> object:
    return serve_load.ServerProcess.engine_pid(SimpleNamespace(url=url))  # type: ignore[arg-type]


def _kv(url: str) -> object:
    return soak._kv_after(url)


@pytest.mark.parametrize("get", [_fleet_totals, _router, _counters, _pid, _kv])
def test_a_dripping_replica_is_bounded_in_all(monkeypatch: pytest.MonkeyPatch, dripping: str,
                                              get: Callable[[str], object]) -> None:
    monkeypatch.setattr(endpoint_probe, "OWN_SERVER_TIMEOUT_S", 0.5)
    start = time.monotonic()
    with contextlib.suppress(httpx.ReadTimeout):
        get(dripping)
    # bounded at 0.5 s; a GET bounded per read only would wait out the 20 s drip
    assert time.monotonic() - start < DRIP_FOR_S / 2
