"""`cli.with_flags`: the options of a command's flag groups, where they are listed, and the
dataclasses the command is called with."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from cli import with_flags
from runtime.flags import FlagGroup, flag


@dataclass(frozen=True)
class _Shared:
    seed: int = flag(0, "--seed", "Seed.")
    size: int = flag(1, "--size", "Size.", min=1)


@dataclass(frozen=True)
class _Own:
    out: str = flag("x", "--out", "Where.")


def test_own_and_inline_options_first_in_signature_order_then_groups() -> None:
    seen: dict[str, Any] = {}

    @with_flags
    def command(shared: Annotated[_Shared, FlagGroup()],
                first: Annotated[int, typer.Option("--first")] = 1,
                own: Annotated[_Own, FlagGroup(inline=True)] = _Own(),
                last: Annotated[bool, typer.Option("--last")] = False) -> None:
        seen.update(shared=shared, first=first, own=own, last=last)

    names = list(inspect.signature(command).parameters)
    assert names == ["first", "out", "last", "seed", "size"]
    command(first=2, out="y", last=True, seed=5, size=3)
    assert seen == {"shared": _Shared(5, 3), "first": 2, "own": _Own("y"), "last": True}
