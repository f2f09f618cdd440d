"""The API server's side of the engine-core process: start it, send requests and aborts over
ZeroMQ, route its per-step outputs to the streams that wait for them, watch its liveness."""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from backends.serve.api_error import EngineDeadError
from backends.serve.engine_process import run_engine_process
from backends.serve.executor import ExecutorFactory
from backends.serve.messages import (
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    RequestOutput,
    decode,
    encode,
)

_HEALTH_POLL_S = 0.2  # how often the engine process's liveness is checked


class OutputQueue:
    """One request's engine outputs (or the error that ends it), for its one reader:
    asyncio.Queue's `put_nowait`, `get_nowait`, `empty`, `qsize`, with less work per item
    (a deque and at most one waiting future; `wait` returns the future itself, no coroutine):
    at 200 streams every step puts and takes one item per stream."""

    __slots__ = ("_items", "_waiter", "fed")

    def __init__(self) -> None:
        self._items: collections.deque[RequestOutput | Exception] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self.fed = False  # an item was put (the request's first output is behind it)

    def put_nowait(self, item: RequestOutput | Exception) -> None:
        self.fed = True
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a reader cancelled (disconnected) left it cancelled
                waiter.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        """Done once an item is queued (at once if one is)."""
        waiter = asyncio.get_running_loop().create_future()
        if self._items:
            waiter.set_result(None)
        else:
            self._waiter = waiter
        return waiter

    def get_nowait(self) -> RequestOutput | Exception:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


