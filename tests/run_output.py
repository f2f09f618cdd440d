"""A run's output that records what it is handed (`backends.replay.run_output.RunOutput`,
`sim.fleet_run.SimOutput`): each call as (name, arguments); `exit` raises `Exited`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn


class Exited(Exception):
    """`Recorder.exit` was called (its code is the last call recorded)."""


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    @contextlib.contextmanager
    def progress(self, label: str, total: int | None = None
                 ) -> Iterator[Callable[[int, int], None]]:
        self.calls.append(("progress", (label, total)))
        yield lambda done, of: None

    def save(self, *args: Any, **extra: Any) -> None:
        self.calls.append(("save", (*args, extra)))

    def write(self, *args: Any) -> None:
        self.calls.append(("write", args))

    def show(self, *args: Any) -> None:
        self.calls.append(("show", args))

    def show_simulated(self, *args: Any) -> None:
        self.calls.append(("show_simulated", args))

    def say(self, line: str) -> None:
        self.calls.append(("say", line))

    def tell(self, line: str) -> None:
        self.calls.append(("tell", line))

    def exit(self, code: int) -> NoReturn:
        self.calls.append(("exit", code))
        raise Exited
