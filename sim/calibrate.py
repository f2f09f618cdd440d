"""Fit the `profile` cost model to measured step times: non-negative least squares.

The model (`sim.cost.profile_model.ProfileCoefficients`) is linear in six step features,

    step time = c0 + c1·prefill tokens + c2·decode tokens + c3·seqs
              + c4·prefill attention pairs + c5·decode KV tokens,

with every coefficient >= 0. Training data come either from `rt calibrate`'s measurement grid
(`backends.engine.calibration_grid`) or from the `steps.parquet` of an earlier `rt replay`
(`steps_training_data`). The fit minimises squared *relative* errors by default (rows scaled
by 1 / measured time), so short decode steps weigh as much as long prefills, and reports
fit quality (MAPE, worst case) on held-out samples. Times are seconds throughout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from runtime.batch import BatchFeatures
from sim.cost.api_server import ApiServerCost
from sim.cost.profile_model import ProfileCoefficients, ProfileCostModel
from sim.profile import Profile

if TYPE_CHECKING:  # an annotation only: step_noise is imported where it is used
    from sim.step_noise import StepSeconds

# Coefficient name -> the BatchFeatures attribute it multiplies (None: the constant).
FEATURE_OF: dict[str, str | None] = {
    "constant_s": None,
    "per_prefill_token_s": "num_prefill_tokens",
    "per_decode_token_s": "num_decode_tokens",
    "per_seq_s": "num_seqs",
    "per_prefill_attention_pair_s": "prefill_attention_pairs",
    "per_decode_kv_token_s": "decode_kv_tokens",
}
COEFFICIENT_NAMES = tuple(f.name for f in fields(ProfileCoefficients))
STEP_TARGETS = ("wall", "execute")  # what a replay's step time is taken to be


def design_matrix(features: Sequence[BatchFeatures]) -> np.ndarray:
    """[n, 6] float64: one row per step, columns in `ProfileCoefficients` field order."""
    rows = [[1.0 if FEATURE_OF[name] is None else float(getattr(f, FEATURE_OF[name] or ""))
             for name in COEFFICIENT_NAMES] for f in features]
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(COEFFICIENT_NAMES))


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b||₂ subject to x >= 0 (Lawson & Hanson 1974, active set).

    Columns are scaled to unit norm internally (the features span ~10 orders of magnitude);
    all-zero columns get coefficient 0."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    n = a.shape[1]
    norms = np.linalg.norm(a, axis=0)
    live = norms > 0
    scaled = np.where(live, a / np.where(live, norms, 1.0), 0.0)
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    max_iter = max_iter or 30 * n
    tol = 1e-12 * max(1.0, float(np.linalg.norm(b)))
    for _ in range(max_iter):
        w = scaled.T @ (b - scaled @ x)
        candidates = ~passive & live & (w > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(scaled[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return np.where(live, x / np.where(live, norms, 1.0), 0.0)


@dataclass(frozen=True, slots=True)
class FitQuality:
    """Prediction errors of a coefficient set on a sample set.

    Attributes:
        samples: number of steps evaluated.
        mape: mean |predicted - measured| / measured, a fraction (0.05 = 5%).
        p90_ape: 90th percentile of that absolute relative error, a fraction.
        worst_ape: its maximum, a fraction.
        bias: Σ predicted / Σ measured - 1 (the error on total busy time), a fraction.
        rmse_s: root mean squared error, seconds.
    """

    samples: int
    mape: float
    p90_ape: float
    worst_ape: float
    bias: float
    rmse_s: float

    def __post_init__(self) -> None:
        if self.samples < 0:
            raise ValueError(f"FitQuality.samples must be >= 0, got {self.samples}")


def predict(coefficients: ProfileCoefficients, features: Sequence[BatchFeatures]) -> np.ndarray:
    """Predicted step times in seconds (0 for empty steps), as `ProfileCostModel` gives."""
    model = ProfileCostModel(coefficients)
    return np.asarray([model.step_time(f) for f in features], dtype=np.float64)


def evaluate(coefficients: ProfileCoefficients, features: Sequence[BatchFeatures],
             seconds: StepSeconds) -> FitQuality:
    """How well `coefficients` predict the measured `seconds` of these steps."""
    measured = np.asarray(seconds, dtype=np.float64)
    if len(measured) == 0:
        nan = math.nan
        return FitQuality(0, nan, nan, nan, nan, nan)
    predicted = predict(coefficients, features)
    ape = np.abs(predicted - measured) / measured
    return FitQuality(
        samples=len(measured),
        mape=float(ape.mean()),
        p90_ape=float(np.percentile(ape, 90)),
        worst_ape=float(ape.max()),
        bias=float(predicted.sum() / measured.sum() - 1.0),
        rmse_s=float(np.sqrt(np.mean((predicted - measured) ** 2))),
    )


def fit_coefficients(features: Sequence[BatchFeatures], seconds: StepSeconds,
                     relative: bool = True) -> ProfileCoefficients:
    """Non-negative least squares of the six coefficients; `relative` minimises squared
    relative errors (rows weighted by 1 / measured seconds), else squared errors in seconds.
    ValueError on no samples or a non-positive time."""
    measured = np.asarray(seconds, dtype=np.float64)
    if len(measured) == 0:
        raise ValueError("no step measurements to fit")
    if len(measured) != len(features):
        raise ValueError(f"{len(features)} feature rows but {len(measured)} times")
    if not np.all(np.isfinite(measured)) or np.any(measured <= 0):
        raise ValueError("every measured step time must be a positive finite number of seconds")
    a = design_matrix(features)
    weights = 1.0 / measured if relative else np.ones_like(measured)
    x = nnls(a * weights[:, None], measured * weights)
    return ProfileCoefficients(**{name: float(max(v, 0.0))
                                  for name, v in zip(COEFFICIENT_NAMES, x, strict=True)})


def holdout_mask(n: int, every: int = 5, offset: int = 2) -> np.ndarray:
    """Boolean [n]: True for held-out samples, every `every`-th from `offset` (deterministic,
    spread over a grid listed in design order). No sample is held out when n < 2·every."""
    if every < 2:
        raise ValueError(f"holdout every must be >= 2, got {every}")
    mask = np.zeros(n, dtype=bool)
    if n >= 2 * every:
        mask[offset % every::every] = True
    return mask


@dataclass(frozen=True, slots=True)
class FitResult:
    """Coefficients fitted on every sample, and the quality of a fit that did not see the
    held-out samples, on those samples (`held_out`) and on its own (`train`)."""

    coefficients: ProfileCoefficients
    train: FitQuality
    held_out: FitQuality
    all_samples: FitQuality
    relative: bool

    def describe(self) -> dict[str, object]:
        """JSON-ready: the profile's "fit" section."""
        return {"objective": "relative" if self.relative else "absolute",
                "train": _finite(asdict(self.train)), "held_out": _finite(asdict(self.held_out)),
                "all_samples": _finite(asdict(self.all_samples))}


