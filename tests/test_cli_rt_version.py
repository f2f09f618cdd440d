"""cli.py names rt's version once (`analysis.rundir.rt_version`: the installed version, else
the checkout's pyproject.toml) and hands it down: `rt serve`'s /version (`ServeConfig`) and
the profile `rt fidelity --endpoint` fits (`EndpointFidelityPlan`). Before, both looked up
the installed version themselves, and a plain checkout on PYTHONPATH (as on the lent GPU)
served "unknown" where its run.json said the checkout's. Here `rt_version` answers a value
no lookup gives, so a layer that asks for itself fails; nothing is served or replayed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import cli
from analysis import rundir
from workloads import ArrivalProcess, write_rt_jsonl
from workloads.synthetic import RandomLengths, random_trace

VERSION = "0.0.0+cli"


@pytest.fixture(autouse=True)
def _version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rundir, "rt_version", lambda: VERSION)


def test_rt_serve_passes_its_version_to_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.serve import api_server

    started: list[Any] = []

    def run_server(config: Any, sock: Any, *_: object) -> None:  # not served
        sock.close()
        started.append(config)

    monkeypatch.setattr(api_server, "run_server", run_server)
    result = CliRunner().invoke(cli.app, ["serve", "--simulate", "--port", "0"])
    assert result.exit_code == 0, (result.exception, result.output)
    assert [config.rt_version for config in started] == [VERSION]


def test_rt_fidelity_endpoint_passes_its_version_to_the_fit(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from sim import endpoint_fidelity

    plans: list[Any] = []

    def stop(trace: object, engine: object, plan: Any, *_: object) -> None:
        plans.append(plan)
        raise ValueError("stopped before any replay")

    monkeypatch.setattr(endpoint_fidelity, "endpoint_fidelity", stop)
    trace = tmp_path / "trace.jsonl"
    write_rt_jsonl(random_trace(4, RandomLengths(20, 4, 0.5), ArrivalProcess(2.0, 1.0, 1)),
                   trace)
    result = CliRunner().invoke(cli.app, ["fidelity", str(trace), "--endpoint",
                                          "http://127.0.0.1:9", "--result-dir",
                                          str(tmp_path / "out"), "--no-plots"])
    assert result.exit_code == 2, (result.exception, result.output)
    assert result.stderr == "rt: error: stopped before any replay\n"
    assert [plan.rt_version for plan in plans] == [VERSION]
