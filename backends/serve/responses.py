"""The bodies of `rt serve`'s answers, as vLLM 0.32 writes them: a whole (non-streamed)
answer, its choices and its usage, and the ids and object names streams share with it
(`sse` encodes the streamed chunks), and the JSON bytes of every answer and error."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


def json_bytes(value: Any) -> bytes:
    """`value` as rt serve's JSON responses encode it (Starlette's `JSONResponse`: compact,
    UTF-8, no NaN), so that `rt route`'s own answers are the same bytes."""
    return bytes(JSONResponse(value).body)


def answer_id(request_id: str, chat: bool) -> str:
    """The answer's `id` (vLLM's prefixes on the request id)."""
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def chunk_object(chat: bool) -> str:
    """A streamed chunk's `object`."""
    return "chat.completion.chunk" if chat else "text_completion"


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int
               ) -> dict[str, Any]:
    """An answer's `usage` (`cached_tokens`: prompt tokens found in the prefix cache)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice_body(index: int, text: str, finish_reason: str | None, stop_reason: int | str | None,
                chat: bool) -> dict[str, Any]:
    """One choice of a whole answer."""
    choice: dict[str, Any] = {"index": index, "logprobs": None,
                              "finish_reason": finish_reason, "stop_reason": stop_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return choice


def response_body(request_id: str, chat: bool, created: int, model: str,
                  choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    """A whole answer (`created`: Unix seconds)."""
    return {"id": answer_id(request_id, chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": usage}
