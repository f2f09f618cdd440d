"""`run_fleet_fidelity`'s paths (`rt fidelity --fleet`) with the processes and the replays
stubbed: Ctrl-C in any replay, a router or replica that fails, progress bars, what is saved.
No process, no clock."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.run_output import Exited, Recorder

pytest.importorskip("prometheus_client")

from backends.replay.run_output import INTERRUPTED  # noqa: E402
from workloads import Trace, TraceRequest  # noqa: E402


def _stub_replicas(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    from backends.route import fleet_fidelity as ff

    @contextlib.contextmanager
    def replicas(plan: Any) -> Iterator[tuple[list[str], Path]]:
        events.append("replicas up")
        try:
            yield ["http://r1"], Path("logs")
        finally:
            events.append("replicas stopped")

    monkeypatch.setattr(ff, "running_replicas", replicas)


def _stub_replays(monkeypatch: pytest.MonkeyPatch, events: list[str], cut: int | None
                  ) -> None:
    """Each replay returns one finished request; replay number `cut` (1: calibration) is
    cut short by Ctrl-C (`interrupted`)."""
    from backends.route import fleet_fidelity as ff

    def once(plan: Any, trace: Trace, backends: list[str], logs: Path, token_seed: int,
             progress: Any) -> tuple[Any, dict[str, Any], Any]:
        events.append(f"replay {token_seed}")
        record = SimpleNamespace(request_id=trace[0].request_id, arrival_s=0.0,
                                 first_token_s=0.01)
        result = SimpleNamespace(requests=[record], errors={}, num_failed=0,
                                 interrupted=len([e for e in events if "replay" in e]) == cut)
        return result, {"router": {}}, ff.RouterOverheads.__new__(ff.RouterOverheads)

    monkeypatch.setattr(ff, "_replay_once", once)
    monkeypatch.setattr(ff, "asdict", lambda o: {})


def _run(tmp_path: Path, recorder: Recorder, events: list[str]) -> str:
    from backends.route import fleet_fidelity as ff

    plan = ff.FleetFidelityPlan(("serve",), ("route",), (1, 2), {"seed": 7})
    trace = Trace(tuple(TraceRequest(str(i), i * 0.1, 16, 4) for i in range(4)), "t")

    def simulate(overheads: Any, calibration: Any) -> tuple[Any, dict[str, Any]]:
        events.append("simulate")
        return "sim result", {}

    return ff.run_fleet_fidelity(plan, trace, tmp_path, recorder, simulate,
                                 lambda *a: "compared")


@pytest.mark.parametrize(("cut", "saved"), [
    (1, ["calibration"]), (2, ["calibration", "real"]),
    (3, ["calibration", "real", "calibration-after"])])
def test_ctrl_c_in_a_replay_saves_what_exists_and_exits_130(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cut: int, saved: list[str]) -> None:
    """Ctrl-C in a replay starts no later one (nor the twin); in any replay (the
    calibration window before, the measured one, the window after), the replays so far are
    written, every process is stopped, exit 130 (as `rt replay --endpoint`)."""
    events: list[str] = []
    recorder = Recorder()
    _stub_replicas(monkeypatch, events)
    _stub_replays(monkeypatch, events, cut)
    with pytest.raises(Exited):
        _run(tmp_path, recorder, events)
    assert events == ["replicas up", *["replay 8", "replay 7", "replay 9"][:cut],
                      "replicas stopped"]
    assert [Path(c[1][0]).name for c in recorder.calls if c[0] == "save"] == saved
    assert recorder.calls[-2:] == [("say", INTERRUPTED), ("exit", 130)]


@pytest.mark.parametrize(("failing", "saved"), [
    (1, []), (2, ["calibration"]), (3, ["calibration", "real"])])
def test_a_replay_whose_router_fails_keeps_the_replays_before_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, failing: int, saved: list[str]
        ) -> None:
    """A router that does not come up for replay `failing` (the window after included)
    starts no later replay; the replays finished before it are written, then one line."""
    from backends.route import fleet_fidelity as ff

    events: list[str] = []
    recorder = Recorder()
    _stub_replicas(monkeypatch, events)
    _stub_replays(monkeypatch, events, None)
    finished = ff._replay_once

    def once(*args: Any) -> Any:
        if len([e for e in events if "replay" in e]) + 1 == failing:
            raise RuntimeError("rt route did not come up on 127.0.0.1:9")
        return finished(*args)

    monkeypatch.setattr(ff, "_replay_once", once)
    with pytest.raises(ValueError, match=r"^the real fleet: rt route did not come up on "
                                         r"127\.0\.0\.1:9$"):
        _run(tmp_path, recorder, events)
    assert [Path(c[1][0]).name for c in recorder.calls if c[0] == "save"] == saved
    assert events[-1] == "replicas stopped" and "simulate" not in events


def test_each_replay_has_its_own_progress_bar_and_every_run_is_saved(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    events: list[str] = []
    recorder = Recorder()
    _stub_replicas(monkeypatch, events)
    _stub_replays(monkeypatch, events, None)
    assert _run(tmp_path, recorder, events) == "compared"
    assert [c[1] for c in recorder.calls if c[0] == "progress"] == [
        ("calibration replay (before) through the router", 2),
        ("real replay through the router", 4),
        ("calibration replay (after) through the router", 2)]
    assert [Path(c[1][0]).name for c in recorder.calls if c[0] == "save"] == [
        "calibration", "real", "calibration-after", "sim"]
    assert events == ["replicas up", "replay 8", "replay 7", "replay 9", "replicas stopped",
                      "simulate"]


def test_a_replica_down_does_not_lose_the_replay(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """A replica that dies mid-replay: the router takes it out and its requests count as
    failed; its /metrics cannot be read after the replay, so the TTFT split is unknown
    (null in run.json, the replica named), not the whole run lost."""

    @contextlib.contextmanager
    def router(plan: Any, backends: list[str], logs: Path) -> Iterator[str]:
        yield "http://router"

    result = SimpleNamespace(requests=[], errors={}, wall_s=1.0)
    scrapes: list[str] = []

    def get(url: str) -> httpx.Response:
        scrapes.append(url)
        if url.startswith("http://r2") and len(scrapes) > 2:  # r2 died during the replay
            raise httpx.ConnectError("[Errno 111] Connection refused")
        return httpx.Response(200, text="", request=httpx.Request("GET", url))

    _, fields, _ = _replay_once_with(monkeypatch, tmp_path, router, result, get)
    split = fields["router"]["ttft_split"]
    assert split["engine_mean_ms"] is None and split["api_ipc_mean_ms"] is None
    assert fields["router"]["ttft_split_not_measured"].startswith("http://r2/metrics: ")
    json.dumps(split, allow_nan=False)  # no NaN in run.json: null


def _replay_once_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, router: Any,
                      result: Any, get: Callable[[str], httpx.Response]) -> Any:
    """`_replay_once` on two replicas with the fleet's processes, the replay and the
    scrapes (`own_get`) replaced: `router` yields the router's URL, `result` is the replay."""
    from backends.route import fleet_fidelity as ff

    monkeypatch.setattr(ff, "running_router", router)
    monkeypatch.setattr(ff, "probe", lambda config: None)
    monkeypatch.setattr(ff, "replay_endpoint", lambda *a: result)
    monkeypatch.setattr(ff, "run_info", lambda *a: {"wall_s": 1.0})
    monkeypatch.setattr(ff, "own_get", get)  # its GETs of the fleet
    plan = ff.FleetFidelityPlan(("serve",), ("route",), (1, 2, 3), {"seed": 0})
    return ff._replay_once(plan, Trace((), "t"), ["http://r1", "http://r2"], tmp_path, 0, None)


