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
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from backends.engine.sampling_options import SamplingOptions
from backends.serve.responses import choice_body, response_body, usage_body

if TYPE_CHECKING:
    from backends.serve.engine_client import OutputQueue
    from backends.serve.messages import RequestOutput
    from backends.serve.server import _Generation


def child_request_id(index: int, parent_id: str) -> str:
    """Child `index`'s engine request id (vLLM's `get_child_info`)."""
    return f"{index}_{parent_id}"


def child_sampling(options: SamplingOptions, index: int) -> SamplingOptions:
    """Child `index`'s sampling options: the parent's, with seed + index when seeded."""
    if options.seed is None:
        return options
    return dataclasses.replace(options, seed=options.seed + index)


class ParentRequest:
    """One API request's n children (index order) and the merge of their outputs.

    Invariants: `children[i].request_id == child_request_id(i, request_id)`, every child
    reads `queue`, and a finished child is never routed another output."""

    __slots__ = ("request_id", "children", "queue", "_index", "_unfinished", "first_cached",
                 "last_cached")

    def __init__(self, request_id: str, children: list[_Generation], queue: OutputQueue
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

    def route(self, out: RequestOutput) -> tuple[int, _Generation] | None:
        """The (index, child) `out` belongs to; None for a child already finished (outputs
        the engine sent before a stop string's abort reached it)."""
        index = self._index[out.request_id]
        child = self.children[index]
        if child.finish_reason is not None:
            return None
        if self.first_cached is None:
            self.first_cached = out.num_cached_tokens
        return index, child

    def on_child_finished(self, child: _Generation) -> tuple[int, int] | None:
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
