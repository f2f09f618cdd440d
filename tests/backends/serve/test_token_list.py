"""`token_list`, the prompt-id check run once per admitted request: the fast path (types as a
set, range by min/max) answers exactly as the per-id check it replaced."""

from __future__ import annotations

from typing import Any

import pytest

from backends.serve.api_error import ApiError
from backends.serve.body_fields import short, token_list


def _reference(value: Any, vocab_size: int) -> list[int] | tuple[str, str]:
    """The per-id check before the fast path: the ids, or the error's message and param (a
    type or a negative id: vLLM's schema error, `body.prompt`)."""
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        return "prompt must be a list of token ids", "body.prompt"
    if any(t < 0 for t in value):
        return f"prompt: token id {short(min(value))} is negative", "body.prompt"
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        return (f"prompt: token id {short(bad[0])} is outside the vocabulary "
                f"[0, {vocab_size})", "prompt")
    return value


@pytest.mark.parametrize("value", [
    [], [0], [511], [0, 5, 511], list(range(512)), [3, 512], [512, -1], [-1, 512], [7, -3],
    [1, True], [True], [False, 2], [1, 2.0], [1.0], [1, "2"], [1, None], [[1]], "12", None,
    {"a": 1}, 5, [10**40], [-(10**40), 3]])
def test_token_list_answers_as_the_per_id_check(value: Any) -> None:
    expected = _reference(value, 512)
    if isinstance(expected, tuple):
        with pytest.raises(ApiError) as err:
            token_list(value, "prompt", 512)
        assert (err.value.status, err.value.message, err.value.param) == (400, *expected)
    else:
        assert token_list(value, "prompt", 512) is value
