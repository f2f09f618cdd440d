"""The shape of an HTTP answer, as `docs/tools/api_diff/` compares rt serve's with vLLM's and
`test_api_diff.py` checks rt's against vLLM's frozen ones.

A shape keeps what a client branches on and drops what differs run to run: the status, the
media type, and the JSON body's keys with each scalar replaced by its JSON type, except the
fields whose value is part of the contract (an error's `type`, `code`, `param`; `object`,
`finish_reason`, `role`; the `usage` counts). A list whose items share one shape is that
shape once (`[shape]`), else each item's. A stream is the shape of its first event of each
kind (role, token, last, usage, `[DONE]`). Prometheus text is its `vllm:` family names. Pure
functions of the bytes: no I/O.
"""

from __future__ import annotations

import json
from typing import Any

# Fields whose values are compared, not only their types.
VALUED = frozenset({"type", "code", "param", "object", "finish_reason", "role",
                    "prompt_tokens", "completion_tokens", "total_tokens", "count",
                    "max_model_len"})
# Fields whose values are ids, times or generated text: compared by type only (the rest of
# the scalars too; VALUED names the exceptions).


def json_shape(value: Any, key: str | None = None) -> Any:
    """`value`'s shape (see the module docstring); `key`: the field that holds it."""
    if isinstance(value, dict):
        return {k: json_shape(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        items = [json_shape(v) for v in value]
        if items and all(item == items[0] for item in items):
            return [items[0]]
        return items
    if key == "param" and isinstance(value, str):
        return _param(value)
    if key in VALUED and (value is None or isinstance(value, str | int)):
        return value
    return _type_name(value)


def _param(param: str) -> str:
    """vLLM's schema errors name a location in the body (`body.messages.0.Some.content`,
    `body.1` for a JSON error's position): compared down to the top-level field."""
    parts = param.split(".")
    if parts[0] != "body" or len(parts) == 1:
        return param
    return "body" if parts[1].isdigit() else f"body.{parts[1]}"


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "number"
    return "str"


def media_type(content_type: str | None) -> str:
    """`text/event-stream; charset=utf-8` -> `text/event-stream`; None -> `none`."""
    return (content_type or "none").split(";")[0].strip().lower()


def sse_shape(text: str) -> dict[str, Any]:
    """A stream's events by kind (`chunk_kind`): the first event of each kind, its usage
    counts compared only where they are final (the last token's chunk, the usage chunk).
    How many token chunks a stream has depends on timing (a stream that falls behind the
    engine sends several tokens in one chunk), so it is not part of the shape."""
    kinds: dict[str, Any] = {}
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            kinds.setdefault("done", "[DONE]")
            continue
        try:
            event = json.loads(data)
        except ValueError:
            kinds.setdefault("not JSON", "not JSON")
            continue
        kind = chunk_kind(event)
        if kind not in kinds:
            shape = json_shape(event)
            if kind in ("role", "token") and isinstance(shape.get("usage"), dict):
                shape["usage"] = {k: "int" if isinstance(v, int) else v
                                  for k, v in shape["usage"].items()}
            kinds[kind] = shape
    return kinds


def chunk_kind(event: Any) -> str:
    """`role` (the chat stream's first chunk), `token`, `last` (a finish reason), `usage`
    (no choices), `error`, or `other`."""
    if not isinstance(event, dict):
        return "other"
    if "error" in event:
        return "error"
    choices = event.get("choices")
    if choices == []:
        return "usage"
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        return "other"
    choice = choices[0]
    if choice.get("finish_reason") is not None:
        return "last"
    delta = choice.get("delta")
    return "role" if isinstance(delta, dict) and "role" in delta else "token"


def metric_names(text: str) -> list[str]:
    """The `vllm:` metric families a Prometheus text exposition declares (`# TYPE` lines)."""
    names = {line.split()[2] for line in text.splitlines()
             if line.startswith("# TYPE ") and line.split()[2].startswith("vllm:")}
    return sorted(names)


def _parsed_shape(text: str) -> Any:
    try:
        return json_shape(json.loads(text))
    except ValueError:
        return "not JSON"


def answer_shape(status: int, content_type: str | None, body: bytes) -> dict[str, Any]:
    """One answer's shape: `status`, `media` and `body` (see the module docstring)."""
    media = media_type(content_type)
    text = body.decode("utf-8", "replace")
    shape: Any
    if media == "text/event-stream":
        shape = sse_shape(text)
    elif media == "application/json":
        shape = _parsed_shape(text)
    elif media.startswith("text/plain") and "# TYPE " in text:
        shape = metric_names(text)
    else:
        shape = "empty" if not body else "text"
    return {"status": status, "media": media, "body": shape}


Difference = tuple[str, Any, Any]  # (path, ours, theirs); MISSING where a side lacks it
MISSING = "(absent)"


def differences(ours: Any, theirs: Any, path: str = "") -> list[Difference]:
    """Where two shapes differ (empty: equal). Once the statuses differ, only the status and
    the error (if any) are compared, not two unrelated bodies key by key."""
    if isinstance(ours, dict) and isinstance(theirs, dict) and not path \
            and ours.get("status") != theirs.get("status"):
        errors = (_error(ours), _error(theirs))
        return [("status", ours.get("status"), theirs.get("status"))] \
            + ([("error", *errors)] if errors[0] != errors[1] else [])
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out: list[Difference] = []
        for key in sorted(set(ours) | set(theirs), key=str):
            where = f"{path}.{key}" if path else str(key)
            out += differences(ours.get(key, MISSING), theirs.get(key, MISSING), where)
        return out
    if _names(ours) and _names(theirs):  # metric families: which each side lacks
        only_ours, only_theirs = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        return [(f"{path} names", only_ours or MISSING, only_theirs or MISSING)] \
            if only_ours or only_theirs else []
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [d for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
                for d in differences(a, b, f"{path}[{i}]")]
    return [] if ours == theirs else [(path or "answer", ours, theirs)]


def _names(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, str) and v.startswith("vllm:") for v in value)


def _error(answer: dict[str, Any]) -> Any:
    body = answer.get("body")
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return {k: error.get(k) for k in ("type", "param")}
    return MISSING if error is None else error


# Differences no client can tell apart, each with the reason (docs/tools/api_diff/README.md).
NULL_ONLY = "a field one side sends as null and the other leaves out"
CACHED_TOKENS = ("rt always reports usage.prompt_tokens_details.cached_tokens (vLLM: with "
                 "--enable-prompt-tokens-details)")
PARAM_NAMED = "rt names the field where vLLM's error names none (param null)"
FINGERPRINT = ("rt sends no system_fingerprint (OpenAI: optional; vLLM's names vLLM's "
               "version and build)")
COALESCED = ("a stream without a token chunk before its last (all its tokens came in one "
             "chunk: timing)")


def harmless(difference: Difference) -> str | None:
    """Why `difference` does not matter to a client, or None when it may."""
    path, ours, theirs = difference
    if MISSING in (ours, theirs) and "null" in (ours, theirs):
        return NULL_ONLY
    if path.endswith("usage.prompt_tokens_details") and theirs in ("null", MISSING) \
            and ours == {"cached_tokens": "int"}:
        return CACHED_TOKENS
    if path.endswith("error.param") and theirs is None and isinstance(ours, str):
        return PARAM_NAMED
    if path.endswith("system_fingerprint") and ours == MISSING:
        return FINGERPRINT
    if path.endswith("body.token") and MISSING in (ours, theirs):
        return COALESCED
    return None


def brief(value: Any) -> str:
    text = value if value == MISSING else json.dumps(value, sort_keys=True)
    return text if len(text) <= 70 else text[:67] + "..."