def _finite(data: dict[str, float]) -> dict[str, float | None]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in data.items()}


def fit_with_holdout(features: Sequence[BatchFeatures], seconds: Sequence[float],
                     relative: bool = True, holdout_every: int = 5) -> FitResult:
    """Fit on the samples not held out, score on the held-out ones, then refit on all."""
    features = list(features)
    measured = np.asarray(seconds, dtype=np.float64)
    held = holdout_mask(len(measured), holdout_every)
    train_f = [f for f, h in zip(features, held, strict=True) if not h]
    test_f = [f for f, h in zip(features, held, strict=True) if h]
    partial = fit_coefficients(train_f, measured[~held], relative)
    final = fit_coefficients(features, measured, relative)
    return FitResult(final, evaluate(partial, train_f, measured[~held]),
                     evaluate(partial, test_f, measured[held]),
                     evaluate(final, features, measured), relative)


class StepSamples(NamedTuple):
    """Training samples from one replay's steps, in step order: the features, the time to
    fit (seconds) and the step's start (seconds from the replay's start)."""

    features: list[BatchFeatures]
    seconds: list[float]
    start_s: list[float]


def steps_training_data(columns: Mapping[str, Sequence[object]], target: str = "wall"
                        ) -> StepSamples:
    """Features, step times and start times from a replay's steps.parquet columns
    (StepRecord's names).

    `target` "wall": end_s - start_s, the step's share of the wall clock (the engine is
    back-to-back when busy, so this includes scheduling and bookkeeping: what the simulator
    must reproduce); "execute": duration_s, the model execution the runner measured. Steps
    with no tokens or a non-positive time are skipped."""
    if target not in STEP_TARGETS:
        raise ValueError(f"target must be one of {', '.join(STEP_TARGETS)}, got {target!r}")
    names = [f.name for f in fields(BatchFeatures)]
    needed = [*names, "start_s", "end_s", "duration_s"]
    missing = [name for name in needed if name not in columns]
    if missing:
        raise ValueError(f"steps table lacks column(s) {', '.join(missing)}")
    samples = StepSamples([], [], [])
    for i in range(len(columns["end_s"])):
        feats = BatchFeatures(**{name: _cell(columns, name, i, int) for name in names})
        start = _cell(columns, "start_s", i, float)
        if target == "wall":
            time_s = _cell(columns, "end_s", i, float) - start
        else:
            time_s = _cell(columns, "duration_s", i, float)
        if feats.num_tokens > 0 and time_s > 0 and math.isfinite(time_s):
            samples.features.append(feats)
            samples.seconds.append(time_s)
            samples.start_s.append(start)
    return samples


