"""The calibration grid: designed batches run on the real backend, timed step by step.

Every grid point is a real engine step driven through `runtime.EngineCore` (the scheduler,
the recorder) and `ModelRunner.execute`, exactly as `backends.replay.driver` steps, so the wall time
of a step includes what the simulator's one step-time number has to cover: `schedule()`,
input preparation, the forward pass, sampling, `update_from_output()` and the bookkeeping.

    prefill   a chunk of q new tokens on c cached ones: a request whose first c tokens are a
              prefix-cache hit (an earlier request with that prefix ran first), q suffix tokens
    decode    B requests of context ~L, all decoding (one token each per step)
    mixed     B decoding requests plus one new prompt of q tokens in the same step

Each point runs `warmup` unmeasured steps, then `repeats` measured ones; the point's time is
their median (`wall_s`) and the median of the runner's own execute time (`execute_s`).
The API server's per-request and per-token costs are timed separately (`time_api_server`).
Times are seconds. This module returns raw measurements; `sim.calibrate` fits them.
"""

from __future__ import annotations

import statistics
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from backends.engine.model_runner import ModelRunner
from backends.heap import frozen_heap
from backends.replay.api_process import Tokenizer
from runtime import (
    BatchFeatures,
    CacheConfig,
    EngineCore,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from workloads import TraceRequest, prompt_token_ids, stream_token_ids

if TYPE_CHECKING:
    from backends.engine.setup import RealSetup

Progress = Callable[[int, int], None]  # (grid points done, grid points in all)


@dataclass(frozen=True, slots=True)
class GridSpec:
    """Which batches to measure and how often (token counts; all validated >= 0 / >= 1).

    Attributes:
        prefill_chunks: q, new prompt tokens of the prefill points.
        cached_contexts: c, prefix-cache hits under them (rounded down to a block).
        decode_batches: B, requests per decode step.
        decode_contexts: L, prompt length of the decoding requests.
        mixed: (B, L, q) triples: B decodes at context L plus a q-token prompt.
        warmup: unmeasured steps per point (also one whole unmeasured point first).
        repeats: measured steps per point (the median is kept).
        time_limit_s: stop starting new points after this many seconds of grid.
    """

    prefill_chunks: tuple[int, ...] = (16, 64, 128, 256, 512)
    cached_contexts: tuple[int, ...] = (0, 128, 256)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_contexts: tuple[int, ...] = (32, 128, 320)
    mixed: tuple[tuple[int, int, int], ...] = (
        (2, 64, 64), (4, 128, 128), (8, 64, 256), (16, 128, 64), (4, 256, 32), (8, 96, 128))
    warmup: int = 2
    repeats: int = 7
    time_limit_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("prefill_chunks", "decode_batches"):
            if any(v < 1 for v in getattr(self, name)):
                raise ValueError(f"GridSpec.{name}: every value must be >= 1")
        for name in ("cached_contexts", "decode_contexts"):
            if any(v < 0 for v in getattr(self, name)):
                raise ValueError(f"GridSpec.{name}: every value must be >= 0")
        if any(len(m) != 3 or min(m) < 1 for m in self.mixed):
            raise ValueError("GridSpec.mixed: each entry must be (B, L, q), all >= 1")
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError("GridSpec: warmup must be >= 0 and repeats >= 1")
        if not self.time_limit_s > 0:
            raise ValueError(f"GridSpec.time_limit_s must be > 0, got {self.time_limit_s}")


QUICK_GRID = GridSpec(prefill_chunks=(16, 64, 160), cached_contexts=(0, 96),
                      decode_batches=(1, 4, 12), decode_contexts=(32, 160),
                      mixed=((2, 64, 64), (6, 96, 32)), warmup=1, repeats=3, time_limit_s=30.0)


@dataclass(frozen=True, slots=True)
class StepMeasurement:
    """One grid point: what the step computed and how long it took (medians, seconds)."""

    kind: str  # "prefill", "decode" or "mixed"
    features: BatchFeatures
    wall_s: float  # begin_step -> end_step done: the step's share of a busy engine's clock
    execute_s: float  # ModelRunner.execute's own measurement
    repeats: int

    @property
    def host_overhead_s(self) -> float:
        """Wall minus execute: scheduling, bookkeeping, Python between steps."""
        return self.wall_s - self.execute_s


@dataclass(slots=True)
class _Clock:
    """Measured steps of the point in progress."""

    walls: list[float] = field(default_factory=list)
    executes: list[float] = field(default_factory=list)
    features: list[BatchFeatures] = field(default_factory=list)


class _Driver:
    """An engine core and the runner, stepped by hand; request ids and token streams are
    unique per driver so nothing but the intended prefixes is shared."""

    def __init__(self, scheduler: SchedulerConfig, cache: CacheConfig, runner: ModelRunner,
                 vocab_size: int, seed: int) -> None:
        self.core = EngineCore(Scheduler(scheduler, cache))
        self.runner = runner
        self.vocab_size = vocab_size
        self.seed = seed
        self.budget = scheduler.max_num_batched_tokens
        self.max_len = scheduler.max_model_len
        self.count = 0

    def tokens(self, key: str, n: int) -> list[int]:
        return stream_token_ids(key, n, self.vocab_size, self.seed) if n else []

    def submit(self, prompt: list[int], max_tokens: int) -> str:
        self.count += 1
        req_id = f"cal-{self.count}"
        self.core.recorder.arrived(req_id, 0.0, len(prompt), max_tokens)
        request = Request(req_id, array("q", prompt),
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.core.submit(request, 0.0)
        return req_id

    def step(self, clock: _Clock | None = None) -> BatchFeatures | None:
        """One engine step; timed into `clock` when given. None when nothing ran."""
        started = time.perf_counter()
        step = self.core.begin_step(started)
        if step is None:
            return None
        result = self.runner.execute(step.output)
        self.core.end_step(step, result.sampled, time.perf_counter(), result.duration_s)
        wall = time.perf_counter() - started
        if clock is not None:
            clock.walls.append(wall)
            clock.executes.append(result.duration_s)
            clock.features.append(step.features)
        return step.features

    def drain(self) -> None:
        while self.core.has_work():
            self.step()

    def fits(self, tokens: int) -> bool:
        return tokens + 1 <= self.max_len


def _measurement(kind: str, clock: _Clock) -> StepMeasurement:
    """The median step of a point: features of the step whose wall time is the median."""
    order = sorted(range(len(clock.walls)), key=clock.walls.__getitem__)
    middle = order[len(order) // 2]
    return StepMeasurement(kind, clock.features[middle], statistics.median(clock.walls),
                           statistics.median(clock.executes), len(clock.walls))


def _prefill_point(d: _Driver, q: int, c: int, spec: GridSpec) -> StepMeasurement | None:
    block = d.core.scheduler.cache_config.block_size
    c = c // block * block
    if q > d.budget or not d.fits(c + q):
        return None
    prefix = d.tokens(f"cal-prefix-{d.count}", c)
    if c:
        d.submit(prefix, 1)  # puts the prefix in the cache
        d.drain()
    clock = _Clock()
    for i in range(spec.warmup + spec.repeats):
        d.submit(prefix + d.tokens(f"cal-suffix-{d.count}", q), 1)
        d.step(clock if i >= spec.warmup else None)
        d.drain()
    return _measurement("prefill", clock)


def _start_decodes(d: _Driver, batch: int, context: int, steps: int) -> bool:
    """Submit `batch` requests of `context` prompt tokens and step until all decode."""
    if batch > d.core.scheduler.scheduler_config.max_num_seqs or not d.fits(context + steps + 2):
        return False
    for _ in range(batch):
        d.submit(d.tokens(f"cal-decode-{d.count}", max(context, 1)), steps + 2)
    while True:
        features = d.step()
        if features is None or features.num_prefill_tokens == 0:
            return features is not None
        if all(r.num_output_tokens > 0 for r in d.core.scheduler.running):
            return True


def _decode_point(d: _Driver, batch: int, context: int, spec: GridSpec
                  ) -> StepMeasurement | None:
    if not _start_decodes(d, batch, context, spec.warmup + spec.repeats):
        d.drain()
        return None
    clock = _Clock()
    for i in range(spec.warmup + spec.repeats):
        d.step(clock if i >= spec.warmup else None)
    d.drain()
    return _measurement("decode", clock) if clock.walls else None


def _mixed_point(d: _Driver, batch: int, context: int, q: int, spec: GridSpec
                 ) -> StepMeasurement | None:
    if batch + q > d.budget or not _start_decodes(d, batch, context,
                                                   spec.warmup + spec.repeats):
        d.drain()
        return None
    clock = _Clock()
    for i in range(spec.warmup + spec.repeats):
        d.submit(d.tokens(f"cal-mixed-{d.count}", q), 1)
        d.step(clock if i >= spec.warmup else None)
    d.drain()
    return _measurement("mixed", clock) if clock.walls else None


def grid_points(spec: GridSpec) -> list[tuple[str, tuple[int, ...]]]:
    """The points in run order: (kind, parameters)."""
    points: list[tuple[str, tuple[int, ...]]] = []
    points += [("prefill", (q, c)) for c in spec.cached_contexts for q in spec.prefill_chunks]
    points += [("decode", (b, n)) for n in spec.decode_contexts for b in spec.decode_batches]
    points += [("mixed", m) for m in spec.mixed]
    return points


def run_grid(scheduler: SchedulerConfig, cache: CacheConfig, runner: ModelRunner,
             vocab_size: int, spec: GridSpec = GridSpec(), seed: int = 0,
             progress: Progress | None = None) -> list[StepMeasurement]:
    """Measure every grid point that fits the engine's limits (token budget, max_num_seqs,
    max_model_len), in `grid_points` order, until `spec.time_limit_s` runs out. The runner's
    KV pool must be the one `cache` describes; the runner is left with no live requests."""
    driver = _Driver(scheduler, cache, runner, vocab_size, seed)
    points = grid_points(spec)
    run = {"prefill": _prefill_point, "decode": _decode_point, "mixed": _mixed_point}
    if points:  # warm-up: one whole point, discarded (allocator, caches, lazy init)
        run[points[0][0]](driver, *points[0][1], spec)  # type: ignore[operator]
    started = time.perf_counter()
    out: list[StepMeasurement] = []
    with frozen_heap():  # as in a replay: no full garbage collection inside a timed step
        for done, (kind, params) in enumerate(points, start=1):
            if time.perf_counter() - started > spec.time_limit_s:
                break
            measured = run[kind](driver, *params, spec)  # type: ignore[operator]
            if measured is not None:
                out.append(measured)
            if progress is not None:
                progress(done, len(points))
    return out


# ---- API server ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ApiServerTiming:
    """Median seconds the API-server stage spends on one request of each prompt length: the
    prompt text encoded with the model's tokenizer when there is one, the engine `Request`
    built (as `backends.replay.driver`; token ids are made before its clock starts)."""

    prompt_lens: tuple[int, ...]
    seconds: tuple[float, ...]
    method: str  # "tokenizer" or "token ids"


def _timed_requests(lens: Sequence[int], repeats: int) -> Iterator[tuple[int, TraceRequest]]:
    for i in range(repeats):
        for n in lens:
            yield n, TraceRequest(f"api-{i}-{n}", 0.0, n, 1)


def time_api_server(vocab_size: int, tokenizer: Tokenizer | None = None,
                    prompt_lens: Sequence[int] = (16, 128, 512, 2048), repeats: int = 15,
                    seed: int = 0) -> ApiServerTiming:
    """Time the replay's API-server work per request at several prompt lengths (medians)."""
    texts: dict[str, str] = {}
    if tokenizer is not None:
        for _, req in _timed_requests(prompt_lens, repeats):
            texts[req.request_id] = tokenizer.decode(prompt_token_ids(req, vocab_size, seed))
    samples: dict[int, list[float]] = {n: [] for n in prompt_lens}
    for n, req in _timed_requests(prompt_lens, repeats):
        ids = prompt_token_ids(req, vocab_size, seed)  # made before the replay's clock starts
        started = time.perf_counter()
        if tokenizer is not None:
            tokenizer.encode(texts[req.request_id])
        Request(req.request_id, array("q", ids),
                SamplingParams(max_tokens=req.output_len, ignore_eos=True))
        samples[n].append(time.perf_counter() - started)
    return ApiServerTiming(tuple(prompt_lens),
                           tuple(statistics.median(samples[n]) for n in prompt_lens),
                           "tokenizer" if tokenizer is not None else "token ids")


# ---- one calibration of a built engine ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GridCalibration:
    """Everything `rt calibrate` measured on one engine, with where it ran: what
    `sim.calibrate.profile_from_grid` fits a profile on."""

    grid: list[StepMeasurement]
    api: ApiServerTiming
    device: str
    model: str
    dtype: str
    versions: dict[str, str]


def calibrate_engine(setup: RealSetup, tokenizer: Tokenizer | None, quick: bool,
                     time_limit_s: float | None, progress: Progress | None = None
                     ) -> GridCalibration:
    """Run the grid (`QUICK_GRID` or the full one, cut at `time_limit_s`) and time the API
    server on `setup`'s engine. ValueError when fewer than 7 points fit the engine's limits
    (six coefficients and one to hold out)."""
    import dataclasses
    import platform

    import torch

    spec = QUICK_GRID if quick else GridSpec()
    if time_limit_s is not None:
        spec = dataclasses.replace(spec, time_limit_s=time_limit_s)
    grid = run_grid(setup.scheduler, setup.cache, setup.runner, setup.shape.vocab_size, spec,
                    setup.args.seed, progress)
    if len(grid) < 7:
        raise ValueError(f"only {len(grid)} grid points fit the engine's limits; raise "
                         "--max-model-len or --max-num-batched-tokens")
    lens = (16, 256) if quick else (16, 128, 512, 2048)
    api = time_api_server(setup.shape.vocab_size, tokenizer, lens, 5 if quick else 15)
    device = (str(setup.describe()["device"]) if setup.args.device == "cuda" else
              f"cpu ({platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} threads)")
    return GridCalibration(grid, api, device,
                           f"{Path(setup.args.model_dir).name} ({setup.shape.model_type})",
                           setup.dtype, {"torch": torch.__version__,
                                         "python": platform.python_version()})
