"""`rt replay`'s flags: its description, its trace argument and default workload, and the
--endpoint group (import-light: no httpx here, so the CLI can declare them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.serve.flags import check_api_key
from runtime.flags import flag
from workloads.flags import WorkloadFlags

ENDPOINT_PANEL = "OpenAI-compatible endpoint (--endpoint)"
# `rt replay`'s workload without a trace file or --dataset-name: a small synthetic trace.
DEFAULT_REPLAY = WorkloadFlags(dataset_name="random", num_prompts=32, input_len=96,
                               output_len=24, range_ratio=0.5, request_rate=8.0)
REPLAY_TRACE_HELP = ("Trace file (any `rt trace` format). Default: a small synthetic trace "
                     f"({DEFAULT_REPLAY.num_prompts} random requests at "
                     f"{DEFAULT_REPLAY.request_rate:g} req/s), unless --dataset-name is given.")


def replay_workload(work: WorkloadFlags, trace_file: Path | None) -> WorkloadFlags:
    """`work`, or without a trace file or --dataset-name `DEFAULT_REPLAY` (with --seed,
    --first-n and --time-scale)."""
    if trace_file is not None or work.dataset_name is not None:
        return work
    return dataclasses.replace(DEFAULT_REPLAY, seed=work.seed, first_n=work.first_n,
                               time_scale=work.time_scale)


# `rt replay --help`'s description of the command, beside its flags.
REPLAY_HELP = """\
Replay a trace in real time through the vLLM-V1 core and a real model (CPU or GPU),
or, with --endpoint, against any OpenAI-compatible server (client-side timing).

Requests are released at their arrival times on the wall clock; the output blocks and
the run directory are those of `rt simulate`. With no arguments: a tiny random Llama and
a small synthetic trace on the CPU. Ctrl-C writes the records so far.
"""


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

    def __post_init__(self) -> None:
        if self.endpoint is not None:  # an ambient OPENAI_API_KEY is never sent without one
            check_api_key(self.api_key, "--api-key (or OPENAI_API_KEY)")

    def config_args(self, model: str | None, seed: int) -> dict[str, Any]:
        """Keyword arguments of `backends.replay.endpoint.EndpointConfig`."""
        assert self.endpoint is not None
        return {"url": self.endpoint, "model": self.served_model_name or model,
                "api_key": self.api_key, "max_concurrency": self.max_concurrency,
                "timeout_s": self.timeout, "vocab_size": self.vocab_size, "seed": seed}
