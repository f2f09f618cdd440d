"""`guard.parse_json` (pydantic-core's parser, `json.loads` for whatever it refuses) against
`json.loads` without NaN or infinities, the parser it replaced: the same value (type, sign
and bits of floats included) or the same error message, on a table of request bodies and on
random JSON documents and their byte mutations."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from backends.serve.guard import _no_constant, parse_json


def _reference(text: str) -> tuple[str, Any]:
    try:
        return "ok", json.loads(text, parse_constant=_no_constant)
    except ValueError as err:
        return "error", f"{type(err).__name__}: {err}"
    except RecursionError:
        return "error", "RecursionError"


def _ours(text: str) -> tuple[str, Any]:
    try:
        return "ok", parse_json(text)
    except ValueError as err:
        return "error", f"{type(err).__name__}: {err}"
    except RecursionError:
        return "error", "RecursionError"


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types throughout (floats bit for bit, NaN unequal)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return math.copysign(1.0, a) == math.copysign(1.0, b) and (a == b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


BODIES = [
    '{"model":"m","prompt":[1,2,3],"max_tokens":128,"ignore_eos":true,"stream":true,'
    '"stream_options":{"include_usage":true}}',
    '{"messages":[{"role":"user","content":"h\\u00e9llo \\ud83d\\ude00"}],"temperature":0.7}',
    '{"prompt":"x","temperature":1e39,"top_p":5e-324,"seed":18446744073709551616}',
    '{"prompt":"x","max_tokens":1e400}', '{"prompt":"x","max_tokens":-1e400}',
    '{"prompt":"x","max_tokens":-0,"top_p":-0.0,"n":1.0,"k":1E5,"j":2.5e-3}',
    '{"a":1,"a":2}', ' \n{ "a" : [ ] , "b" : { } }\t', '{"s":"\\ud800"}', '{"s":"\\udc00x"}',
    '{"s":"\\"\\\\\\/\\b\\f\\n\\r\\t"}', '{"big":' + "9" * 4300 + "}",
    '{"big":' + "9" * 4301 + "}", '{"d":' + "[" * 300 + "]" * 300 + "}",
    '{"d":' + "[" * 5000 + "]" * 5000 + "}",
    "", "{", "}", "[]", "[1,]", '{"a":1,}', '{"a":NaN}', '{"a":Infinity}', '{"a":-Infinity}',
    '{"a":nan}', '{"a":01}', '{"a":1.}', '{"a":.5}', '{"a":+1}', '{"a":"\x01"}', "{'a':1}",
    '{"a":1}x', '{"a":1} {"b":2}', '{"a":tru}', '{"a":"\\x"}', '{"a":"\\u12"}', "null", "1",
    '"s"', "true", '{"a":[1,2,3', '{"a" 1}', '{1:2}', "\ufeff{}", '{"a":"\u2028"}',
    '{"a":1.7976931348623157e308,"b":1.7976931348623159e308,"c":4.9e-324,"d":2.2250738585072014e-308}',
]


@pytest.mark.parametrize("text", BODIES)
def test_the_same_value_or_error_as_json_loads(text: str) -> None:
    ours, ref = _ours(text), _reference(text)
    assert ours[0] == ref[0], (text[:80], ours, ref)
    if ref[0] == "ok":
        assert _same(ours[1], ref[1]), text[:80]
    else:
        assert ours[1] == ref[1], text[:80]


def _random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, 1, 2**31, -(2**63), 2**64 + 1, rng.randrange(-10**30, 10**30)])
    if kind == 2:
        return rng.choice([0.0, -0.0, 0.1, 1e-300, 5e-324, 1.7976931348623157e308,
                           rng.uniform(-1e6, 1e6), rng.random() * 10 ** rng.randrange(-320, 309)])
    if kind in (3, 4):
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0xD800),
                                       rng.randrange(0xE000, 0x110000)]))
                       for _ in range(rng.randrange(12)))
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {str(_random_value(rng, 4)): _random_value(rng, depth + 1)
            for _ in range(rng.randrange(5))}


def test_random_documents_and_their_mutations() -> None:
    rng = random.Random(20261201)
    for _ in range(400):
        value = {"prompt": [rng.randrange(32000) for _ in range(rng.randrange(40))],
                 "x": _random_value(rng, 0)}
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5,
                          separators=rng.choice([(",", ":"), (", ", ": ")]))
        for candidate in (text, _mutated(rng, text)):
            ours, ref = _ours(candidate), _reference(candidate)
            assert ours[0] == ref[0] and (_same(ours[1], ref[1]) if ref[0] == "ok"
                                          else ours[1] == ref[1]), candidate[:120]


def _mutated(rng: random.Random, text: str) -> str:
    chars = list(text)
    for _ in range(rng.randrange(1, 4)):
        i = rng.randrange(len(chars))
        op = rng.randrange(3)
        if op == 0:
            del chars[i]
        elif op == 1:
            chars.insert(i, rng.choice('{}[]":,.-+eE0123456789 \\u tfn'))
        else:
            chars[i] = rng.choice('{}[]":,.-+eE0123456789 \\u')
    return "".join(chars)
