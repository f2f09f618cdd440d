"""vLLM's `timed_trace` dataset (`vllm bench serve --dataset-name timed_trace`), both ways.

One JSON object per line, `{"timestamp", "input_length", "output_length", "hash_ids"}`, with
timestamps in seconds (vLLM's `--timed-trace-sec-multiplier` 1, the default) and one hash id
per `TIMED_TRACE_BLOCK_SIZE` = 16 prompt tokens (`--timed-trace-chunk-hash-size`, default 16).
vLLM expands each id into that many sampled tokens, equal ids giving equal tokens, and stops
when the ids run out (vllm 0.32 `benchmarks/datasets/datasets.py`, `TimedTrace._expand_prompt`),
so every prompt needs ceil(input_length / 16) ids or it comes out shorter.

Writing: the ids are chained, so equal ids mean an equal prompt *prefix* up to that block:
block j of a prompt gets the id of (the id of block j - 1, what block j holds), numbered from 0
in order of first appearance. Two prompts share ids exactly as far as rt's own tokens for them
(`workloads.tokens`) agree, at 16-token granularity, which is what a prefix cache with blocks
of 16 (or a multiple of it dividing evenly) can hit. Reading: `parse_timed_trace`, as a Bailian
row without chats (`--format timed_trace`; the keys are Mooncake's, whose time unit is ms,
so it is never detected).
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterator
from pathlib import Path

from workloads.errors import TraceError
from workloads.trace import Trace, TraceRequest

TIMED_TRACE_BLOCK_SIZE = 16  # vLLM's --timed-trace-chunk-hash-size default


def write_timed_trace(trace: Trace, path: Path,
                      block_size: int = TIMED_TRACE_BLOCK_SIZE) -> None:
    """Write `trace` as vLLM timed_trace JSONL (see the module docstring)."""
    if block_size < 1:
        raise TraceError("must be >= 1 token", column="--hash-block-size", value=block_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        out.writelines(line + "\n" for line in timed_trace_lines(trace, block_size))


def timed_trace_lines(trace: Trace, block_size: int = TIMED_TRACE_BLOCK_SIZE) -> Iterator[str]:
    ids: dict[tuple[int, Hashable], int] = {}
    for req in sorted(trace, key=lambda r: r.arrival_s):
        hash_ids = []
        parent = -1
        for block in _blocks(req, block_size):
            parent = ids.setdefault((parent, block), len(ids))
            hash_ids.append(parent)
        yield json.dumps({"timestamp": round(req.arrival_s, 9), "input_length": req.prompt_len,
                          "output_length": req.output_len, "hash_ids": hash_ids},
                         separators=(", ", ": "))


def _blocks(req: TraceRequest, size: int) -> Iterator[Hashable]:
    """What each `size`-token block of the prompt holds: its tokens when explicit, else the
    (stream key, first index, count) pieces it reads (equal pieces, equal tokens)."""
    if req.prompt_token_ids is not None:
        tokens = req.prompt_token_ids
        for start in range(0, len(tokens), size):
            yield tuple(tokens[start:start + size])
        return
    from workloads.tokens import prompt_pieces

    spans: list[tuple[str, int, int]] = []  # (stream key, first index, count)
    for key, length in prompt_pieces(req):
        offset = 0
        while offset < length:
            room = size - sum(n for _, _, n in spans)
            take = min(room, length - offset)
            spans.append((key, offset, take))
            offset += take
            if sum(n for _, _, n in spans) == size:
                yield tuple(spans)
                spans = []
    if spans:
        yield tuple(spans)
