"""Scaling policies: how many replicas a pool wants, from what the autoscaler sees at a tick
(`PoolObservation`: its serving replicas' metrics and its traffic over the last interval).

    kv-threshold    llm-d's workload variant autoscaler (WVA) as BLIS models it: one more
                    replica when the pool is saturated, one fewer after a calm window.
    dynamo-planner  Dynamo's throughput-based SLA planner: replica counts from the predicted
                    load and the per-GPU throughput the engine reaches within the TTFT/ITL
                    targets (its perf model: `EngineBench`, the replica's own cost model).

A policy returns the replicas it wants; the autoscaler (`sim.autoscale`) clamps that to the
pool's [min, max] and starts or drains replicas.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.batch import BatchFeatures
from runtime.router import ReplicaSnapshot
from sim.cost.base import CostModel
from sim.simulator import SimConfig

POLICIES = ("kv-threshold", "dynamo-planner")
DEFAULT_INTERVAL_S = {"kv-threshold": 10.0, "dynamo-planner": 180.0}


@dataclass(frozen=True, slots=True)
class WindowStats:
    """A pool's traffic over the last interval: the requests that reached it, and means over
    those that finished in it (None when none did). Times in seconds."""

    num_requests: int = 0
    num_finished: int = 0
    mean_prompt_len: float | None = None
    mean_output_len: float | None = None
    mean_ttft_s: float | None = None
    mean_itl_s: float | None = None  # (E2E - TTFT) / (output tokens - 1), per request
    mean_duration_s: float | None = None  # E2E


@dataclass(frozen=True, slots=True)
class PoolObservation:
    """What a policy sees at a tick."""

    now_s: float
    interval_s: float
    current: int  # replicas wanted at the last tick: serving or starting
    serving: Sequence[ReplicaSnapshot]  # metrics of the replicas taking traffic
    window: WindowStats
    starting: int = 0  # replicas started but not yet serving


class ScalingPolicy(Protocol):
    def desired(self, obs: PoolObservation) -> int:
        """Replicas the pool should have (before the [min, max] clamp)."""
        ...


@dataclass(slots=True)
class KvThreshold:
    """llm-d WVA thresholds, as BLIS's autoscaler models them (inference-sim
    `sim/cluster/autoscaler.go`, README: tick 10 s, scale up above 0.8 KV use, down below
    0.3, 5-minute down-stabilisation window):

        up     mean KV usage > scale_up_kv, or mean waiting queue >= scale_up_waiting
               (WVA's queueLengthThreshold, 5): current + 1;
        down   mean KV usage < scale_down_kv at every tick for down_window_s (the window
               restarts after each step down and on any tick not below): current - 1;
        else   current.
    Means are over the serving replicas and the starting ones, counted empty (WVA's
    saturation analyzer "includes pending replicas to avoid excessive scale-up").
    Scale-up has no window (HPA's default, 0 s)."""

    scale_up_kv: float = 0.8
    scale_down_kv: float = 0.3
    scale_up_waiting: float = 5.0
    down_window_s: float = 300.0
    _low_since: float | None = field(default=None, repr=False)

    def desired(self, obs: PoolObservation) -> int:
        serving, current, now = obs.serving, obs.current, obs.now_s
        if not serving:
            return current
        n = len(serving) + obs.starting
        kv = sum(s.kv_usage for s in serving) / n
        waiting = sum(s.num_waiting for s in serving) / n
        if kv > self.scale_up_kv or waiting >= self.scale_up_waiting:
            self._low_since = None
            return current + 1
        if kv >= self.scale_down_kv:
            self._low_since = None
            return current
        if self._low_since is None:
            self._low_since = now
        if now - self._low_since >= self.down_window_s:
            self._low_since = None  # a new window starts at the next low tick
            return current - 1
        return current


@dataclass(frozen=True, slots=True)
class EngineBench:
    """One replica's performance, measured on its own cost model the way Dynamo's profiler
    sweeps an engine before deployment (prefill: TTFT and tokens/s/GPU against ISL; decode:
    ITL and tokens/s/GPU against batch size and context)."""

    cost_model: CostModel
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_tokens: int  # the KV pool's capacity in tokens
    gpus: int

    @classmethod
    def of(cls, config: SimConfig, cost_model: CostModel, gpus: int) -> EngineBench:
        cache, sched = config.cache, config.scheduler
        return cls(cost_model, sched.max_num_batched_tokens, sched.max_num_seqs,
                   cache.num_usable_blocks * cache.block_size, gpus)

    def prefill_s(self, isl: float) -> float:
        """Seconds to prefill one prompt of `isl` tokens alone (chunked by the token budget):
        the TTFT the profile expects."""
        total, done, left = 0.0, 0, max(1, round(isl))
        while left > 0:
            q = min(left, self.max_num_batched_tokens)
            total += self.cost_model.step_time(BatchFeatures(
                num_prefill_tokens=q, num_seqs=1, num_prefill_seqs=1,
                prefill_attention_pairs=q * done + q * (q + 1) // 2, prefill_kv_tokens=done + q))
            done, left = done + q, left - q
        return total

    def prefill_tokens_per_gpu_s(self, isl: float) -> float:
        return max(1.0, isl) / self.prefill_s(isl) / self.gpus

    def decode_itl_s(self, batch: int, context: float) -> float:
        """One decode step of `batch` sequences of `context` tokens each."""
        c = max(1, round(context))
        return self.cost_model.step_time(BatchFeatures(
            num_decode_tokens=batch, num_seqs=batch, decode_kv_tokens=batch * (c + 1)))

    def best_decode_tokens_per_gpu_s(self, itl_s: float, context: float) -> float:
        """Output tokens/s/GPU at the largest batch whose step stays within `itl_s` (and
        whose KV fits); batch 1 if none does (Dynamo's `find_best_throughput_per_gpu`)."""
        top = max(1, min(self.max_num_seqs, int(self.kv_tokens // max(1.0, context + 1))))
        lo, hi = 1, top
        while lo < hi:  # the largest batch with itl(batch) <= itl_s; itl grows with batch
            mid = (lo + hi + 1) // 2
            if self.decode_itl_s(mid, context) <= itl_s:
                lo = mid
            else:
                hi = mid - 1
        return lo / self.decode_itl_s(lo, context) / self.gpus


@dataclass(slots=True)
class DynamoPlanner:
    """Dynamo's throughput-based SLA planner (ai-dynamo/dynamo
    `components/planner/src/dynamo/planner/utils/planner_core.py`,
    `_compute_replica_requirements`; docs "Planner Design"; defaults `SLAPlannerDefaults`:
    adjustment_interval 180 s, ttft 500 ms, itl 50 ms, min_endpoint 1). Every interval:

        correction   p = observed mean TTFT / bench TTFT(isl);
                     d = observed mean ITL / bench ITL(concurrency, isl + osl/2),
                     concurrency = num_req / serving replicas * mean duration / interval
        predict      next num_req, isl, osl = the last interval's (Dynamo's "constant"
                     predictor; its default is ARIMA)
        prefill      num_p = ceil(num_req * isl / interval * min(1, p)
                                  / prefill_tokens_per_gpu(isl) / gpus_per_engine)
        decode       num_d = ceil(num_req * osl / interval
                                  / best_decode_tokens_per_gpu(itl / d, isl + osl/2)
                                  / gpus_per_engine)
    A "prefill" pool wants num_p, a "decode" pool num_d. An aggregated ("both") pool (rt's
    adaptation: Dynamo sizes the two pools apart) wants ceil of the sum of the two fractions,
    since one engine shares its time between prefill and decode. An interval in which no
    request finished is skipped (Dynamo skips metrics that are NaN)."""

    bench: EngineBench
    ttft_ms: float = 500.0
    itl_ms: float = 50.0
    role: str = "both"
    correction: bool = True
    p_correction: float = 1.0
    d_correction: float = 1.0

    def desired(self, obs: PoolObservation) -> int:
        w = obs.window
        if (w.num_finished == 0 or w.mean_prompt_len is None or w.mean_output_len is None
                or w.mean_ttft_s is None):
            return obs.current
        isl, osl = w.mean_prompt_len, w.mean_output_len
        if self.correction:
            self._correct(obs, isl, osl)
        rate = w.num_requests / obs.interval_s  # requests/s predicted for the next interval
        bench = self.bench
        prefill_gpus = (rate * isl * min(1.0, self.p_correction)
                        / bench.prefill_tokens_per_gpu_s(isl))
        itl_s = self.itl_ms / 1e3 / (self.d_correction if self.d_correction > 0 else 1.0)
        decode_gpus = rate * osl / bench.best_decode_tokens_per_gpu_s(itl_s, isl + osl / 2)
        num_p = math.ceil(prefill_gpus / bench.gpus)
        num_d = math.ceil(decode_gpus / bench.gpus)
        if self.role == "prefill":
            return num_p
        if self.role == "decode":
            return num_d
        return math.ceil((prefill_gpus + decode_gpus) / bench.gpus)

    def _correct(self, obs: PoolObservation, isl: float, osl: float) -> None:
        w = obs.window
        assert w.mean_ttft_s is not None
        self.p_correction = w.mean_ttft_s / self.bench.prefill_s(isl)
        if w.mean_itl_s is None or w.mean_duration_s is None or not obs.serving:
            return
        concurrency = (w.num_requests / len(obs.serving) * w.mean_duration_s
                       / obs.interval_s)
        expected = self.bench.decode_itl_s(max(1, round(concurrency)), isl + osl / 2)
        self.d_correction = w.mean_itl_s / expected


def make_scaling_policy(name: str, args: Sequence[str], bench: EngineBench,
                        role: str = "both") -> ScalingPolicy:
    """A fresh policy by CLI name with `KEY=VALUE` arguments (its numeric or boolean
    fields); ValueError naming a bad name, key or value."""
    values = scaling_args(name, args)
    if name == "dynamo-planner":
        return DynamoPlanner(bench=bench, role=role, **values)
    return KvThreshold(**values)


def scaling_args(name: str, args: Sequence[str]) -> dict[str, Any]:
    """Policy `name`'s `KEY=VALUE` arguments by field (checked before any engine is built);
    ValueError naming a bad name, key or value."""
    kinds: dict[str, type[Any]] = {"kv-threshold": KvThreshold, "dynamo-planner": DynamoPlanner}
    if name not in kinds:
        raise ValueError(f"--autoscale: unknown policy {name!r} (policies: "
                         f"{', '.join(POLICIES)})")
    defaults = {f.name: f.default for f in dataclasses.fields(kinds[name])
                if not f.name.startswith("_")
                and f.name not in ("bench", "role", "p_correction", "d_correction")}
    values: dict[str, Any] = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in defaults:
            raise ValueError(f"--autoscale-arg {arg!r}: {name} takes KEY=VALUE with KEY one "
                             f"of {', '.join(defaults)}")
        values[key] = _value(arg, defaults[key], raw.strip())
    return values


def _value(arg: str, default: object, raw: str) -> float | bool:
    if isinstance(default, bool):
        if raw.lower() not in ("true", "false"):
            raise ValueError(f"--autoscale-arg {arg!r}: the value must be true or false")
        return raw.lower() == "true"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"--autoscale-arg {arg!r}: the value must be a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"--autoscale-arg {arg!r}: the value must be a number >= 0")
    return value