def _cell(columns: Mapping[str, Sequence[object]], name: str, row: int,
          kind: type[int] | type[float]) -> Any:
    """Cell `row` of column `name` as `kind`; ValueError naming both when it is not a
    number (a null or a string: once a TypeError traceback)."""
    value = columns[name][row]
    try:  # ignore: any cell may come (a null, a string): int()/float() refuse it below
        return kind(value)  # type: ignore[arg-type,call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"column {name!r}, row {row}: value {value!r} is not a number") \
            from None


def fit_api_server(prompt_lens: Sequence[int], seconds: Sequence[float]) -> ApiServerCost:
    """Per-request and per-prompt-token API-server cost (seconds) from timed requests: least
    squares of seconds = a + b·prompt_len, each clipped to >= 0; with a single prompt length
    there is no slope to fit: the mean, per request."""
    lens = np.asarray(prompt_lens, dtype=np.float64)
    times = np.asarray(seconds, dtype=np.float64)
    if len(lens) == 0:
        raise ValueError("the API-server fit needs at least one timed request")
    if len(set(lens.tolist())) < 2:
        return ApiServerCost(per_request_s=float(times.mean()), per_prompt_token_s=0.0)
    a = np.stack([np.ones_like(lens), lens], axis=1)
    per_request, per_token = nnls(a, times)
    return ApiServerCost(per_request_s=float(per_request), per_prompt_token_s=float(per_token))


def make_profile(fit: FitResult, *, device: str, model: str, dtype: str,
                 versions: Mapping[str, str], date: str, api_server: ApiServerCost,
                 extra: Mapping[str, object] | None = None,
                 step_time_quantiles: tuple[float, ...] | None = None,
                 step_time_drift_quantiles: tuple[float, ...] | None = None,
                 step_time_drift_window_s: float | None = None) -> Profile:
    """A `Profile` carrying the fitted coefficients and the fit diagnostics (and the
    step-time scatter tables, `sim.step_noise.fit_step_noise`'s, when given)."""
    return Profile(device=device, model=model, dtype=dtype, versions=dict(versions), date=date,
                   coefficients=fit.coefficients, api_server=api_server,
                   step_time_quantiles=step_time_quantiles,
                   step_time_drift_quantiles=step_time_drift_quantiles,
                   step_time_drift_window_s=step_time_drift_window_s,
                   fit={**fit.describe(), **dict(extra or {})})


# Run directories of earlier replays (`rt replay`, `rt fidelity`) as training data.

MIN_REPLAY_STEPS = 7  # fewer usable steps cannot pin six coefficients and hold some out

# A replay step that took more than STALL_RATIO times the fit's time is a one-off stall, not
# what its batch costs. On an H200 (2026-12-04) the first replay of a fresh process held 13 of
# its 1,363 steps at 0.46-3.2 s, 11 s in all, among steps of 19-98 ms (p99 41 ms); the three
# later replays of the process none over 2.25x their median step. In squared seconds those 13
# outweighed the rest: the fit put 73 µs on each prefill token and the simulator's p50 TTFT
# came out +94%; without them, +0.6%.
STALL_RATIO = 4.0
STALL_ROUNDS = 5  # refits at most, until the marked set is stable (it can grow or shrink)


class Stalls(NamedTuple):
    """Which steps a replay fit left out as stalls (`find_stalls`), and their seconds."""

    mask: np.ndarray  # [n] bool, True for a stall
    seconds: float

    def describe(self) -> dict[str, object]:
        """The profile's "fit" entry: how many steps were left out and their total time
        (a client-timed fit's "stall_steps" is another thing: its stall model's samples)."""
        return {"left_out_stalls": {"ratio": STALL_RATIO, "steps": int(self.mask.sum()),
                                    "seconds": self.seconds}}


