"""`ApiServerCost`: the CPU time the API server spends on a request before the engine sees
it, in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.cost.base import _check_number


@dataclass(frozen=True, slots=True)
class ApiServerCost:
    """CPU time the API server spends on a request before the engine sees it, seconds.

    Attributes:
        per_request_s: HTTP handling, request validation and input processing per request.
            0.5 ms: an assumption of order of magnitude (an ASGI request with pydantic
            validation is ~0.1 ms; vLLM's chat templating and engine hand-off add more).
            Calibration replaces it.
        per_prompt_token_s: tokenization per prompt token. 1 µs: Hugging Face tokenizers
            (Rust) tokenize a GB of text in under 20 s on a server's CPU (its README), about
            12.5M tokens/s at ~4 bytes per token over all threads; one request is encoded on
            one thread, so ~1M tokens/s assuming ~12-16 threads in that figure.
    """

    per_request_s: float = 0.5e-3
    per_prompt_token_s: float = 1e-6

    def __post_init__(self) -> None:
        _check_number("ApiServerCost", "per_request_s", self.per_request_s, positive=False)
        _check_number(
            "ApiServerCost", "per_prompt_token_s", self.per_prompt_token_s, positive=False
        )

    def time(self, prompt_len: int) -> float:
        """Seconds to accept and tokenize a prompt of `prompt_len` tokens."""
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 0:
            raise ValueError(f"prompt_len must be a non-negative integer, got {prompt_len!r}")
        return self.per_request_s + self.per_prompt_token_s * prompt_len
