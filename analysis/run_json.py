"""run.json checked: what every reader of a run directory may rely on.

Every driver writes the same head (`analysis.rundir.run_info`; so has every run directory
since the first, d0b78eb):

    kind         "simulate" | "replay" | "endpoint": which driver wrote the run
    rt_version   str
    name         str
    trace        {"name": str | null, "requests": int >= 0, "digest": str}

then sections of its own. The head is required; the sections the readers index into
(timing, model, prefix_cache, fleet, scaling, endpoint) are checked where present. A
file without a head field, or with a field of the wrong type, is refused naming the file
and the field: `{}` was once reported as a run of no kind (exit 0), `"scaling": "x"` ended
in a TypeError and `"fleet": "x"` in an AttributeError (`rt calibrate --from-run`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("simulate", "replay", "endpoint")  # run.json "kind": the drivers that write runs


@dataclass(frozen=True, slots=True)
class Rule:
    """What a field's value must be: `want` in words (for the error line), `ok` its test."""

    want: str
    ok: Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def nullable(rule: Rule) -> Rule:
    return Rule(f"{rule.want} or null", lambda v: v is None or rule.ok(v))


def one_of(*values: str) -> Rule:
    return Rule("one of " + ", ".join(repr(v) for v in values),
                lambda v: isinstance(v, str) and v in values)


TEXT = Rule("a string", lambda v: isinstance(v, str))
COUNT = Rule("an integer >= 0", lambda v: _is_int(v) and v >= 0)
POSITIVE = Rule("an integer >= 1", lambda v: _is_int(v) and v >= 1)
NUMBER = Rule("a number", _is_number)
OBJECT = Rule("an object", lambda v: isinstance(v, dict))
LIST = Rule("a list", lambda v: isinstance(v, list))
NUMBERS = Rule("a list of numbers", lambda v: isinstance(v, list) and all(map(_is_number, v)))
COUNTS = Rule("a non-empty list of integers >= 0",  # replica counts over time
              lambda v: isinstance(v, list) and bool(v) and all(COUNT.ok(x) for x in v))

# (field, rule, required): a dotted path, "[]" for each element of a list; parents before
# their fields. A required field of an optional section is required where the section is
# an object (absent or null: nothing under it is checked).
FIELDS: tuple[tuple[str, Rule, bool], ...] = (
    ("kind", one_of(*KINDS), True),
    ("rt_version", TEXT, True),
    ("name", TEXT, True),
    ("trace", OBJECT, True),
    ("trace.name", nullable(TEXT), True),  # workloads.Trace.name: free text or None
    ("trace.requests", COUNT, True),
    ("trace.digest", TEXT, True),
    ("timing", one_of("client", "engine"), False),  # "client": no engine-side times
    ("model", OBJECT, False),
    ("model.name", nullable(TEXT), False),
    ("prefix_cache", OBJECT, False),  # the scheduler's counters, tokens
    ("prefix_cache.queries", COUNT, True),
    ("prefix_cache.hits", COUNT, True),
    ("fleet", nullable(OBJECT), False),
    ("fleet.replicas", POSITIVE, False),
    ("fleet.pools", nullable(LIST), False),
    ("fleet.pools[]", OBJECT, True),
    ("scaling", nullable(OBJECT), False),  # sim.autoscale.ScalingTimeline.to_json
    ("scaling.policy", nullable(TEXT), False),
    ("scaling.interval_s", nullable(NUMBER), False),
    ("scaling.end_s", NUMBER, True),
    ("scaling.gpu_hours", NUMBER, True),
    ("scaling.cost", NUMBER, True),
    ("scaling.pools", LIST, True),
    ("scaling.pools[]", OBJECT, True),
    ("scaling.pools[].name", TEXT, True),
    ("scaling.pools[].cost_per_hour", NUMBER, False),
    ("scaling.pools[].gpu_hours", NUMBER, True),
    ("scaling.pools[].cost", NUMBER, True),
    ("scaling.pools[].times_s", NUMBERS, True),
    ("scaling.pools[].serving", COUNTS, True),
    ("scaling.pools[].provisioned", COUNTS, True),
    ("endpoint", OBJECT, False),
    ("endpoint.max_model_len", nullable(COUNT), False),
    ("endpoint.cache_config", nullable(OBJECT), False),
)


def check_run_info(info: dict[str, Any], file: Path) -> dict[str, Any]:
    """`info` (run.json's object) when every field of `FIELDS` is as its rule says;
    ValueError naming `file` and the first field missing or of the wrong type."""
    for path, rule, required in FIELDS:
        problem = _problem(info, path, rule, required)
        if problem is not None:
            raise ValueError(f"{file}: {problem}")
    return info


def _problem(info: dict[str, Any], path: str, rule: Rule, required: bool) -> str | None:
    """What is wrong with the field `path` in `info` (the first of its values when under a
    list), or None."""
    *parents, last = path.split(".")
    for prefix, holder in _holders(info, parents):
        key = last.removesuffix("[]")
        if key not in holder:
            if required and not last.endswith("[]"):
                return f"field {prefix + key!r} is missing"
            continue
        if not last.endswith("[]"):
            value = holder[key]
            if not rule.ok(value):
                return f"field {prefix + key!r} must be {rule.want}, got {_shown(value)}"
        elif isinstance(holder[key], list):
            for i, value in enumerate(holder[key]):
                if not rule.ok(value):
                    return (f"field '{prefix}{key}[{i}]' must be {rule.want}, got "
                            f"{_shown(value)}")
    return None


def _holders(info: dict[str, Any], parents: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The objects the path `parents` leads to, each with its name as a prefix ("scaling.",
    "scaling.pools[0]."); a part absent, null or not an object leads nowhere (its own rule
    has judged it)."""
    found: list[tuple[str, dict[str, Any]]] = [("", info)]
    for part in parents:
        key, each = part.removesuffix("[]"), part.endswith("[]")
        step: list[tuple[str, dict[str, Any]]] = []
        for prefix, holder in found:
            value = holder.get(key)
            if each and isinstance(value, list):
                step += [(f"{prefix}{key}[{i}].", v) for i, v in enumerate(value)
                         if isinstance(v, dict)]
            elif not each and isinstance(value, dict):
                step.append((f"{prefix}{key}.", value))
        found = step
    yield from found


def _shown(value: Any, width: int = 60) -> str:
    """`value` as JSON on one line, cut to `width` characters."""
    text = json.dumps(value)
    return text if len(text) <= width else text[:width - 3] + "..."