def find_stalls(features: Sequence[BatchFeatures], seconds: Sequence[float]) -> Stalls:
    """The steps that took more than STALL_RATIO times what a fit on the others predicts:
    fit on all, mark, refit on the unmarked, mark again from all steps, until the set is
    stable or STALL_ROUNDS refits. The marking fit weighs relative errors, so the many short
    steps pin it and a few stalls of seconds cannot bend it their way (in squared seconds a
    stalled 8k-token prefill passed as 1.6x a fit it had made). A step no other step
    resembles (the one long prefill) pins its own coefficient, so its stall can pass unseen.
    A step the fit predicts 0 s for is never a stall; no step is marked when fewer than
    MIN_REPLAY_STEPS would be left."""
    measured = np.asarray(seconds, dtype=np.float64)
    stall = np.zeros(len(measured), dtype=bool)
    if len(measured) == 0:
        return Stalls(stall, 0.0)
    for _ in range(STALL_ROUNDS):
        kept = [f for f, s in zip(features, stall, strict=True) if not s]
        predicted = predict(fit_coefficients(kept, measured[~stall], relative=True), features)
        marked = (predicted > 0) & (measured > STALL_RATIO * predicted)
        if np.array_equal(marked, stall) or len(measured) - marked.sum() < MIN_REPLAY_STEPS:
            break
        stall = marked
    return Stalls(stall, float(measured[stall].sum()))


def _without(samples: StepSamples, stall: np.ndarray) -> StepSamples:
    """`samples` less the steps marked in `stall` ([len(samples.seconds)] bool)."""
    keep = [i for i, s in enumerate(stall) if not s]
    return StepSamples([samples.features[i] for i in keep], [samples.seconds[i] for i in keep],
                       [samples.start_s[i] for i in keep])


def read_replay_steps(path: Path, target: str = "wall") -> StepSamples:
    """`steps_training_data` of a replay's steps.parquet (`path` is the file or its run
    directory); ValueError naming the file when it is unreadable or lacks columns."""
    import pyarrow.parquet as pq

    file = path / "steps.parquet" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{file}: no such file")
    if (file.parent / "INTERRUPTED").exists():  # analysis.rundir.INTERRUPTED_FILE
        raise ValueError(f"{file.parent}: the write of this run was interrupted")
    try:
        return steps_training_data(pq.read_table(file).to_pydict(), target)
    except (OSError, ValueError) as err:
        raise ValueError(f"{file}: {err}") from err


def replay_api_cost(run_dirs: Sequence[Path]) -> ApiServerCost:
    """The API-server cost as the replays saw it: arrival to hand-over of each request
    (wake-up, tokenizing, the hand-over to another process, a busy machine), least squares
    on the prompt length (`fit_api_server`). Timed in isolation it is ~10x less."""
    import pyarrow.parquet as pq

    lens: list[int] = []
    seconds: list[float] = []
    for run in run_dirs:
        table = pq.read_table(run / "requests.parquet", columns=["prompt_len", "api_server_s"])
        for prompt_len, api_s in zip(*table.to_pydict().values(), strict=True):
            if prompt_len is not None and api_s is not None:
                lens.append(prompt_len)
                seconds.append(api_s)
    return fit_api_server(lens, seconds)


