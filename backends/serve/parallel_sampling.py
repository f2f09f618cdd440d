"""Parallel sampling: a request with `n` > 1 served as n engine requests, as vLLM V1's front
end does it (vllm/v1/engine/parallel_sampling.py `ParentRequest`, async_llm.add_request).

The API server fans the request out into n children with request ids `f"{index}_{parent}"`,
each `n` = 1 and, when the request has a seed, seed + index (so child i samples exactly as a
plain request with that seed). The engine runs them as independent requests (the prefix
cache shares the prompt once a child's blocks are computed). Their outputs come back on one
queue, the parent's, and are merged here:

- non-streaming: `choices` in index order 0..n-1, each with its own text, `finish_reason`
  and `stop_reason`;
- streaming: each chunk names its choice's `index`; the chat stream opens with one role
  chunk per choice (vLLM 0.32's chat_completion_stream_generator, `for i in range(
  num_choices)` on the first output); `continuous_usage_stats` counts the chunk's own choice;
- `usage`: the prompt counted once, `completion_tokens` the sum over the children.

Each child keeps its own decoder and stop strings (a stop string ends only its child); a
disconnect aborts every child still running. Metrics: every child is a request of its own
(`vllm:request_success`, the latency and token histograms), while `vllm:request_params_n`
and `vllm:request_max_num_generation_tokens` observe the parent once, when its last child
finishes (ParentRequest.observe_finished_request; not after an abort).

The drivers (`fan_out`, `complete_all`, `stream_all`) run a parent's children through the
server's bookkeeping, which they reach only through `ChildHost` (`server.Server` is one): the
places awaiting a first output, a child sent and tracked, an output's handling, a child
forgotten.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol

from backends.engine.sampling_options import SamplingOptions
from backends.serve import sse
from backends.serve.api_error import ApiError
from backends.serve.engine_client import OutputQueue
from backends.serve.responses import (
    answer_id,
    choice_body,
    chunk_object,
    response_body,
    usage_body,
)
from backends.serve.stream_path import EventStream, Last

if TYPE_CHECKING:
    from backends.serve.messages import RequestOutput
    from backends.serve.openai_protocol import Parsed
    from backends.serve.request_state import RequestState

# Children `fan_out` submits between two yields to the event loop. A child costs ~5-10 us
# (encoded, posted to the engine, tracked): n = 16384, the accepted maximum, took 83-92 ms
# in process and 120-170 ms on `--simulate` (issue #18 saw ~1.2 s, ~73 us each), all of it
# one piece of the loop, during which no other stream got a byte. 64 children hold the loop
# 0.3-0.7 ms (~4.7 ms at issue #18's cost), below one engine step (24 ms on the H200
# profile), and the 255 yields of n = 16384 cost ~1% (82.6 -> 83.6 ms in process).
FAN_OUT_CHUNK = 64


def child_request_id(index: int, parent_id: str) -> str:
    """Child `index`'s engine request id (vLLM's `get_child_info`)."""
    return f"{index}_{parent_id}"


def child_sampling(options: SamplingOptions, index: int) -> SamplingOptions:
    """Child `index`'s sampling options: the parent's, with seed + index when seeded."""
    if options.seed is None:
        return options
    return dataclasses.replace(options, seed=options.seed + index)


class ChildHost(Protocol):
    """What the drivers need from the server that tracks the requests in flight."""

    def hold_places(self, n: int) -> None:
        """Admit `n` requests at once (EngineDeadError, or ApiError 503 past the queue
        limit) and take their n places among those awaiting a first output."""

    def free_places(self, n: int) -> None:
        """Give back `n` places `hold_places` took that no child filled."""

    def add_child(self, request_id: str, parsed: Parsed, sampling: SamplingOptions,
                  arrival_s: float, queue: OutputQueue) -> RequestState:
        """Send a child (outputs to `queue`) and track it in a place held for it."""

    def step(self, gen: RequestState, item: RequestOutput) -> tuple[str, RequestOutput]:
        """`item`'s text delta and the output as the client sees it (its end recorded)."""

    def forget(self, gen: RequestState, abort: bool) -> None:
        """Let go of a request (`abort`: in the engine too); nothing if already let go."""


