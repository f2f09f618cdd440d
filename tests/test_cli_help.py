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
