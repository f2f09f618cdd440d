"""Prometheus metrics of `rt serve`, by vLLM's names, types, labels and buckets.

Source of the conventions: vLLM's `v1/metrics/loggers.py` (PrometheusStatLogger),
`v1/metrics/perf.py` (PerfMetricsProm) and `v1/metrics/buckets.py`. Labels are `model_name`
and `engine` ("0": one engine core); `admission_rejections` has `model_name` and `reason`.
prometheus-client adds `_total` to counters and `_bucket`/`_sum`/`_count` to histograms.
Times are seconds. The families of features rt does not have (KV connector, multimodal
cache, sleep mode, MFU estimates without --enable-mfu-metrics) and the label values vLLM
fills at start-up (admission reasons, cache tiers, sleep states) have their children from
the start, as vLLM's: exported with `_created`, at vLLM's value for an engine without the
feature.

Where the values come from: gauges from the engine's scheduler stats after every step or
abort; TTFT and E2E from the API server's clock (arrival = the request reached the handler);
ITL and the phase times from the engine's step timestamps (one ITL sample per output).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import values as _values

from runtime.perf import StepPerf

REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# vLLM's label values: admission limits (loggers.ADMISSION_REASONS), the cache tiers that can
# supply prompt tokens (cache_hit_source.CacheHitSource), the sleep states and their values
# for an awake engine (record_sleep_state's defaults).
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
SLEEP_STATES = {"awake": 1, "weights_offloaded": 0, "discard_all": 0}


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including `max_value` (vLLM's build_1_2_5_buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def _add(value: Any, amount: float) -> None:
    """Add `amount` to a histogram's sum or bucket count. The API server updates and exports
    its metrics from one thread (the event loop's; /metrics is served there too), so the
    lock each prometheus-client value takes in `inc` guards nothing here: a request's 13
    observations were 26 lock round trips (`on_finished` 12.0 us -> 4.7 us with this and
    its counter looked up once; docs/serve.md, "The API process's CPU per request and per
    token"). The same float additions in the same order, so the exported text is
    unchanged. A value of another kind (multiprocess mode, PROMETHEUS_MULTIPROC_DIR: mmap
    files) is told by its type, not once at import, and goes through its own `inc`."""
    if type(value) is _values.MutexValue:
        value._value += amount
    else:
        value.inc(amount)


def observe_all(histogram: Histogram, values: list[float]) -> None:
    """`histogram.observe(v)` for each of `values` in order, in one pass: the bucket by
    bisection (the first upper bound >= v, as `observe` scans for; a NaN falls in none), the
    sum added in the same order (so bit-identical), one increment per bucket. Reaches into
    prometheus-client's `Histogram` (`_upper_bounds`, `_buckets`, `_sum`);
    tests/backends/serve/test_sse.py checks it against `observe`."""
    if not values:
        return
    bounds = histogram._upper_bounds
    counts: dict[int, int] = {}
    total = histogram._sum.get()
    for value in values:
        total += value
        if value == value:  # not NaN
            i = bisect_left(bounds, value)
            counts[i] = counts.get(i, 0) + 1
    histogram._sum.set(total)
    buckets = histogram._buckets
    for i, n in counts.items():
        _add(buckets[i], n)


def observe_one(histogram: Histogram, value: float) -> None:
    """`histogram.observe(value)` with the bucket by bisection instead of a scan over every
    bound: a finished request observes 13 histograms (~85 us through `observe` on this
    machine at load, ~25 us so); the same sum and counts (see `observe_all`)."""
    _add(histogram._sum, value)
    if value == value:  # not NaN
        _add(histogram._buckets[bisect_left(histogram._upper_bounds, value)], 1)


class ServeMetrics:
    """The registry and its metrics; the API server calls the `on_*` methods."""

    def __init__(self, model_name: str, max_model_len: int, num_gpu_blocks: int,
                 block_size: int, prefix_caching: bool) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": "0"}
        self.model_name = model_name
        self._prefix = (0, 0)  # cumulative (queries, hits) seen so far
        sizes = buckets_1_2_5(max_model_len)
        self._gauges()
        self._counters()
        self._absent_features()
        self._histograms(sizes)
        info = Gauge("vllm:cache_config_info", "Information of the KV cache configuration.",
                     ["engine", "num_gpu_blocks", "block_size", "enable_prefix_caching"],
                     registry=self.registry)
        info.labels("0", str(num_gpu_blocks), str(block_size), str(prefix_caching)).set(1)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, list(self.labels), registry=self.registry).labels(**self.labels)

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, [*self.labels, *extra], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, list(self.labels), buckets=buckets,
                         registry=self.registry).labels(**self.labels)

    def _gauges(self) -> None:
        self.running = self._gauge("vllm:num_requests_running",
                                   "Number of requests in model execution batches.")
        self.waiting = self._gauge("vllm:num_requests_waiting",
                                   "Number of requests waiting to be processed.")
        by_reason = Gauge("vllm:num_requests_waiting_by_reason",
                          "Waiting requests by reason.", [*self.labels, "reason"],
                          registry=self.registry)
        self.waiting_capacity = by_reason.labels(**self.labels, reason="capacity")
        by_reason.labels(**self.labels, reason="deferred").set(0)
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc",
                                    "KV-cache usage. 1 means 100 percent usage.")
        sleep = Gauge("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine "
                      "is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 "
                      "means sleep level 1; discard_all = 1 means sleep level 2.",
                      [*self.labels, "sleep_state"], registry=self.registry)
        for state, value in SLEEP_STATES.items():  # rt never sleeps: always awake
            sleep.labels(**self.labels, sleep_state=state).set(value)

    def _counters(self) -> None:
        lab = self.labels
        self.prefix_queries = self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
            "queried tokens.").labels(**lab)
        self.prefix_hits = self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
            "tokens.").labels(**lab)
        self.preemptions = self._counter("vllm:num_preemptions",
                                         "Cumulative number of preemption from the engine."
                                         ).labels(**lab)
        self.prompt_tokens = self._counter("vllm:prompt_tokens",
                                           "Number of prefill tokens processed.").labels(**lab)
        by_source = self._counter("vllm:prompt_tokens_by_source",
                                  "Prompt tokens by source.", ("source",))
        self.prompt_computed = by_source.labels(**lab, source="local_compute")
        self.prompt_cache_hit = by_source.labels(**lab, source="local_cache_hit")
        by_source.labels(**lab, source="external_kv_transfer")
        self.prompt_cached = self._counter("vllm:prompt_tokens_cached",
                                           "Cached prompt tokens.").labels(**lab)
        cached_by_source = self._counter(
            "vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier "
            "that supplied them (device, host, p2p, disk, external_unspecified); sums to "
            "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.", ("source",))
        children = {source: cached_by_source.labels(**lab, source=source)
                    for source in CACHE_HIT_SOURCES}
        self.prompt_cached_device = children["device"]  # rt's only tier: the KV pool
        self.generation_tokens = self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.").labels(**lab)
        self.success = self._counter("vllm:request_success",
                                     "Count of successfully processed requests.",
                                     ("finished_reason",))
        # the finished reasons' children, looked up once (`labels` per request: ~3 us)
        self.success_by_reason = {reason: self.success.labels(**lab, finished_reason=reason)
                                  for reason in ("stop", "length", "abort")}
        rejections = Counter("vllm:admission_rejections", "Number of admission attempts "
                             "rejected by a queue limit, by reason.", ["model_name", "reason"],
                             registry=self.registry)
        self.rejections = {reason: rejections.labels(model_name=self.model_name, reason=reason)
                           for reason in ADMISSION_REASONS}

    def _absent_features(self) -> None:
        """The counters of what rt has not: MFU estimates (moved only with
        --enable-mfu-metrics, see `on_perf`), a KV connector's external prefix cache, the
        multimodal cache. vLLM registers them all, with a child per engine, whatever the
        configuration."""
        lab = self.labels
        estimate = "(for Model Flops Utilization calculations)."
        self.flops = self._counter("vllm:estimated_flops_per_gpu_total", "Estimated number "
                                   f"of floating point operations per GPU {estimate}"
                                   ).labels(**lab)
        self.read_bytes = self._counter("vllm:estimated_read_bytes_per_gpu_total", "Estimated "
                                        f"number of bytes read from memory per GPU {estimate}"
                                        ).labels(**lab)
        self.write_bytes = self._counter("vllm:estimated_write_bytes_per_gpu_total",
                                         "Estimated number of bytes written to memory per GPU "
                                         f"{estimate}").labels(**lab)
        for name, doc in (
                ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV "
                 "connector cross-instance cache sharing, in terms of number of queried "
                 "tokens."),
                ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV "
                 "connector cross-instance cache sharing, in terms of number of cached "
                 "tokens."),
                ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of "
                 "queried items."),
                ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached "
                 "items.")):
            self._counter(name, doc).labels(**lab)

    def _histograms(self, sizes: list[int]) -> None:
        h = self._histogram
        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token "
                      "in seconds.", TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency "
                     "in seconds.", ITL_BUCKETS)
        self.tpot = h("vllm:request_time_per_output_token_seconds", "Histogram of "
                      "time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency "
                     "in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = h("vllm:request_queue_time_seconds", "Histogram of time spent in "
                       "WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = h("vllm:request_inference_time_seconds", "Histogram of time spent "
                           "in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = h("vllm:request_prefill_time_seconds", "Histogram of time spent in "
                         "PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = h("vllm:request_decode_time_seconds", "Histogram of time spent in "
                        "DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_len = h("vllm:request_prompt_tokens", "Number of prefill tokens "
                            "processed.", sizes)
        self.gen_len = h("vllm:request_generation_tokens", "Number of generation tokens "
                         "processed.", sizes)
        self.max_gen_len = h("vllm:request_max_num_generation_tokens", "Histogram of maximum "
                             "number of requested generation tokens.", sizes)
        self.max_tokens = h("vllm:request_params_max_tokens", "Histogram of the max_tokens "
                            "request parameter.", sizes)
        self.kv_computed = h("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV "
                             "tokens computed during prefill (excluding cached tokens).", sizes)
        self.iteration = h("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                           "engine_step.", ITERATION_TOKENS_BUCKETS)
        self.params_n = h("vllm:request_params_n", "Histogram of the n request parameter.",
                          N_BUCKETS)
        self.num_preemptions = h("vllm:request_num_preemptions", "Number of preemptions per "
                                 "request.", PREEMPTION_BUCKETS)

    # ---- events ------------------------------------------------------------------------

    def on_rejected(self, reason: str = "max_num_queued_reqs") -> None:
        """A request refused at admission; `reason` one of ADMISSION_REASONS (KeyError
        otherwise, as vLLM's)."""
        self.rejections[reason].inc()

    def on_perf(self, perf: StepPerf | None) -> None:
        """One step's estimated FLOPs and bytes per GPU (None: not estimated, the default).
        As vLLM's PerfMetricsProm.observe, a step estimated at all zeros adds nothing (not
        even a zero increment)."""
        if perf is None or not (perf.flops or perf.read_bytes or perf.write_bytes):
            return
        self.flops.inc(perf.flops)
        self.read_bytes.inc(perf.read_bytes)
        self.write_bytes.inc(perf.write_bytes)

    def on_stats(self, running: int, waiting: int, kv_usage: float, prefix_queries: int,
                 prefix_hits: int, preemptions: int) -> None:
        """Scheduler stats after a step; prefix counters are cumulative."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.waiting_capacity.set(waiting)
        self.kv_usage.set(kv_usage)
        queries, hits = self._prefix
        if prefix_queries > queries:
            self.prefix_queries.inc(prefix_queries - queries)
        if prefix_hits > hits:  # vLLM: prefix hits are the device tier's cached tokens
            self.prefix_hits.inc(prefix_hits - hits)
            self.prompt_cached_device.inc(prefix_hits - hits)
        self._prefix = (max(queries, prefix_queries), max(hits, prefix_hits))
        if preemptions:
            self.preemptions.inc(preemptions)

    def on_first_output(self, prompt_len: int, cached: int, ttft_s: float) -> None:
        """A request's first output (its first token), with `cached` = prompt tokens found
        in the prefix cache at its first admission. As vLLM 0.32 (v1/metrics/stats.py
        PromptTokenStats.update_from_output on the prefilling output, loggers.py record):
        prompt_tokens += prompt_len, prompt_tokens_by_source{local_compute} += prompt_len -
        cached, {local_cache_hit} += cached, prompt_tokens_cached += cached."""
        self.prompt_tokens.inc(prompt_len)
        self.prompt_computed.inc(prompt_len - cached)
        self.prompt_cache_hit.inc(cached)
        self.prompt_cached.inc(cached)
        observe_one(self.ttft, ttft_s)

    def on_tokens(self, count: int, itls_s: list[float]) -> None:
        """One step's `count` new tokens and the ITL samples (one per output that was not a
        request's first), in bulk: the same values as `count` increments and one `observe`
        per sample in order (see `observe_all`)."""
        if count:
            self.generation_tokens.inc(count)
        observe_all(self.itl, itls_s)

    def on_iteration(self, tokens: int) -> None:
        """One engine step's outputs: `tokens` = the computed (not cached) prompt tokens of
        the requests whose first token came in this step + the new tokens of all of them.
        vLLM 0.32 observes `prompt_token_stats.computed + num_generation_tokens` once per
        engine output batch that has outputs (loggers.py, histogram_iteration_tokens)."""
        if tokens:
            observe_one(self.iteration, tokens)

    def finished_reason(self, reason: str) -> Counter:
        """`vllm:request_success`'s child of `reason`."""
        child = self.success_by_reason.get(reason)
        return child if child is not None else \
            self.success.labels(**self.labels, finished_reason=reason)

    def on_finished(self, reason: str, *, prompt_len: int, output_len: int, max_tokens: int,
                    cached: int, e2e_s: float, queue_s: float | None, prefill_s: float | None,
                    decode_s: float | None, inference_s: float | None,
                    num_preemptions: int) -> None:
        """A finished request (any reason); phase times None when it never reached them."""
        self.finished_reason(reason).inc()
        observe_one(self.e2e, e2e_s)
        for hist, value in ((self.queue, queue_s), (self.prefill, prefill_s),
                            (self.decode, decode_s), (self.inference, inference_s)):
            if value is not None:
                observe_one(hist, max(value, 0.0))
        if output_len > 1 and decode_s is not None:
            observe_one(self.tpot, decode_s / (output_len - 1))
        observe_one(self.prompt_len, prompt_len)
        observe_one(self.gen_len, output_len)
        observe_one(self.max_tokens, max_tokens)
        observe_one(self.kv_computed, prompt_len - cached)
        observe_one(self.num_preemptions, num_preemptions)

    def on_parent_finished(self, n: int, max_num_generation_tokens: int) -> None:
        """An API request whose engine requests all finished (not aborted): its `n` and the
        most tokens one of them generated. vLLM 0.32 observes these once per request, after
        its last child (ParentRequest.observe_finished_request), the rest per child."""
        observe_one(self.max_gen_len, max_num_generation_tokens)
        observe_one(self.params_n, n)
