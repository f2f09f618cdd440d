"""How a request's tokens are chosen: options shared by the API server, the engine process
and the model runner (no torch here, so a simulated server never imports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """How a request's tokens are chosen. temperature 0 = greedy.

    Attributes:
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set whose probability reaches top_p (1 = all).
        seed: a per-request generator; None = the runner's shared seeded generator.
        min_tokens: while fewer outputs exist, `stop_token_ids` are masked out.
        stop_token_ids: EOS (unless ignored) and stop tokens, for the min_tokens mask.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingOptions()
