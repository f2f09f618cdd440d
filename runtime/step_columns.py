"""Appending a run of plain decode steps to the step columns (`Recorder.decode_steps`).

The step columns are `records.new_step_columns()`: one typed array per numeric field of
`StepRecord` ("q" int64, "d" float64), in field order, and `wait_reason` (a list) last. A
decode run appends `count` rows at once, column by column: the constant columns as repeated
typed arrays (a copy, not a conversion per value), the others packed by `struct` in the
column's typecode (the same doubles and int64s; array's own extend parses a format string
per item, ~2x the cost).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from struct import pack
from typing import Any


def _repeat(value: int, count: int) -> array[int]:
    """`count` copies of an int64 as a typed array (a step column's type)."""
    return array("q", (value,)) * count


def _packed(typecode: str, values: Sequence[int]) -> array[int]:
    """`array(typecode, values)`, converted by `struct`."""
    return array(typecode, pack(f"{len(values)}{typecode}", *values))


def extend_decode_run(typed: list[array[Any]], reasons: list[str | None], first_step: int,
                      starts: list[float], ends: list[float], durations: list[float],
                      num_seqs: int, decode_kv_tokens: int, kv_usages: list[float],
                      num_waiting: int, wait_reason: str | None) -> None:
    """Append the `len(ends)` rows of a decode run, steps `first_step`, ...: every running
    request (`num_seqs`) decodes one token; step k reads `decode_kv_tokens + k * num_seqs`
    KV tokens. `typed` are the numeric columns in StepRecord's order, `reasons` the
    wait_reason column."""
    count = len(ends)
    decode_kv = _packed("q", range(decode_kv_tokens, decode_kv_tokens + count * num_seqs,
                                   num_seqs)) if num_seqs else _repeat(decode_kv_tokens, count)
    zeros = _repeat(0, count)
    seqs = _repeat(num_seqs, count)
    columns: tuple[Sequence[float], ...] = (
        range(first_step, first_step + count), starts, ends, durations,
        zeros, seqs, seqs, zeros, zeros, zeros, decode_kv, decode_kv, kv_usages,
        seqs, _repeat(num_waiting, count), zeros, zeros,  # every running request decodes
    )
    for column, values in zip(typed, columns, strict=True):
        if isinstance(values, array):
            column.extend(values)
        else:
            column.frombytes(pack(f"{count}{column.typecode}", *values))
    reasons.extend([wait_reason] * count)
