"""What the router reads of an OpenAI request body to route it.

The prefix index needs token ids, and the router does not tokenize as the backend does (a
round trip to /tokenize per request would cost more than the routing). It uses the prompt
text's UTF-8 bytes, as ids 3 + byte: exactly `rt serve`'s `ByteTokenizer` ids (the tokenizer
of `--simulate` and of models without one), so router blocks line up with such a backend's
KV blocks; in front of a model with a real tokenizer, prefix lengths are in bytes (about 4
per token). Chat messages are rendered as `rt serve`'s template of models without one
(`role: content` lines). A completion prompt given as token ids is used as is (ids outside
[0, 2**63), which no tokenizer makes and the policies' int64 hashing cannot pack, left out:
the backend refuses such a prompt itself).

The session key (for `session-hash`, and kv-aware's fallback) is the `x-session-id` header,
else the body's `user` field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from backends.engine.text import simple_chat_text
from runtime.router import RoutingRequest

_BYTE_OFFSET = 3  # ByteTokenizer: ids 0, 1, 2 are pad, BOS, EOS; byte b -> 3 + b
_MAX_ID = (1 << 63) - 1  # the policies hash token ids as int64


def prompt_text(body: Mapping[str, Any], chat: bool) -> str | list[int]:
    """The prompt as text (chat: rendered), or as token ids when a completion gives ids."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return simple_chat_text([{"role": str(m.get("role", "")),
                                  "content": _content(m.get("content"))}
                                 for m in messages if isinstance(m, dict)])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return _ids(prompt)
        prompt = first  # a batch: route by its first prompt
        if isinstance(prompt, list):
            return _ids(prompt)
    return prompt if isinstance(prompt, str) else ""


def _ids(prompt: list[Any]) -> list[int]:
    return [t for t in prompt if isinstance(t, int) and 0 <= t <= _MAX_ID]


def _content(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones, in order
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else json.dumps(content)


def routing_request(body: Mapping[str, Any], chat: bool, headers: Mapping[str, str],
                    request_id: str, now_s: float, with_ids: bool = True) -> RoutingRequest:
    """The policy's view of one request (an empty prompt counts as one unknown token);
    without `with_ids`, no token ids (for a policy that never reads them: building them
    costs ~0.1 ms per KB of prompt), the same prompt length."""
    prompt = prompt_text(body, chat)
    # a lone surrogate (JSON's "\ud800" escape) is not UTF-8: its bytes as Python's
    # surrogatepass writes them
    raw = prompt if isinstance(prompt, list) else prompt.encode("utf-8", "surrogatepass")
    ids = (list(raw) if isinstance(prompt, list) else [_BYTE_OFFSET + b for b in raw]) \
        if with_ids else []
    session = headers.get("x-session-id") or body.get("user")
    return RoutingRequest(request_id=request_id, now_s=now_s, prompt_len=max(len(raw), 1),
                          token_ids=tuple(ids) if ids else None,
                          session_id=str(session) if session else None)
