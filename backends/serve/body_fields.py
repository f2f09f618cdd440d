"""One field of an OpenAI request body (a decoded JSON object), read as vLLM's schema types
it: a wrong type is its "Bad Request" (`body_error`, `param` "body.<field>"), a value out of
its range rt serve's own 400 (`ApiError`, `param` the field's name).

    typed_field(body, "top_k", (int,), 0)   # 4.0 -> 4; "4" and true refused (no guessing)
    number_field(body, "top_p", 1.0)        # a finite float (an int too)
    token_list(body["prompt"], "prompt", vocab_size)   # ids in [0, vocab_size)
"""

from __future__ import annotations

import math
from typing import Any

from backends.serve.api_error import ApiError, body_error

INT64 = (-(1 << 63), (1 << 63) - 1)  # vLLM's int64 range (a seed, a priority), ends included
_INT = {int}


def short(value: Any) -> str:
    """`repr(value)` cut to 40 characters, for a message that quotes a refused value."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def typed_field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any
                ) -> Any:
    """`body[name]` if one of `kinds` (None or absent: `default`); an integral float for an
    int (4.0, 1e9), as vLLM's schema takes it. A string or a boolean for a number is refused
    (vLLM coerces "4" and true; rt does not guess)."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise body_error(f"{name} must be {kinds[0].__name__}, got a boolean", f"body.{name}")
    if isinstance(value, float) and int in kinds and float not in kinds \
            and value.is_integer():
        return int(value)
    if not isinstance(value, kinds):
        raise body_error(f"{name} must be {kinds[0].__name__}, got {short(value)}",
                         f"body.{name}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"{name} must be finite, got {value}", name)
    return value


def number_field(body: dict[str, Any], name: str, default: float) -> float:
    """A finite float (an int too, when a float can hold it)."""
    value = typed_field(body, name, (float, int), default)
    try:
        number = float(value)
    except OverflowError:
        raise body_error(f"{name} is out of range", f"body.{name}") from None
    if not math.isfinite(number):
        raise ApiError(400, f"{name} must be finite, got {number}", name)
    return number


def token_list(value: Any, name: str, vocab_size: int) -> list[int]:
    """`value` if it is a list of token ids in [0, vocab_size) (`name`: the field's)."""
    # Once per admitted request: the ids' types as a set, then their range by min/max; the
    # first bad id is searched for only when there is one (a 256-token prompt: 14-28 us,
    # against 43-48 us for a generator over the ids). JSON's only int subclass is bool,
    # refused here as before.
    if not isinstance(value, list) or not set(map(type, value)) <= _INT:
        if not isinstance(value, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise body_error(f"{name} must be a list of token ids", f"body.{name}")
    if value and (min(value) < 0 or max(value) >= vocab_size):
        if min(value) < 0:  # vLLM's schema: ids are non-negative
            raise body_error(f"{name}: token id {short(min(value))} is negative",
                             f"body.{name}")
        bad = [t for t in value if not 0 <= t < vocab_size]
        raise ApiError(400, f"{name}: token id {short(bad[0])} is outside the vocabulary "
                       f"[0, {vocab_size})", name)
    return value


def unicode_text(value: str, name: str) -> str:
    """`value` if it is Unicode text; ApiError 400 for a lone surrogate (JSON's "\ud800"
    escape makes one; no tokenizer takes it: ByteTokenizer raises UnicodeEncodeError, a
    Hugging Face one TypeError). An ASCII string is known as such in O(1)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"{name} is not valid Unicode text (a lone surrogate)",
                           name) from None
    return value
