"""How a request's tokens are chosen: options shared by the API server, the engine process
and the model runner (no torch here, so a simulated server never imports it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGIT_BIAS = 100.0  # vLLM clamps each bias into [-100, 100]


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """How a request's tokens are chosen. temperature 0 = greedy.

    Attributes:
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set whose probability reaches top_p (1 = all).
        seed: a per-request generator; None = the runner's shared seeded generator.
        min_tokens: while fewer outputs exist, `stop_token_ids` are masked out.
        stop_token_ids: EOS (unless ignored) and stop tokens, for the min_tokens mask.
        presence_penalty: subtracted once from each token the output holds, in [-2, 2].
        frequency_penalty: subtracted per occurrence in the output, in [-2, 2].
        repetition_penalty: > 0; a token of the prompt or the output has a positive logit
            divided by it, a negative one multiplied (1 = off).
        logit_bias: (token id, bias) pairs added to the logits, bias in [-100, 100].
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError("repetition_penalty must be a finite number greater than zero, "
                             f"got {self.repetition_penalty}")
        if any(not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS for _, bias in self.logit_bias):
            raise ValueError(f"logit_bias values must be in [-100, 100], got {self.logit_bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties changes the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


GREEDY = SamplingOptions()
