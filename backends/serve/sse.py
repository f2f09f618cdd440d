"""The SSE events of `rt serve`'s streams as bytes, the per-token chunk from a template.

A stream's chunks differ only in their text and, on the last one, the finish and stop
reasons (and the usage with `continuous_usage_stats`): the JSON around the text (id, object,
created, model, the choice's constant fields) is encoded once per request (`ChunkEncoder`),
and each chunk is that prefix + the text as a JSON string + a suffix. The bytes are exactly
those of `json.dumps(chunk, separators=(",", ":"))` of the chunk as a dict (keys in vLLM's
order, ASCII-escaped as `json.dumps` does); tests/backends/serve/test_sse.py checks them
against that reference. Events that come once per request (the chat role chunk, the usage
chunk, an error, `[DONE]`) are dicts through `event`.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii  # what json.dumps uses for a str
from typing import Any

DONE = b"data: [DONE]\n\n"
_COMPACT = (",", ":")


def event(data: dict[str, Any]) -> bytes:
    """One `data: {json}` SSE event."""
    return b"data: " + json.dumps(data, separators=_COMPACT).encode() + b"\n\n"


def role_chunk(head: dict[str, Any], index: int, usage_prompt: int | None) -> dict[str, Any]:
    """The chat stream's first chunk of choice `index` (role, empty content), with a usage
    of `usage_prompt` prompt tokens and none generated under `continuous_usage_stats`
    (None: no usage). As vLLM, it is sent with the first engine output, i.e. just before
    the first token's chunk, never earlier: vLLM's bench client stamps TTFT at the first
    chunk carrying `choices`, so a role chunk sent at once would make TTFT read as the
    request's network round trip (vLLM 0.32, entrypoints/openai/chat_completion/
    serving.py, chat_completion_stream_generator: the role is sent `if first_iteration`
    inside `async for res in result_generator`, once per choice)."""
    chunk = {**head, "choices": [{"index": index,
                                  "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]}
    if usage_prompt is not None:
        chunk["usage"] = {"prompt_tokens": usage_prompt, "completion_tokens": 0,
                          "total_tokens": usage_prompt}
    return chunk


class ChunkEncoder:
    """One stream's token chunks:

        data: {"id":ID,"object":OBJ,"created":N,"model":M,"choices":[{"index":I,
               "logprobs":null,"finish_reason":F,"stop_reason":S,"text":T}]}\\n\\n
    (chat: `"delta":{"content":T}` for `"text":T`), with `,"usage":{...}` before the last
    brace when usage is sent with every chunk."""

    __slots__ = ("head", "_open", "_close", "_text_key", "_plain", "_end", "_usage_open")

    def __init__(self, request_id: str, obj: str, created: int, model: str, chat: bool,
                 index: int = 0) -> None:
        """`index`: the choice's (one encoder per choice when `n` > 1)."""
        # head: the chunk's leading fields, as a dict (the once-per-request events use it)
        self.head = {"id": request_id, "object": obj, "created": created, "model": model}
        fields = json.dumps(self.head, separators=_COMPACT)[:-1]  # without its closing brace
        self._open = (f'data: {fields},"choices":[{{"index":{int(index)},"logprobs":null,'
                      '"finish_reason":').encode()
        self._close = b"}}]" if chat else b"}]"
        self._text_key = b',"delta":{"content":' if chat else b',"text":'
        self._plain = self._open + b'null,"stop_reason":null' + self._text_key
        self._end = self._close + b"}\n\n"
        self._usage_open = f'data: {fields},"choices":[],"usage":'.encode()

    def token(self, text: str) -> bytes:
        """The common chunk: `text`, no reasons, no usage (`chunk(text)`, faster)."""
        return self._plain + encode_basestring_ascii(text).encode() + self._end

    def chunk(self, text: str, finish_reason: str | None = None,
              stop_reason: int | str | None = None, usage: dict[str, Any] | None = None
              ) -> bytes:
        """The event of one chunk: `text`, the reasons (None but on the last chunk) and the
        usage (None: not sent)."""
        tail = b"}\n\n" if usage is None else \
            b',"usage":' + json.dumps(usage, separators=_COMPACT).encode() + b"}\n\n"
        if finish_reason is None and stop_reason is None:
            reasons = b'null,"stop_reason":null'
        else:
            reasons = (f'{json.dumps(finish_reason)},"stop_reason":'
                       f'{json.dumps(stop_reason)}').encode()
        return b"".join((self._open, reasons, self._text_key,
                         encode_basestring_ascii(text).encode(), self._close, tail))

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        """The stream's usage event (`stream_options.include_usage`): `event` of
        `{**head, "choices": [], "usage": {...}}` with the counts formatted in place (ints
        print as `json.dumps` prints them), once per request."""
        return b"%s{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d," \
            b"\"prompt_tokens_details\":{\"cached_tokens\":%d}}}\n\n" % (
                self._usage_open, prompt_tokens, completion_tokens,
                prompt_tokens + completion_tokens, cached_tokens)