class EngineClient:
    """The API server's side of the engine process: start it, send, route its outputs."""

    def __init__(self) -> None:
        self.context = zmq.asyncio.Context()
        self.tmpdir = tempfile.TemporaryDirectory(prefix="rt-serve-")
        self.input = self.context.socket(zmq.PUSH)
        self.output = self.context.socket(zmq.PULL)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.info: EngineInfo | None = None
        self.streams: dict[str, OutputQueue] = {}
        self.outgoing: asyncio.Queue[bytes] = asyncio.Queue()
        self.dead = False
        self.on_outputs: Callable[[EngineOutputs], None] = lambda _: None
        self.on_dead: Callable[[], None] = lambda: None
        self.tasks: list[asyncio.Task[None]] = []
        # `input` as a blocking-API socket (the same ZeroMQ socket) for `_post`'s sends
        self._direct: zmq.Socket[bytes] | None = None
        self._sending = False  # `_send` holds a message it has not handed to ZeroMQ yet

    async def start(self, factory: ExecutorFactory, kwargs: dict[str, Any],
                    timeout_s: float, estimate_perf: bool = False) -> EngineInfo:
        """Spawn the engine process and wait for its "ready" (RuntimeError if it fails);
        `estimate_perf`: its steps carry the MFU estimate (--enable-mfu-metrics)."""
        base = Path(self.tmpdir.name)
        in_addr, out_addr = f"ipc://{base / 'in'}", f"ipc://{base / 'out'}"
        self.input.bind(in_addr)
        self.output.bind(out_addr)
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=run_engine_process, name="rt-engine-core",
                                   args=(factory, kwargs, in_addr, out_addr, os.getpid(),
                                         estimate_perf),
                                   daemon=True)
        self.process.start()
        atexit.register(_kill_if_alive, self.process)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.output.poll(200):
                kind, payload = decode(await self.output.recv())
                if kind == "failed":
                    raise RuntimeError(f"the engine failed to start: {payload}")
                info: EngineInfo = payload  # engine_process sends ("ready", EngineInfo)
                self.info = info
                self._direct = zmq.Socket.shadow(self.input.underlying)
                self.tasks = [asyncio.create_task(self._route()),
                              asyncio.create_task(self._send()),
                              asyncio.create_task(self._watch())]
                return info
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited ({self.process.exitcode})")
        raise RuntimeError(f"the engine did not start within {timeout_s:g} s")

    def submit(self, request: EngineRequest, queue: OutputQueue | None = None) -> OutputQueue:
        """Send `request`; its outputs go to `queue` (a new one if None; the children of a
        request with `n` > 1 share their parent's)."""
        if self.dead:
            raise EngineDeadError()
        if queue is None:
            queue = OutputQueue()
        self.streams[request.request_id] = queue
        self._post(encode(("add", request)))
        return queue

    def abort(self, request_id: str) -> None:
        """Synchronous (safe in a `finally` of a cancelled task)."""
        if self.streams.pop(request_id, None) is not None and not self.dead:
            self._post(encode(("abort", [request_id])))

    def release(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def _post(self, data: bytes) -> None:
        """Send `data` to the engine now if the socket takes it without blocking and nothing
        sent earlier still waits (messages keep their order), else queue it for `_send`.
        At a closed loop's wave edge the API process admits ~200 requests in one event-loop
        turn; through the queue alone, the `_send` task ran only in the next turn and got
        one message out per turn (a turn is milliseconds of stream writes): API received ->
        handed to ZeroMQ was 36-317 ms at the median, now ~0.1 ms (load 13-16; docs/serve.md,
        "Admission at 200 streams")."""
        if self.outgoing.empty() and not self._sending and self._direct is not None:
            try:
                self._direct.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
        self.outgoing.put_nowait(data)

    async def _send(self) -> None:
        while True:
            data = await self.outgoing.get()
            self._sending = True
            try:
                await self.input.send(data)
            finally:
                self._sending = False

    async def _route(self) -> None:
        while True:
            kind, payload = decode(await self.output.recv())
            if kind != "outputs":
                continue
            self.on_outputs(payload)
            self.deliver(payload.outputs)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs into their streams' queues, first outputs first. A stream wakes
        (and writes its chunk) in the order its queue is fed, and the engine lists a step's
        new requests after the running ones: at 200 streams a first token waited behind up
        to ~200 chunk writes of decoding streams (several ms: time to first token the server
        adds). The rest keep the engine's order."""
        streams = self.streams
        later: list[tuple[OutputQueue, RequestOutput]] = []
        for out in outputs:
            queue = streams.get(out.request_id)
            if queue is None:
                continue
            if queue.fed:
                later.append((queue, out))
            else:
                queue.put_nowait(out)
        for queue, out in later:
            queue.put_nowait(out)

    async def _watch(self) -> None:
        """Fail every open request once the engine process is gone, then call `on_dead`."""
        assert self.process is not None
        while self.process.is_alive():
            await asyncio.sleep(_HEALTH_POLL_S)
        self.dead = True
        for queue in self.streams.values():
            queue.put_nowait(EngineDeadError())
        self.on_dead()

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Tell the engine to stop, wait for it, close the sockets."""
        for task in self.tasks:
            task.cancel()
        self._direct = None  # closed with `input` below
        process = self.process
        if process is not None and process.is_alive():
            # an engine that reads nothing (one that failed to start, a hung one) times out
            # here and is killed below
            with contextlib.suppress(zmq.ZMQError, TimeoutError):
                await asyncio.wait_for(self.input.send(encode(("shutdown", None))), 1.0)
            deadline = time.monotonic() + timeout_s
            while process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if process.is_alive():  # SIGTERM is ignored there (`run_engine_process`)
                process.kill()
                process.join(2.0)
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.context.term()
        self.tmpdir.cleanup()


def _kill_if_alive(process: multiprocessing.process.BaseProcess) -> None:
    """At interpreter exit, SIGKILL an engine process that `EngineClient.shutdown` did not
    stop (an exit path that skipped it). Registered after multiprocessing's own exit hook, so
    run before it (atexit is last in, first out): that hook SIGTERMs daemon children and then
    joins them without a timeout, and the engine ignores SIGTERM (`run_engine_process`), so
    the exiting server would wait for it forever."""
    if process.is_alive():
        process.kill()
        process.join(5.0)
