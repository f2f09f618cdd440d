"""`ProfileCostModel`: step time as a fitted non-negative linear combination of the step
features, with coefficients loaded from a JSON profile (`sim.profile`) that calibration
(`sim.calibrate`) fits. Times are in seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from runtime.batch import BatchFeatures
from sim.cost.base import _check_number


@dataclass(frozen=True, slots=True)
class ProfileCoefficients:
    """Non-negative coefficients of the fitted step time (seconds per unit of each feature).

    step time = constant_s + per_prefill_token_s · num_prefill_tokens
              + per_decode_token_s · num_decode_tokens + per_seq_s · num_seqs
              + per_prefill_attention_pair_s · prefill_attention_pairs
              + per_decode_kv_token_s · decode_kv_tokens
    """

    constant_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_seq_s: float
    per_prefill_attention_pair_s: float
    per_decode_kv_token_s: float

    def __post_init__(self) -> None:
        for field in fields(self):
            _check_number(
                "ProfileCoefficients", field.name, getattr(self, field.name), positive=False
            )


class ProfileCostModel:
    """Step time as the fitted non-negative linear combination of `ProfileCoefficients`."""

    __slots__ = ("coefficients", "metadata")

    def __init__(
        self, coefficients: ProfileCoefficients, metadata: Mapping[str, Any] | None = None
    ) -> None:
        """`metadata`: JSON-ready facts about where the coefficients came from (device,
        model, date, file), copied into `describe()`."""
        self.coefficients = coefficients
        self.metadata: dict[str, Any] = dict(metadata or {})

    def step_time(self, features: BatchFeatures) -> float:
        """Seconds for one step; 0 for a step with no tokens."""
        prefill, decode = features.num_prefill_tokens, features.num_decode_tokens
        if prefill + decode <= 0:
            return 0.0
        c = self.coefficients
        return (
            c.constant_s
            + c.per_prefill_token_s * prefill
            + c.per_decode_token_s * decode
            + c.per_seq_s * features.num_seqs
            + c.per_prefill_attention_pair_s * features.prefill_attention_pairs
            + c.per_decode_kv_token_s * features.decode_kv_tokens
        )

    def decode_run_times(self, num_seqs: int, decode_kv_tokens: int,
                         count: int) -> list[float]:
        """`step_time` of `count` decode-only steps (see `RooflineCostModel`'s): the same
        floats, with the terms that do not change computed once."""
        if num_seqs <= 0:
            return [0.0] * count
        c = self.coefficients
        fixed = (
            c.constant_s
            + c.per_prefill_token_s * 0
            + c.per_decode_token_s * num_seqs
            + c.per_seq_s * num_seqs
            + c.per_prefill_attention_pair_s * 0
        )
        per_kv = c.per_decode_kv_token_s
        return [fixed + per_kv * (decode_kv_tokens + k * num_seqs) for k in range(count)]

    def describe(self) -> dict[str, Any]:
        """JSON-ready coefficients and the profile's metadata."""
        return {**self.metadata, "kind": "profile", "coefficients": asdict(self.coefficients)}

    def __repr__(self) -> str:
        return f"ProfileCostModel({self.coefficients!r})"