def profile_from_replays(paths: Sequence[Path], target: str = "wall", *,
                         api_server: ApiServerCost | None = None, drift: bool = False,
                         rt_version: str = "unknown") -> Profile:
    """A profile fitted on replay steps only (squared errors in seconds, so the total busy
    time is unbiased), with the step-time scatter around the fit: i.i.d. per step, or with
    `drift` a per-step factor times a slow drift per window (`fit_step_noise`; with too few
    windows the profile has no drift table); metadata from the first run's run.json; the
    API-server cost as given, else the default. Stalls (`find_stalls`) are left out of the
    fit and of the scatter, and counted in the profile's "fit". ValueError on unreadable steps
    or fewer than MIN_REPLAY_STEPS usable ones."""
    import datetime
    import json

    from sim.step_noise import StepNoiseFit, fit_step_noise, ratio_quantiles

    runs = [read_replay_steps(path, target) for path in paths]
    features = [f for run in runs for f in run.features]
    seconds = [t for run in runs for t in run.seconds]
    if len(seconds) < MIN_REPLAY_STEPS:
        raise ValueError(f"{len(seconds)} usable steps, at least {MIN_REPLAY_STEPS} are "
                         "needed")
    stalls = find_stalls(features, seconds)
    bounds = np.cumsum([0, *(len(run.seconds) for run in runs)])
    runs = [_without(run, stalls.mask[start:end])
            for run, start, end in zip(runs, bounds[:-1], bounds[1:], strict=True)]
    features = [f for run in runs for f in run.features]
    seconds = [t for run in runs for t in run.seconds]
    run_json = (paths[0] if paths[0].is_dir() else paths[0].parent) / "run.json"
    try:
        info = json.loads(run_json.read_text()) if run_json.is_file() else {}
    except json.JSONDecodeError as err:
        raise ValueError(f"{run_json}: not valid JSON ({err})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{run_json}: not a JSON object")
    model = info.get("model", {}) if isinstance(info.get("model"), dict) else {}
    fit = fit_with_holdout(features, seconds, relative=False)
    if drift:
        noise = fit_step_noise([(run.start_s, run.seconds,
                                 predict(fit.coefficients, run.features)) for run in runs])
    else:
        noise = StepNoiseFit(ratio_quantiles(seconds, predict(fit.coefficients, features)))
    return make_profile(
        fit, step_time_quantiles=noise.quantiles,
        step_time_drift_quantiles=noise.drift_quantiles,
        step_time_drift_window_s=noise.drift_window_s,
        device=str(info.get("device") or "unknown"),
        model=model_name(str(model.get("dir") or "unknown")),
        dtype=str(info.get("dtype") or "unknown"),
        versions={"rt": rt_version},
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        api_server=api_server or ApiServerCost(),
        extra={"target": target, "replay_steps": len(seconds), **stalls.describe(),
               "grid_points": 0, "sources": [str(p) for p in paths]})


def model_name(model_dir: str) -> str:
    """What a profile names its model: the last part of the model directory's path
    (`/root/.cache/rt/configs/llama-3.1-8b` -> `llama-3.1-8b`), not where it lay on the
    machine that fitted it."""
    return PurePath(model_dir).name or model_dir


def profile_from_grid(calibration: Any, extra_steps: Sequence[StepSamples] = (),
                      rt_version: str = "unknown") -> Profile:
    """A profile fitted on a measured grid (`backends.engine.calibration_grid.calibrate_engine`'s
    `GridCalibration`, read by its fields) plus optional replay steps: relative errors (rows
    scaled by 1 / measured time), held-out quality, the API server's cost, and the grid in
    the profile's fit section. Stalls among the replay steps (`find_stalls`) are left out."""
    import dataclasses
    import datetime

    grid = calibration.grid
    replay = StepSamples([f for s in extra_steps for f in s.features],
                         [t for s in extra_steps for t in s.seconds],
                         [t for s in extra_steps for t in s.start_s])
    stalls = find_stalls(replay.features, replay.seconds)
    replay = _without(replay, stalls.mask)
    features = [m.features for m in grid] + replay.features
    seconds = [m.wall_s for m in grid] + replay.seconds
    api = calibration.api
    overhead = sorted(m.host_overhead_s / m.wall_s for m in grid)
    return make_profile(
        fit_with_holdout(features, seconds), device=calibration.device,
        model=model_name(calibration.model), dtype=calibration.dtype,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        versions={"rt": rt_version, **calibration.versions},
        api_server=fit_api_server(api.prompt_lens, api.seconds),
        extra={"target": "wall", "grid_points": len(grid),
               "replay_steps": len(seconds) - len(grid), **stalls.describe(),
               "grid": [{"kind": m.kind, **dataclasses.asdict(m.features),
                         "wall_s": m.wall_s, "execute_s": m.execute_s} for m in grid],
               "host_overhead_fraction_median": overhead[len(overhead) // 2],
               "api_server_timing": {"method": api.method, "prompt_lens": list(api.prompt_lens),
                                     "seconds": list(api.seconds)}})


def predict_step_rows(coefficients: ProfileCoefficients,
                      steps: Mapping[str, Sequence[Any]]) -> np.ndarray:
    """Predicted seconds of recorded steps (a steps table's columns: BatchFeatures' names);
    empty for an empty table (a client-timed run records no steps)."""
    if len(steps) == 0:
        return np.empty(0)
    names = [f.name for f in fields(BatchFeatures)]
    features = [BatchFeatures(**{n: int(v) for n, v in zip(names, row, strict=True)})
                for row in zip(*(steps[n] for n in names), strict=True)]
    return predict(coefficients, features)
