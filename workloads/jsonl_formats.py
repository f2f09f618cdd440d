"""JSON Lines trace formats with prefix-block hash ids: Mooncake (FAST'25) and Qwen Bailian.

| format | keys | `timestamp` unit | hash block (tokens) |
|---|---|---|---|
| `mooncake` | `timestamp, input_length, output_length, hash_ids` | milliseconds | 512 |
| `bailian` | the same plus `chat_id, parent_chat_id` (-1 = root) | seconds | 16 |
| `timed_trace` | Mooncake's (vLLM's timed_trace dataset; never detected) | seconds | 16 |

Equal hash ids name equal token blocks (`workloads.tokens`). A row may list fewer ids than
ceil(input_length / block) (its tail is then request-unique, counted in the load report) but
never more. Bailian rows get `request_id = chat_id` and `session_id =` the chat id at the root
of the `parent_chat_id` chain; Mooncake rows get their 0-based row index as id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from workloads.errors import TraceError
from workloads.rows import RawRows

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake traces
BAILIAN_BLOCK_SIZE = 16  # tokens per hash id in the Qwen Bailian traces
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
BAILIAN_KEYS = ("chat_id", "parent_chat_id", "timestamp", "input_length", "output_length",
                "hash_ids")


@dataclass(frozen=True, slots=True)
class _Columns:
    """Values collected line by line (timestamps in the file's unit)."""

    line: list[int]
    timestamp: list[float]
    prompt_len: list[int]
    output_len: list[int]
    hash_ids: list[tuple[int, ...]]
    chat_id: list[str]
    parent_id: list[str | None]


def parse_mooncake(path: Path, hash_block_size: int | None = None) -> RawRows:
    """Mooncake JSONL: timestamps in ms, 512-token hash blocks unless overridden."""
    cols = _read(path, MOONCAKE_KEYS, with_chat=False)
    return _rows("mooncake", path, cols, seconds_per_unit=1e-3,
                 block=hash_block_size or MOONCAKE_BLOCK_SIZE, ids=None, sessions=None)


def parse_bailian(path: Path, hash_block_size: int | None = None) -> RawRows:
    """Qwen Bailian JSONL: timestamps in s, 16-token hash blocks unless overridden."""
    cols = _read(path, BAILIAN_KEYS, with_chat=True)
    return _rows("bailian", path, cols, seconds_per_unit=1.0,
                 block=hash_block_size or BAILIAN_BLOCK_SIZE, ids=cols.chat_id,
                 sessions=_sessions(cols.chat_id, cols.parent_id))


def parse_timed_trace(path: Path, hash_block_size: int | None = None) -> RawRows:
    """vLLM timed_trace JSONL (`workloads.timed_trace`): Mooncake's keys, timestamps in s,
    16-token hash blocks unless overridden (vLLM's --timed-trace-chunk-hash-size)."""
    cols = _read(path, MOONCAKE_KEYS, with_chat=False)
    return _rows("timed_trace", path, cols, seconds_per_unit=1.0,
                 block=hash_block_size or BAILIAN_BLOCK_SIZE, ids=None, sessions=None)


def _rows(fmt: str, path: Path, cols: _Columns, *, seconds_per_unit: float, block: int,
          ids: list[str] | None, sessions: list[str | None] | None) -> RawRows:
    stamps = np.asarray(cols.timestamp, dtype=np.float64)
    unsorted = np.flatnonzero(stamps[1:] < stamps[:-1])
    if len(unsorted):
        row = int(unsorted[0]) + 1
        raise TraceError("timestamps must be sorted (earlier than the previous row)",
                         path=str(path), line=cols.line[row], column="timestamp",
                         value=cols.timestamp[row])
    return RawRows(format=fmt, line=np.asarray(cols.line, dtype=np.int64),
                   arrival_s=(stamps - stamps[0]) * seconds_per_unit,
                   prompt_len=np.asarray(cols.prompt_len, dtype=np.int64),
                   output_len=np.asarray(cols.output_len, dtype=np.int64),
                   request_id=ids, session_id=sessions, hash_ids=cols.hash_ids,
                   hash_block_size=block)


def _read(path: Path, keys: tuple[str, ...], *, with_chat: bool) -> _Columns:
    cols = _Columns([], [], [], [], [], [], [])
    with open_text(path) as src:
        for number, text in enumerate(src, start=1):
            if text.strip():
                try:
                    _add_row(cols, _load(text), keys, number, with_chat)
                except TraceError as err:
                    raise err.at(str(path), number) from None
    if not cols.line:
        raise TraceError("empty file: no JSON rows", path=str(path), line=1)
    return cols


def _add_row(cols: _Columns, obj: dict[str, Any], keys: tuple[str, ...], number: int,
             with_chat: bool) -> None:
    for key in keys:
        if key not in obj:
            raise TraceError(f"missing key (row has {', '.join(map(repr, obj))})", column=key)
    cols.line.append(number)
    cols.timestamp.append(_number(obj, "timestamp"))
    cols.prompt_len.append(_count(obj, "input_length"))
    cols.output_len.append(_count(obj, "output_length"))
    cols.hash_ids.append(_hash_ids(obj["hash_ids"]))
    if with_chat:
        cols.chat_id.append(str(_count(obj, "chat_id")))
        parent = obj["parent_chat_id"]
        cols.parent_id.append(None if parent == -1 else str(_count(obj, "parent_chat_id")))


def _sessions(chat_ids: list[str], parents: list[str | None]) -> list[str | None]:
    """The root chat id of each row's parent chain (a row without a parent is its own root)."""
    root: dict[str, str] = {}
    out: list[str | None] = []
    for chat, parent in zip(chat_ids, parents, strict=True):
        session = chat if parent is None else root.get(parent, parent)
        root[chat] = session
        out.append(session)
    return out


def _number(obj: dict[str, Any], key: str) -> float:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value \
            or value in (float("inf"), float("-inf")):
        raise TraceError("not a finite number", column=key, value=value)
    if value < 0:
        raise TraceError("must be >= 0", column=key, value=value)
    return float(value)


def _count(obj: dict[str, Any], key: str) -> int:
    value = obj[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError("not an integer", column=key, value=value)
    if value < 0:
        raise TraceError("must be >= 0", column=key, value=value)
    return value


def _hash_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TraceError("must be a list of integers", column="hash_ids", value=value)
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise TraceError("hash ids must be integers >= 0", column="hash_ids", value=item)
    return tuple(value)


def _load(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"invalid JSON ({exc.msg}, char {exc.pos + 1})",
                         value=text.strip()) from None
    except RecursionError:  # the decoder's own limit: ~1,000 nested arrays or objects
        raise TraceError("invalid JSON (nested too deeply)", value=text.strip()) from None
    if not isinstance(obj, dict):
        raise TraceError("expected a JSON object", value=text.strip())
    return obj


def open_text(path: Path) -> TextIO:
    """Open a text file for reading (UTF-8); a missing file raises TraceError."""
    try:
        return path.open("r", encoding="utf-8-sig")  # tolerate a byte-order mark
    except OSError as exc:
        raise TraceError(f"cannot open ({exc.strerror})", path=str(path)) from None
