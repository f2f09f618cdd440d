"""cli.py's one-line errors around serving loops (`user_errors(RuntimeError, only=True)`):
`rt serve` and `rt route` turn a bad config into one line (exit 2) before serving, and while
serving only a RuntimeError (the engine died, the port cannot be bound); a ValueError or
OSError raised while serving is a bug and keeps its traceback. The servers are stubbed."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

import cli

BUG = ValueError("a bug while serving")


def _serving_raises(monkeypatch: pytest.MonkeyPatch, raised: Exception) -> None:
    from backends import listen
    from backends.route import app as route_app
    from backends.route import config as route_config
    from backends.serve import api_server
    from sim import live_executor

    def serve(*args: object) -> None:
        raise raised

    monkeypatch.setattr(route_config, "router_config", lambda *a: SimpleNamespace(
        policy="round-robin", backends=("http://b",)))
    monkeypatch.setattr(route_app, "run_router", serve)
    monkeypatch.setattr(live_executor, "live_executor_spec", lambda *a: ())
    monkeypatch.setattr(api_server.ServeConfig, "of", lambda *a, **k: SimpleNamespace(
        model_name="m"))
    monkeypatch.setattr(api_server, "http_stack", lambda: SimpleNamespace(
        describe=lambda: "stub"))
    monkeypatch.setattr(api_server, "run_server", serve)
    monkeypatch.setattr(api_server, "listening_socket", lambda *a: SimpleNamespace(
        getsockname=lambda: ("127.0.0.1", 8000)))  # no real port taken
    monkeypatch.setattr(listen, "listening_socket", lambda *a: contextlib.nullcontext(
        SimpleNamespace(getsockname=lambda: ("127.0.0.1", 8000))))  # the router's


COMMANDS = [["route", "--backend", "http://b"], ["serve", "--simulate"]]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_runtime_error_while_serving_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                    command: list[str]) -> None:
    _serving_raises(monkeypatch, RuntimeError("cannot bind 127.0.0.1:8000"))
    result = CliRunner().invoke(cli.app, command)
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == "rt: error: cannot bind 127.0.0.1:8000"


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("raised", [BUG, OSError("no filename")])
def test_another_error_while_serving_is_not_a_user_error(
        monkeypatch: pytest.MonkeyPatch, command: list[str], raised: Exception) -> None:
    _serving_raises(monkeypatch, raised)
    result = CliRunner().invoke(cli.app, command)
    assert result.exit_code == 1 and result.exception is raised
    assert "rt: error" not in result.stderr


def test_a_bad_router_config_is_one_line_before_serving(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    from backends.route import config as route_config

    _serving_raises(monkeypatch, AssertionError("served"))
    monkeypatch.setattr(route_config, "router_config", lambda *a: (_ for _ in ()).throw(
        ValueError("backend http://b is unreachable")))
    result = CliRunner().invoke(cli.app, ["route", "--backend", "http://b"])
    assert result.exit_code == 2
    assert result.stderr == "rt: error: backend http://b is unreachable\n"


def test_an_os_error_is_one_line_with_its_file_name_when_it_has_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit), cli.user_errors():
        raise OSError("disk full")  # no file name: not "None: ..."
    with pytest.raises(typer.Exit), cli.user_errors():
        open("/nonexistent/trace.jsonl")
    assert capsys.readouterr().err == ("rt: error: disk full\n"
                                       "rt: error: /nonexistent/trace.jsonl: No such file or "
                                       "directory\n")


def test_fidelity_fleet_without_the_serve_extra_is_one_line(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from workloads import Trace, TraceRequest, write_rt_jsonl

    trace = tmp_path / "t.jsonl"
    write_rt_jsonl(Trace((TraceRequest("a", 0.0, 16, 4),), "t"), trace)
    monkeypatch.setitem(sys.modules, "httpx", None)  # not installed
    monkeypatch.delitem(sys.modules, "backends.route.fleet_fidelity", raising=False)
    result = CliRunner().invoke(cli.app, ["fidelity", str(trace), "--fleet",
                                          "--result-dir", str(tmp_path / "out")])
    assert result.exit_code == 2, result.exception
    assert result.stderr == "rt: error: --fleet needs httpx: pip install 'rt[serve]'\n"


def test_fidelity_fleet_says_where_it_wrote(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    from backends.route import fleet_fidelity
    from workloads import Trace, TraceRequest, write_rt_jsonl

    trace = tmp_path / "t.jsonl"
    write_rt_jsonl(Trace((TraceRequest("a", 0.0, 16, 4),), "t"), trace)
    monkeypatch.setattr(fleet_fidelity, "fleet_fidelity_plan", lambda *a: None)
    monkeypatch.setattr(fleet_fidelity, "run_fleet_fidelity", lambda *a: "the comparison")
    out = tmp_path / "out"
    result = CliRunner().invoke(cli.app, ["fidelity", str(trace), "--fleet",
                                          "--result-dir", str(out)])
    assert result.exit_code == 0, result.exception
    assert result.stdout == "the comparison\n"
    assert result.stderr == f"rt: wrote {out / 'fleet_fidelity.json'}\n"
