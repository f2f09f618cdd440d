"""`rt serve`'s own flags (import-light: no FastAPI here, so the CLI can declare them)."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.flags import check_bounds, flag

SERVER_PANEL = "Server"
MAX_SHUTDOWN_S = 24 * 3600.0  # --shutdown-timeout at most (s), as rt bench route's --soak
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's

# `rt serve --help`'s description of the command, beside its flags.
SERVE_HELP = """\
Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /tokenize,
/health, /metrics) from an engine-core process: a real model, or with --simulate the
cost model on the wall clock. SIGTERM/Ctrl-C drains, then exits. --gpu-memory-utilization:
default 0.92 with --simulate (`rt simulate`'s), else 0.9 (vLLM's); -tp needs --simulate.
"""


def check_api_key(key: str | None, source: str) -> None:
    """ValueError naming `source`, never the key, unless `key` (None: no key) can travel as
    `Authorization: Bearer KEY`: not empty, printable ASCII, no surrounding blanks (HTTP
    strips those). A key with a newline once reached an error line, secret and all; a
    non-ASCII one failed in the HTTP client's encoder, its source unnamed; rt serve took
    either and answered every request 401."""
    if key is None:
        return
    if not key:
        raise ValueError(f"{source} must not be empty")
    if not (key.isascii() and key.isprintable()) or key != key.strip():
        raise ValueError(f"{source} must be printable ASCII without surrounding blanks (it "
                         "goes in an HTTP header); the key given is not (not shown)")


@dataclass(frozen=True, slots=True)
class ServeFlags:
    """Where the server listens, what it calls itself, and how it sheds and drains load."""

    simulate: bool = flag(False, "--simulate", "Execution times from the cost model on the "
                          "wall clock, synthetic tokens (no model, no GPU).", SERVER_PANEL)
    host: str = flag("127.0.0.1", "--host", None, SERVER_PANEL)
    port: int = flag(8000, "--port", "0: a free port (the start-up line says which).",
                     SERVER_PANEL, bounds=(0, 65535))
    served_model_name: str | None = flag(None, "--served-model-name", "The name clients pass "
                                         "as `model`.", SERVER_PANEL)
    max_num_queued_requests: int | None = flag(
        None, "--max-num-queued-requests", "Answer 503 when this many requests await their "
        "first token.", SERVER_PANEL)
    shutdown_timeout: float = flag(10.0, "--shutdown-timeout", "On SIGTERM, seconds in-flight "
                                   "requests may finish before they are aborted.", SERVER_PANEL)
    uvicorn_log_level: str = flag("warning", "--uvicorn-log-level", None, SERVER_PANEL)
    api_key: str | None = flag(None, "--api-key", "Require `Authorization: Bearer KEY` on "
                               "/v1/* (401 otherwise), as vLLM.", SERVER_PANEL,
                               envvar="VLLM_API_KEY")
    max_request_bytes: int = flag(1 << 20, "--max-request-bytes", "Answer 413 to a request "
                                  "body longer than this.", SERVER_PANEL)
    enable_mfu_metrics: bool = flag(False, "--enable-mfu-metrics", "Estimate each step's "
                                    "FLOPs and bytes per GPU (vLLM's "
                                    "vllm:estimated_*_per_gpu counters).", SERVER_PANEL)

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.max_num_queued_requests is not None and self.max_num_queued_requests < 1:
            raise ValueError("--max-num-queued-requests must be >= 1, got "
                             f"{self.max_num_queued_requests}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        check_api_key(self.api_key, "--api-key (or VLLM_API_KEY)")
        # uvicorn takes whole seconds: NaN or inf was a traceback there, after the start-up
        # line; -1 drained for 1 s
        if not 0 <= self.shutdown_timeout <= MAX_SHUTDOWN_S:
            raise ValueError(f"--shutdown-timeout must be in [0, {MAX_SHUTDOWN_S:,.0f}] s, got "
                             f"{self.shutdown_timeout}")
        if self.uvicorn_log_level.lower() not in UVICORN_LOG_LEVELS:  # was uvicorn's KeyError
            raise ValueError(f"--uvicorn-log-level must be one of "
                             f"{', '.join(UVICORN_LOG_LEVELS)}, got {self.uvicorn_log_level!r}")


@dataclass(frozen=True, slots=True)
class ServeModelFlags:
    """`--model`: what `rt serve` serves, a checkpoint or with --simulate a simulated model."""

    model: str | None = flag(
        None, "--model", "Local Hugging Face model directory (default: the tiny random Llama "
        "on the CPU); with --simulate, the simulated model (preset or config, default "
        "llama-3.1-8b).", SERVER_PANEL, alias="--sim-model")
