"""The `CostModel` protocol: how long one engine step takes, from the step's `BatchFeatures`.

Two models implement it: `sim.cost.roofline.RooflineCostModel` (first principles) and
`sim.cost.profile_model.ProfileCostModel` (fitted). Also here: the bulk form for runs of
plain decode steps, and the number check the cost dataclasses of `sim.cost` share.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from runtime.batch import BatchFeatures


@runtime_checkable
class CostModel(Protocol):
    """What the simulator asks of a cost model."""

    def step_time(self, features: BatchFeatures) -> float:
        """Seconds one engine step with these features takes (0 for an empty step)."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-ready parameters, recorded in the run's run.json."""
        ...


DecodeRunTimes = Callable[[int, int, int], list[float]]
"""(num_seqs, decode_kv_tokens, count) -> the `step_time` of `count` plain decode steps of
`num_seqs` sequences, step k reading `decode_kv_tokens + k * num_seqs` KV tokens."""


def decode_run_timer(model: CostModel) -> DecodeRunTimes | None:
    """The model's `decode_run_times` (the same floats as `step_time`, in bulk) when the
    class that defines its `step_time` defines one; None otherwise (time each step)."""
    cls = type(model)
    owner = next((k for k in cls.__mro__ if "step_time" in vars(k)), None)
    if (owner is not None and "decode_run_times" in vars(owner)
            and "step_time" not in getattr(model, "__dict__", {})):
        # ignore: not a CostModel attribute; `owner` (checked above) defines it
        return model.decode_run_times  # type: ignore[attr-defined,no-any-return]
    return None


# Shared by the cost dataclasses of `sim.cost` (private to the package).
def _check_number(owner: str, field: str, value: object, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{owner}.{field} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"{owner}.{field} must be a {kind} finite number, got {value!r}")