class ParentRequest:
    """One API request's n children (index order) and the merge of their outputs.

    Invariants: `children[i].request_id == child_request_id(i, request_id)`, every child
    reads `queue`, and a finished child is never routed another output."""

    __slots__ = ("request_id", "children", "queue", "_index", "_unfinished", "first_cached",
                 "last_cached")

    def __init__(self, request_id: str, children: list[RequestState], queue: OutputQueue
                 ) -> None:
        if len(children) < 2:
            raise ValueError(f"a parent request has n >= 2 children, got {len(children)}")
        ids = [child_request_id(i, request_id) for i in range(len(children))]
        if [child.request_id for child in children] != ids:
            raise ValueError(f"children of {request_id} must be {ids[0]}..{ids[-1]} in order")
        if any(child.queue is not queue for child in children):
            raise ValueError("every child reads the parent's queue")
        self.request_id = request_id
        self.children = children
        self.queue = queue
        self._index = {child_id: i for i, child_id in enumerate(ids)}
        self._unfinished = len(children)  # children without their finish reason yet
        # prompt tokens found in the prefix cache, as vLLM's usage reports them: a stream
        # the first output's, a whole response the last child's to finish
        self.first_cached: int | None = None
        self.last_cached = 0

    @property
    def n(self) -> int:
        return len(self.children)

    @property
    def finished(self) -> bool:
        """Every child has its finish reason (O(1): checked once per output)."""
        return self._unfinished == 0

    def route(self, out: RequestOutput) -> tuple[int, RequestState] | None:
        """The (index, child) `out` belongs to; None for a child already finished (outputs
        the engine sent before a stop string's abort reached it)."""
        index = self._index[out.request_id]
        child = self.children[index]
        if child.finish_reason is not None:
            return None
        if self.first_cached is None:
            self.first_cached = out.num_cached_tokens
        return index, child

    def on_child_finished(self, child: RequestState) -> tuple[int, int] | None:
        """A child finished (not aborted): (n, the most tokens a child generated) once the
        last one has, for `vllm:request_params_n` and
        `vllm:request_max_num_generation_tokens`; None before."""
        assert child.finish_reason is not None and child.parent is self, "a child's end"
        self.last_cached = child.cached
        self._unfinished -= 1
        if self._unfinished:
            return None
        assert all(c.finish_reason is not None for c in self.children), "each ends once"
        return self.n, max(c.output_len for c in self.children)

    @property
    def num_completion_tokens(self) -> int:
        """The tokens of every child so far."""
        return sum(child.output_len for child in self.children)

    def usage(self, cached: int) -> dict[str, Any]:
        """The request's usage: the prompt once, the children's tokens summed."""
        return usage_body(len(self.children[0].parsed.prompt_ids),
                          self.num_completion_tokens, cached)

    def response(self, texts: list[str], model: str, chat: bool, created: int
                 ) -> dict[str, Any]:
        """The non-streaming body: one choice per child, in index order."""
        assert len(texts) == self.n and self.finished, "every child answers once"
        choices = [choice_body(index, text, child.finish_reason, child.stop_reason, chat)
                   for index, (child, text) in enumerate(zip(self.children, texts,
                                                                strict=True))]
        return response_body(self.request_id, chat, created, model, choices,
                             self.usage(self.last_cached))


# ---- the drivers --------------------------------------------------------------------------


