"""One request in flight in `rt serve`'s API process, as its handler sees it (vLLM's
`RequestState` of the output processor): its parsed body, its detokenizer, the queue the
engine's outputs arrive on, what it has produced so far and the engine's times of its first
output. `merge_queued` is vLLM's `RequestOutputCollector` in delta mode: outputs that queued
up while a stream was writing come out as one. Times are monotonic seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.engine.text import IncrementalDecoder
from backends.serve import sse
from backends.serve.engine_client import OutputQueue
from backends.serve.messages import RequestOutput
from backends.serve.openai_protocol import Parsed
from backends.serve.responses import usage_body
from backends.serve.stop_strings import StopStringText

if TYPE_CHECKING:
    from backends.serve.parallel_sampling import ParentRequest


@dataclass(slots=True)
class RequestState:
    """One request in flight, as the handler sees it."""

    request_id: str
    parsed: Parsed
    arrival_s: float
    decoder: IncrementalDecoder
    queue: OutputQueue
    output_len: int = 0
    cached: int = 0
    last_output_s: float | None = None
    # the engine's times of the first output (engine clock, seconds): for a stop string's end
    queued_s: float | None = None
    scheduled_s: float | None = None
    first_output_s: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    deferred: Exception | None = None  # an error that arrived behind merged outputs
    stops: StopStringText | None = None  # the text, when the request has stop strings
    parent: ParentRequest | None = None  # the request it is a child of (`n` > 1)

    def usage(self) -> dict[str, Any]:
        return usage_body(len(self.parsed.prompt_ids), self.output_len, self.cached)

    def role_chunk(self, head: dict[str, Any], index: int = 0) -> dict[str, Any]:
        """`sse.role_chunk` for this request's choice `index`."""
        parsed = self.parsed
        return sse.role_chunk(head, index,
                              len(parsed.prompt_ids) if parsed.continuous_usage else None)


def has_output(state: RequestState) -> bool:
    """Whether `state` has an output or an error to take without waiting."""
    return state.deferred is not None or not state.queue.empty()


def merge_queued(state: RequestState, item: RequestOutput | Exception
                 ) -> RequestOutput | Exception:
    """`item` merged with the outputs queued behind it, as vLLM's `RequestOutputCollector`
    does in delta mode: a stream that fell behind the engine (its client or the API server
    slower than the steps) catches up with one chunk carrying several tokens instead of one
    write per token, which bunched the tokens at the client (several SSE events per read,
    an ITL of ~0 between them, and more writes still to do). An error behind them is kept
    for the next call (`state.deferred`)."""
    queue = state.queue
    while isinstance(item, RequestOutput) and item.finish_reason is None and not queue.empty():
        nxt = queue.get_nowait()
        if isinstance(nxt, Exception):
            state.deferred = nxt
            break
        nxt.new_token_ids = item.new_token_ids + nxt.new_token_ids
        item = nxt
    return item
