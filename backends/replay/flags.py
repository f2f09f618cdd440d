"""`rt replay --endpoint`'s flags (import-light: no httpx here, so the CLI can declare them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.flags import flag

ENDPOINT_PANEL = "OpenAI-compatible endpoint (--endpoint)"


@dataclass(frozen=True, slots=True)
class EndpointFlags:
    """Which OpenAI-compatible server to replay against and how the client behaves."""

    endpoint: str | None = flag(
        None, "--endpoint", "Replay against this OpenAI-compatible server instead "
        "(http://HOST:PORT, its /v1 or its /v1/completions URL). rt replay: the engine flags "
        "are then unused; rt fidelity: they are the server's (what it exports on /v1/models "
        "and /metrics is read: max_model_len, block size, KV blocks, prefix caching).",
        ENDPOINT_PANEL)
    served_model_name: str | None = flag(
        None, "--served-model-name", "Model name of the request body (default: the first of "
        "GET /v1/models).", ENDPOINT_PANEL)
    api_key: str | None = flag(None, "--api-key", "Bearer token for the endpoint.",
                               ENDPOINT_PANEL, envvar="OPENAI_API_KEY")
    max_concurrency: int | None = flag(None, "--max-concurrency", "Requests in flight at most "
                                       "(client-side, as vLLM bench).", ENDPOINT_PANEL)
    timeout: float = flag(600.0, "--timeout", "Seconds one request may take in all; then it "
                          "counts as failed.", ENDPOINT_PANEL)
    vocab_size: int = flag(32000, "--vocab-size", "Prompt token ids are drawn from [10, N): "
                           "at most the served model's vocabulary.", ENDPOINT_PANEL)

    def config_args(self, model: str | None, seed: int) -> dict[str, Any]:
        """Keyword arguments of `backends.replay.endpoint.EndpointConfig`."""
        assert self.endpoint is not None
        return {"url": self.endpoint, "model": self.served_model_name or model,
                "api_key": self.api_key, "max_concurrency": self.max_concurrency,
                "timeout_s": self.timeout, "vocab_size": self.vocab_size, "seed": seed}