async def fan_out(host: ChildHost, parsed: Parsed, arrival_s: float) -> ParentRequest:
    """A request with `n` > 1 as n child requests on one queue.

    Admission is checked once for all n, and their n places are held from then on (a
    request admitted while this yields sees them taken). Yields to the event loop every
    `FAN_OUT_CHUNK` children, as vLLM's front end awaits between them, so other streams
    keep flowing; cancelled or failed part-way (client gone, shutdown, engine dead), every
    child already sent is aborted and forgotten, and the places left released."""
    n = parsed.n
    host.hold_places(n)  # `add_child` fills them
    # 32 random hex digits, as uuid4().hex (vLLM's random_uuid) without building a UUID
    request_id = os.urandom(16).hex()
    queue = OutputQueue()
    children: list[RequestState] = []
    try:
        for index in range(n):
            if index and index % FAN_OUT_CHUNK == 0:
                await asyncio.sleep(0)
            children.append(host.add_child(child_request_id(index, request_id), parsed,
                                           child_sampling(parsed.sampling, index), arrival_s,
                                           queue))
    except BaseException:
        host.free_places(n - len(children))  # the places of children never sent
        for child in children:
            host.forget(child, abort=True)
        raise
    parent = ParentRequest(request_id, children, queue)
    for child in children:
        child.parent = parent
    return parent


def _next_child(host: ChildHost, parent: ParentRequest
                ) -> tuple[int, str, RequestOutput] | None:
    """(choice index, text delta, output) of the next output on `parent`'s queue, None for
    one of a child already finished; the error that ended them raised. Only when the queue
    is not empty."""
    item = parent.queue.get_nowait()
    if isinstance(item, Exception):
        for child in parent.children:
            host.forget(child, abort=False)
        raise item
    routed = parent.route(item)
    if routed is None:
        return None
    index, child = routed
    return (index, *host.step(child, item))


async def complete_all(host: ChildHost, parent: ParentRequest) -> list[str]:
    """Each child's text, in index order (non-streaming); aborts the children still running
    if the handler is cancelled."""
    parts: list[list[str]] = [[] for _ in parent.children]
    try:
        while not parent.finished:
            if parent.queue.empty():
                await parent.queue.wait()
            got = _next_child(host, parent)
            if got is not None:
                parts[got[0]].append(got[1])
    finally:
        _forget_all(host, parent)
    return ["".join(texts) for texts in parts]


def stream_all(host: ChildHost, parent: ParentRequest, model: str, chat: bool
               ) -> EventStream:
    """`server.Server.stream` for n choices: each chunk names its choice (vLLM 0.32's stream
    generators); the chat role chunks, one per choice, go out with the first output; a
    disconnect, or closing the stream before it starts, aborts every child still running."""
    return EventStream(_all_events(host, parent, model, chat),
                       functools.partial(_forget_all, host, parent))


def _forget_all(host: ChildHost, parent: ParentRequest) -> None:
    """`forget` every child (aborting those still running)."""
    for child in parent.children:
        host.forget(child, abort=True)


async def _all_events(host: ChildHost, parent: ParentRequest, model: str, chat: bool
                      ) -> AsyncGenerator[bytes, None]:
    rid, obj, created = answer_id(parent.request_id, chat), chunk_object(chat), \
        int(time.time())
    encoders = [sse.ChunkEncoder(rid, obj, created, model, chat, index)
                for index in range(parent.n)]
    parsed = parent.children[0].parsed
    first = chat
    last = b""  # the last chunk, held for the stream's one last write
    try:
        while not parent.finished:
            if parent.queue.empty():
                await parent.queue.wait()
            got = _next_child(host, parent)
            if got is None:
                continue
            index, text, out = got
            if first:
                head = encoders[0].head
                yield b"".join(sse.event(parent.children[0].role_chunk(head, i))
                               for i in range(parent.n))
                first = False
            counts = parent.children[index].usage() if parsed.continuous_usage else None
            last = encoders[index].chunk(text, out.finish_reason, out.stop_reason, counts)
            if not parent.finished:
                yield last
        usage = encoders[0].usage(len(parsed.prompt_ids), parent.num_completion_tokens,
                                  parent.first_cached or 0) if parsed.include_usage else b""
        yield Last(last + usage + sse.DONE)
    except ApiError as err:  # as `server.Server`'s streams: the error event, then [DONE]
        yield Last(sse.event(err.body()) + sse.DONE)
    finally:
        _forget_all(host, parent)
