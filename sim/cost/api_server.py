"""`ApiServerCost`: the API server's (front end's) time on a request, in seconds: before the
engine sees it (HTTP, validation, tokenization) and after each step (detokenization and
streaming a chunk to each client).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.cost.base import _check_number


@dataclass(frozen=True, slots=True)
class ApiServerCost:
    """The API server's time on a request before the engine sees it, and on its output.

    Attributes:
        per_request_s: HTTP handling, request validation and input processing per request.
            0.5 ms: an assumption of order of magnitude (an ASGI request with pydantic
            validation is ~0.1 ms; vLLM's chat templating and engine hand-off add more).
            Calibration replaces it.
        per_prompt_token_s: tokenization per prompt token. 1 µs: Hugging Face tokenizers
            (Rust) tokenize a GB of text in under 20 s on a server's CPU (its README), about
            12.5M tokens/s at ~4 bytes per token over all threads; one request is encoded on
            one thread, so ~1M tokens/s assuming ~12-16 threads in that figure.
        per_output_token_s: the output path, per token a step delivers: a step's tokens
            reach their clients `per_output_token_s · n` after the step ends, n = the tokens
            the step sampled (one pass over the step's outputs: detokenize, serialize, write
            each stream's chunk). 0 (the default) when the profile was fitted on engine-side
            times; `rt calibrate --from-run` fits it on client-side times.
    """

    per_request_s: float = 0.5e-3
    per_prompt_token_s: float = 1e-6
    per_output_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_request_s", "per_prompt_token_s", "per_output_token_s"):
            _check_number("ApiServerCost", name, getattr(self, name), positive=False)

    def time(self, prompt_len: int) -> float:
        """Seconds to accept and tokenize a prompt of `prompt_len` tokens."""
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 0:
            raise ValueError(f"prompt_len must be a non-negative integer, got {prompt_len!r}")
        return self.per_request_s + self.per_prompt_token_s * prompt_len

    def delivery_delay(self, num_tokens: int) -> float:
        """Seconds from a step's end until its `num_tokens` sampled tokens reach clients."""
        return self.per_output_token_s * num_tokens
