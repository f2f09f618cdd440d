"""`backends.replay.endpoint_run.EndpointRun`: what `rt replay --endpoint` says after a
run, and its exit code (failures counted: 0; every request failed: 1; Ctrl-C: 130)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("httpx")

from backends.replay.endpoint_run import INTERRUPTED, EndpointRun  # noqa: E402


def _run(statuses: list[str], errors: dict[str, str], interrupted: bool = False) -> Any:
    requests = [SimpleNamespace(status=s) for s in statuses]
    result = SimpleNamespace(requests=requests, errors=errors, wall_s=2.0,
                             interrupted=interrupted,
                             num_failed=sum(s == "FINISHED_ABORTED" for s in statuses))
    return EndpointRun(result, None, None)  # type: ignore[arg-type]


def test_failures_are_counted_and_exit_zero() -> None:
    run = _run(["FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED"], {"r1": "HTTP 500"})
    assert run.answered and run.exit_code == 0
    assert run.messages(Path("out")) == [
        "note: 1 of 2 requests failed (first: r1: HTTP 500); messages in out/run.json",
        "wrote out (2 requests, client-side timing, 2.00 s wall)"]


def test_every_request_failing_exits_one_and_ctrl_c_130() -> None:
    run = _run(["FINISHED_ABORTED"], {"r0": "boom"})
    assert not run.answered and run.exit_code == 1
    assert run.messages(Path("o"))[-1] == "every request failed (boom)"
    cut = _run(["FINISHED_ABORTED"], {"r0": "interrupted"}, interrupted=True)
    assert cut.exit_code == 130 and cut.messages(Path("o"))[-1] == INTERRUPTED
