"""rt's own trace file format: JSON Lines with a versioned header. Round-trips exactly.

Line 1 is the header, every further line one request, in arrival order:

    {"format": "rt-trace", "version": 1, "name": "azure_conv", "requests": 2}
    {"id": "0", "arrival_s": 0.0, "prompt_len": 374, "output_len": 44}
    {"id": "1", "arrival_s": 4.3145789, "prompt_len": 396, "output_len": 109,
     "session_id": "c7", "segments": [["p:shared", 64], ["u:1", 332]]}

TraceRequest keys (units: seconds, tokens):

| key | type | meaning |
|---|---|---|
| `id` | string | unique request id (required) |
| `arrival_s` | number | arrival time, seconds from the trace start (required) |
| `prompt_len`, `output_len` | integer >= 1 | prompt and output lengths in tokens (required) |
| `prompt_token_ids` | list of int | explicit prompt tokens |
| `hash_ids`, `hash_block_size` | list of int, int | prefix-block hash ids and tokens per block |
| `segments` | list of [key, length] | prompt as spans of named token streams |
| `session_id` | string | conversation / session id |
| `priority` | integer | vLLM priority (lower first); omitted when 0 |
| `cache_salt` | string | vLLM cache salt |

Optional keys are omitted when absent. Floats are written in Python's shortest round-trip form,
so `read(write(trace)) == trace` holds exactly. Unknown keys are an error, so a newer file is
never silently misread; `version` must be 1.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from workloads.errors import TraceError
from workloads.trace import Span, Trace, TraceRequest, check_order

FORMAT_NAME = "rt-trace"
FORMAT_VERSION = 1
_REQUIRED = ("id", "arrival_s", "prompt_len", "output_len")
_OPTIONAL = ("prompt_token_ids", "hash_ids", "hash_block_size", "segments", "session_id",
             "priority", "cache_salt")


def write_rt_jsonl(trace: Trace, path: Path) -> None:
    """Write `trace` to `path` in rt JSONL format (creates parent folders)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for line in dump_lines(trace):
            out.write(line + "\n")


def dump_lines(trace: Trace) -> Iterator[str]:
    """The header line, then one JSON line per request (no trailing newlines)."""
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "name": trace.name,
              "requests": len(trace)}
    yield json.dumps(header)
    for req in trace:
        yield json.dumps(request_to_dict(req), separators=(", ", ": "))


def trace_digest(trace: Trace) -> str:
    """SHA-256 (hex) of the trace's rt JSONL form: equal digests, equal traces."""
    digest = hashlib.sha256()
    for line in dump_lines(trace):
        digest.update(line.encode())
        digest.update(b"\n")
    return digest.hexdigest()


def trace_info(trace: Trace) -> dict[str, Any]:
    """The trace's identity in a run's run.json: name, request count, digest."""
    return {"name": trace.name, "requests": len(trace), "digest": trace_digest(trace)}


def request_to_dict(req: TraceRequest) -> dict[str, Any]:
    """The JSON object of one request (optional keys only when present)."""
    obj: dict[str, Any] = {"id": req.request_id, "arrival_s": req.arrival_s,
                           "prompt_len": req.prompt_len, "output_len": req.output_len}
    if req.prompt_token_ids is not None:
        obj["prompt_token_ids"] = list(req.prompt_token_ids)
    if req.hash_ids is not None:
        obj["hash_ids"] = list(req.hash_ids)
        obj["hash_block_size"] = req.hash_block_size
    if req.segments is not None:
        obj["segments"] = [[span.key, span.length] for span in req.segments]
    for key in ("session_id", "cache_salt"):
        if getattr(req, key) is not None:
            obj[key] = getattr(req, key)
    if req.priority != 0:
        obj["priority"] = req.priority
    return obj


def read_rt_jsonl(path: Path) -> Trace:
    """Read an rt JSONL trace; any defect raises TraceError naming file, line, key, value."""
    with path.open("r", encoding="utf-8-sig") as src:  # a byte-order mark, as the others
        try:
            return parse_rt_lines(src)
        except TraceError as err:
            raise err.at(str(path)) from None


