"""`stream_path.unless_client_leaves`: a non-streaming answer is gathered until the client
disconnects; then the gathering is cancelled (which aborts the request in the engine) and
ClientGone raised. A fake ASGI `receive` and a gathering coroutine that records its
cancellation; no server (test_faults.py runs the same through `rt serve --simulate`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("starlette")

from backends.serve.stream_path import ClientGone, unless_client_leaves  # noqa: E402


class _Gathering:
    """Stands for `Server.complete`: returns "text" once `ready` is set; `cancelled` records
    the cancellation that aborts the request."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.cancelled = False

    async def run(self) -> str:
        try:
            await self.ready.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return "text"


def _receive(leave: asyncio.Event) -> Any:
    async def receive() -> dict[str, Any]:
        await leave.wait()
        return {"type": "http.disconnect"}
    return receive


def test_the_answer_when_it_is_ready_first() -> None:
    async def main() -> tuple[str, bool]:
        work, leave = _Gathering(), asyncio.Event()
        work.ready.set()
        return await unless_client_leaves(work.run(), _receive(leave)), work.cancelled

    assert asyncio.run(main()) == ("text", False)


def test_a_disconnect_first_cancels_the_gathering() -> None:
    async def main() -> bool:
        work, leave = _Gathering(), asyncio.Event()
        leave.set()
        with pytest.raises(ClientGone):
            await unless_client_leaves(work.run(), _receive(leave))
        return work.cancelled

    assert asyncio.run(main()) is True


def test_a_cancelled_caller_cancels_the_gathering_too() -> None:
    """A shutdown cancels the handler: its request must be aborted as before."""
    async def main() -> bool:
        work, leave = _Gathering(), asyncio.Event()
        caller = asyncio.ensure_future(unless_client_leaves(work.run(), _receive(leave)))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0)  # the gathering handles its cancellation
        return work.cancelled

    assert asyncio.run(main()) is True
