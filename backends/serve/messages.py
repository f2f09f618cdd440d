"""The messages between `rt serve`'s API server and its engine-core process.

    API server  -> engine   ("add", EngineRequest), ("abort", [request ids]), ("shutdown", None)
    engine -> API server    ("ready", EngineInfo), ("failed", text), ("outputs", EngineOutputs)

Each is a pickled (kind, payload) tuple (`encode`, `decode`) on a local ZeroMQ socket.
Timestamps are `time.monotonic()` seconds, a clock every process of the machine shares.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from backends.engine.sampling_options import SamplingOptions
from runtime import CacheConfig, SamplingParams, SchedulerConfig
from runtime.perf import StepPerf


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A tokenized request handed to the engine core. `arrival_s`: monotonic seconds;
    `priority`: its key in the waiting queue under the priority policy (lower first, then
    earlier arrival); `cache_salt`: the prefix-cache hashes' salt (None: unsalted)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: SamplingOptions
    arrival_s: float
    priority: int = 0
    cache_salt: str | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as plain values (its two option dataclasses as their fields in order):
        the slotted dataclasses' default pickling walks `fields()` for each of the three,
        ~50 us per request of the API process's CPU for a 256-token prompt against ~12 us
        so (timeit at load ~8; docs/serve.md, "Admission at 200 streams")."""
        p, o = self.params, self.sampling
        return (_engine_request, (self.request_id, self.prompt_token_ids, self.arrival_s,
                                  (p.max_tokens, p.min_tokens, p.ignore_eos, p.eos_token_id,
                                   p.stop_token_ids),
                                  (o.temperature, o.top_p, o.top_k, o.seed, o.min_tokens,
                                   o.stop_token_ids, o.presence_penalty, o.frequency_penalty,
                                   o.repetition_penalty, o.logit_bias),
                                  self.priority, self.cache_salt))


def _engine_request(request_id: str, prompt_token_ids: list[int], arrival_s: float,
                    params: tuple[Any, ...], sampling: tuple[Any, ...], priority: int,
                    cache_salt: str | None) -> EngineRequest:
    """`EngineRequest.__reduce__`'s inverse (the engine process's side)."""
    return EngineRequest(request_id, prompt_token_ids, SamplingParams(*params),
                         SamplingOptions(*sampling), arrival_s, priority, cache_salt)


@dataclass(slots=True)
class RequestOutput:
    """A request's new tokens of one step; `finish_reason` set on its last output.

    `num_cached_tokens` (prompt tokens found in the prefix cache at the first admission) and
    `num_preemptions` (so far) are set on every output. The timing fields (monotonic
    seconds, engine clock) are filled on the last output: `queued_s` (entered the engine),
    `scheduled_s` (first admission), `first_token_s`, `last_token_s`; `queued_s` and
    `scheduled_s` on the first output too (a stop string the API server finds ends the
    request before the engine's last output)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    queued_s: float | None = None
    scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        """Pickled as the constructor's arguments, in field order: a step carries one per
        running request, and a slotted dataclass's default pickling (its state through
        `fields()` on every call) took ~2.5x longer to load and 2x to dump, a third larger
        (200 outputs: 110-140 us to load instead of 310-380)."""
        return (RequestOutput, (self.request_id, self.new_token_ids, self.finish_reason,
                                self.stop_reason, self.num_cached_tokens, self.num_preemptions,
                                self.queued_s, self.scheduled_s, self.first_token_s,
                                self.last_token_s))


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The scheduler after a step (or an abort). Prefix-cache counters are cumulative."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks in use, 0-1
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int  # in this step
    perf: StepPerf | None = None  # the step's estimate per GPU (--enable-mfu-metrics)


@dataclass(frozen=True, slots=True)
class EngineOutputs:
    timestamp: float  # monotonic seconds when the step ended
    outputs: list[RequestOutput]
    stats: SchedulerStats


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the API server learns from the engine once it is up."""

    scheduler: SchedulerConfig
    cache: CacheConfig
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    pid: int
    description: dict[str, Any] = field(default_factory=dict)


def encode(message: tuple[str, Any]) -> bytes:
    """The wire format: a pickled (kind, payload) tuple (protocol 5)."""
    return pickle.dumps(message, protocol=5)


def decode(data: bytes) -> tuple[str, Any]:
    # S301: a local socket between our own processes, so the data is encode()'s tuple
    message: tuple[str, Any] = pickle.loads(data)  # noqa: S301
    return message