def parse_rt_lines(lines: Iterable[str] | TextIO) -> Trace:
    """Parse rt JSONL text lines (header first). Errors carry line numbers, not a path."""
    numbered = enumerate(lines, start=1)
    header = _parse_header(next(numbered, (1, "")))
    numbers, requests = [], []
    for number, text in numbered:
        if text.strip():
            numbers.append(number)
            requests.append(_parse_request(text, number))
    if len(requests) != header["requests"]:
        raise TraceError(f"header announces {header['requests']} requests, file holds "
                         f"{len(requests)} (truncated?)", line=1, column="requests",
                         value=header["requests"])
    problem = check_order(requests)
    if problem is not None:
        raise problem[1].at(None, numbers[problem[0]])
    return Trace(tuple(requests), name=header.get("name"))


def _parse_header(numbered_line: tuple[int, str]) -> dict[str, Any]:
    number, text = numbered_line
    if not text.strip():
        raise TraceError("empty file: expected an rt-trace header line", line=number)
    obj = _load_object(text, number)
    if obj.get("format") != FORMAT_NAME:
        raise TraceError(f"not an rt trace header (expected format {FORMAT_NAME!r})",
                         line=number, column="format", value=obj.get("format"))
    if obj.get("version") != FORMAT_VERSION:
        raise TraceError(f"unsupported rt-trace version (this rt reads {FORMAT_VERSION})",
                         line=number, column="version", value=obj.get("version"))
    if obj.get("name") is not None and not isinstance(obj["name"], str):
        raise TraceError("must be a string or null", line=number, column="name",
                         value=obj["name"])
    count = obj.get("requests")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise TraceError("must be a request count >= 0", line=number, column="requests",
                         value=count)
    return obj


def _parse_request(text: str, number: int) -> TraceRequest:
    obj = _load_object(text, number)
    for key in obj:
        if key not in _REQUIRED and key not in _OPTIONAL:
            raise TraceError("unknown key", line=number, column=key, value=obj[key])
    for key in _REQUIRED:
        if key not in obj:
            raise TraceError("missing required key", line=number, column=key)
    try:
        return _build_request(obj)
    except TraceError as err:
        raise err.at(None, number) from None


def _build_request(obj: dict[str, Any]) -> TraceRequest:
    return TraceRequest(
        request_id=obj["id"],
        arrival_s=obj["arrival_s"],
        prompt_len=obj["prompt_len"],
        output_len=obj["output_len"],
        prompt_token_ids=_int_tuple(obj, "prompt_token_ids"),
        hash_ids=_int_tuple(obj, "hash_ids"),
        hash_block_size=obj.get("hash_block_size"),
        segments=_segments(obj.get("segments")),
        session_id=_optional_str(obj, "session_id"),
        priority=obj.get("priority", 0),
        cache_salt=_optional_str(obj, "cache_salt"),
    )


def _int_tuple(obj: dict[str, Any], key: str) -> tuple[int, ...] | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise TraceError("must be a list of integers", column=key, value=value)
    return tuple(value)


def _segments(value: object) -> tuple[Span, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise TraceError("must be a list of [key, length] pairs", column="segments",
                         value=value)
    spans = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            raise TraceError("must be a [key, length] pair", column="segments", value=item)
        spans.append(Span(item[0], item[1]))
    return tuple(spans)


def _optional_str(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise TraceError("must be a string", column=key, value=value)
    return value


def _load_object(text: str, number: int) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"invalid JSON ({exc.msg}, char {exc.pos + 1})", line=number,
                         value=text.strip()) from None
    except RecursionError:  # the decoder's own limit: ~1,000 nested arrays or objects
        raise TraceError("invalid JSON (nested too deeply)", line=number,
                         value=text.strip()) from None
    if not isinstance(obj, dict):
        raise TraceError("expected a JSON object", line=number, value=text.strip())
    return obj
