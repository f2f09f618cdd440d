"""`rt bench gpu`'s flags (torch-free, so the CLI can declare them without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.flags import check_bounds, flag


@dataclass(frozen=True, slots=True)
class GpuBenchFlags:
    """The engine-throughput section of `rt bench gpu`: which model, how many requests."""

    engine: bool = flag(True, "--engine/--no-engine", "Engine output tokens/s against "
                        "transformers' generate with static batching (goal >= 5x).")
    engine_model: str = flag("1b", "--engine-model", "1b or 3b (Llama-3.2 shape, random bf16 "
                             "weights built once under ~/.cache/rt), tiny, or a local model "
                             "directory.")
    engine_requests: int = flag(64, "--engine-requests")
    engine_prompt_len: int = flag(512, "--engine-prompt-len", "Mean prompt tokens.")
    engine_output_len: int = flag(128, "--engine-output-len", "New tokens each.")
    hf_batch_size: int | None = flag(None, "--hf-batch-size", "transformers' static batch "
                                     "size [default: as many as rt runs at once]")

    def __post_init__(self) -> None:
        for name in ("engine_requests", "engine_prompt_len", "engine_output_len",
                     "hf_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


# `rt bench serve --help`'s description of the command, beside its flags.
SERVE_BENCH_HELP = """\
Load-test `rt serve --simulate` on a free loopback port (bounded; the server is always
stopped): replay random requests through the chosen client, simulate the same arrivals
with `rt simulate`'s core, and report errors, throughput, each process's CPU seconds and
the latency the server path adds (server minus simulated, ms). With --soak, hold
--concurrency streams for SECONDS instead. Exit 1 on any error.
"""


# --concurrency at most: each stream is a loopback connection, and Linux lends ~28,000
# ephemeral ports to them all
MAX_STREAMS = 1 << 14


@dataclass(frozen=True, slots=True)
class ServeLoadFlags:
    """`rt bench serve`'s load: streams in flight, requests, the per-request bound."""

    concurrency: int = flag(200, "--concurrency", "Streams in flight at most (client-side).",
                            min=1, bounds=(1, MAX_STREAMS))
    num_prompts: int | None = flag(None, "--num-prompts", "Requests (default: --concurrency).",
                                   min=1)
    timeout: float = flag(300.0, "--timeout", "Seconds one request may take at most.")

    def __post_init__(self) -> None:
        check_bounds(self)  # --concurrency 1e20 was named as --num-prompts (its default)


@dataclass(frozen=True, slots=True)
class ServeBenchFlags:
    """`rt bench serve`'s client and soak mode."""
    client: str = flag("httpx", "--client", "httpx (rt replay --endpoint's client), lean "
                       "(HTTP/1.1 on asyncio streams: a client that does not starve at 200 "
                       "streams on 2 cores) or capture (keeps each read's bytes and time "
                       "during the run, parses them after it: the least client CPU while "
                       "the server runs).")
    soak: float | None = flag(None, "--soak", "Hold --concurrency streams for SECONDS "
                              "(bounded, loopback): errors, token-count mismatches, memory "
                              "and descriptors of both processes, KV blocks in use after.")
    engine_nice: int | None = flag(None, "--engine-nice", "The nice value of every thread "
                                   "of the engine-core process during the run (-20..19; "
                                   "below 0 needs root or CAP_SYS_NICE): its steps then "
                                   "wake on time on a busy machine.")

    def __post_init__(self) -> None:
        if self.client not in ("httpx", "lean", "capture"):
            raise ValueError(f"--client must be httpx, lean or capture, got {self.client!r}")
        if self.soak is not None and not 0 < self.soak <= 24 * 3600:
            raise ValueError(f"--soak must be in (0, 86400] seconds, got {self.soak}")
        if self.soak is not None and self.client != "httpx":
            raise ValueError(f"--client {self.client} is not used by --soak (its streams "
                             "are the soak's own): drop one of them")
        if self.engine_nice is not None and not -20 <= self.engine_nice <= 19:
            raise ValueError(f"--engine-nice must be in [-20, 19], got {self.engine_nice}")
