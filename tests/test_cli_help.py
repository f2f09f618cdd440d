"""The CLI's flag surface, pinned: every command's options (names, type, default, help) as JSON.

A refactor of cli.py must leave these snapshots equal; a deliberate change of a flag regenerates
them (`RT_UPDATE_HELP=1 pytest tests/test_cli_help.py`) and lists the change in its commit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

import cli

SNAPSHOTS = Path(__file__).parent / "fixtures" / "help"


def _commands(group: Any, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, command in sorted(group.commands.items()):
        path = (*prefix, name)
        if hasattr(command, "commands"):
            found.update(_commands(command, path))
        else:
            found[" ".join(path)] = command
    return found


def _surface(command: Any) -> dict[str, object]:
    params = []
    for param in command.params:
        default = param.default
        if not isinstance(default, (str, int, float, bool, type(None))):
            default = repr(default)
        params.append({
            "opts": list(param.opts) + list(param.secondary_opts),
            "kind": param.param_type_name,
            "type": repr(param.bare_type()),
            "required": param.required,
            "multiple": param.multiple,
            "default": default,
            "help": getattr(param, "help", None),
            "panel": getattr(param, "rich_help_panel", None),
        })
    params.sort(key=lambda p: p["opts"])
    return {"help": command.help, "params": params}


ROOT = typer.main.get_command(cli.app)
COMMANDS = _commands(ROOT)


def test_every_command_has_a_snapshot() -> None:
    names = {path.stem.replace("_", " ") for path in SNAPSHOTS.glob("*.json")}
    if os.environ.get("RT_UPDATE_HELP"):
        return
    assert names == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_flag_surface_unchanged(name: str) -> None:
    path = SNAPSHOTS / f"{name.replace(' ', '_')}.json"
    surface = _surface(COMMANDS[name])
    text = json.dumps(surface, indent=1, sort_keys=True, default=str) + "\n"
    if os.environ.get("RT_UPDATE_HELP"):
        path.write_text(text)
    assert json.loads(path.read_text()) == json.loads(text)


def _rendered(*args: str) -> list[str]:
    """`rt ARGS --help` as typer prints it on a 200-column terminal, one string per line."""
    result = CliRunner().invoke(cli.app, [*args, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def _line_with(lines: list[str], text: str) -> str:
    return next((line for line in lines if text in line), f"no line has {text!r}")


def test_a_help_paragraph_is_wrapped_by_the_terminal_not_by_the_source() -> None:
    # The source wraps help at ~90 columns; rich kept those breaks, so `rt --help` broke the
    # simulate entry after "with" at any width.
    summary = _line_with(_rendered(), "simulate   Simulate")
    assert "with --replicas N or --fleet FILE, a fleet of such engines behind a router." in summary
    described = _line_with(_rendered("simulate"), "Prints vLLM's start-up lines")
    assert "then where the time went. TPOT" in described


@pytest.mark.parametrize(("args", "text"), [
    (("sweep",), "pip install 'rt[ray]'"),
    (("plan",), "pip install 'rt[ray]'"),
    (("bench", "route"), "Closed-loop streams (repeat) [default: 1 and 200; --soak: 200]."),
    (("bench", "gpu"), "transformers' static batch size [default: as many as rt runs at once]"),
])
def test_square_brackets_in_help_are_printed_not_read_as_markup(args: tuple[str, ...],
                                                                 text: str) -> None:
    assert text in _line_with(_rendered(*args), text.split(" [")[0].split(" '")[0])


def test_fleet_up_says_what_its_replicas_and_model_are() -> None:
    """badinput23b: --replicas said "(1: the single-engine simulator)", wrong for `rt fleet
    up` (one `rt serve` behind `rt route`), and --model, the replicas', sat in the Router
    panel."""
    params = {p["opts"][0]: p for p in _surface(COMMANDS["fleet up"])["params"]}
    assert "single-engine simulator" not in params["--replicas"]["help"].split("rt simulate")[0]
    assert params["--model"]["panel"] == params["--simulate"]["panel"] == "Server"