@pytest.mark.parametrize("failure", ["refused", "status 500", "not Prometheus"])
def test_a_router_whose_metrics_cannot_be_read_does_not_end_the_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, failure: str) -> None:
    """The replay is kept; the router's overheads are NaN (null in run.json), the failure
    named there and said when the run is saved."""
    from backends.route import fleet_fidelity as ff

    @contextlib.contextmanager
    def router(plan: Any, backends: list[str], logs: Path) -> Iterator[str]:
        yield "http://router"

    result = SimpleNamespace(requests=[], errors={}, wall_s=1.0)

    def get(url: str) -> httpx.Response:
        request = httpx.Request("GET", url)
        if url.startswith("http://router") and failure == "refused":
            raise httpx.ConnectError("[Errno 111] Connection refused")
        if url.startswith("http://router") and failure == "status 500":
            return httpx.Response(500, request=request)
        text = "this is { not metrics" if url.startswith("http://router") else ""
        return httpx.Response(200, text=text, request=request)

    got, fields, overheads = _replay_once_with(monkeypatch, tmp_path, router, result, get)
    assert got is result
    assert math.isnan(overheads.routing_latency_mean_s) and len(overheads.requests) == 2
    assert fields["router"]["overheads_not_measured"].startswith("http://router/metrics: ")
    assert fields["router"]["overheads"]["requests"] == [None, None]
    json.dumps(fields["router"], allow_nan=False)  # no NaN in run.json: null
    recorder = Recorder()
    ff._save(recorder, tmp_path, "real", Trace((), "t"), result, fields)
    said = [c[1] for c in recorder.calls if c[0] == "say"]
    assert said and "the router's overheads are not measured" in said[-1]
