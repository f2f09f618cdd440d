"""sim.calibrate: NNLS, the profile fit, held-out quality, training data from replay steps."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from runtime.batch import BatchFeatures
from sim.calibrate import (
    evaluate,
    find_stalls,
    fit_api_server,
    fit_coefficients,
    fit_with_holdout,
    holdout_mask,
    make_profile,
    nnls,
    predict,
    profile_from_replays,
    read_replay_steps,
    steps_training_data,
)
from sim.cost.api_server import ApiServerCost
from sim.cost.profile_model import ProfileCoefficients
from sim.profile import load_profile, write_profile

TRUE = ProfileCoefficients(constant_s=1e-3, per_prefill_token_s=2e-5, per_decode_token_s=0.0,
                           per_seq_s=3e-4, per_prefill_attention_pair_s=1e-8,
                           per_decode_kv_token_s=2e-7)


def _grid() -> list[BatchFeatures]:
    out = []
    for q in (16, 64, 256):
        for c in (0, 128):
            out.append(BatchFeatures(num_prefill_tokens=q, num_seqs=1, num_prefill_seqs=1,
                                     prefill_attention_pairs=q * c + q * (q + 1) // 2,
                                     prefill_kv_tokens=c + q))
    for b in (1, 4, 16):
        for ctx in (32, 300):
            out.append(BatchFeatures(num_decode_tokens=b, num_seqs=b, decode_kv_tokens=b * ctx))
    return out


def test_nnls_recovers_non_negative_solution() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((40, 5)) * np.array([1, 1e3, 1e-3, 1e6, 1])  # badly scaled columns
    x = np.array([1.0, 0.0, 2.0, 1e-6, 0.5])
    assert np.allclose(nnls(a, a @ x), x, rtol=1e-6, atol=1e-12)
    # an unconstrained solution with a negative entry is clipped to the boundary
    b = a @ np.array([1.0, -1e-3, 0.0, 0.0, 0.0])
    assert (nnls(a, b) >= 0).all()


def test_fit_recovers_exact_coefficients() -> None:
    feats = _grid()
    seconds = predict(TRUE, feats)
    for relative in (True, False):
        fitted = fit_coefficients(feats, seconds, relative)
        assert np.allclose(predict(fitted, feats), seconds, rtol=1e-6)
        quality = evaluate(fitted, feats, seconds)
        assert quality.mape < 1e-6 and quality.worst_ape < 1e-6 and abs(quality.bias) < 1e-6


def test_fit_with_holdout_reports_held_out_quality() -> None:
    feats = _grid()
    rng = np.random.default_rng(1)
    seconds = predict(TRUE, feats) * rng.uniform(0.95, 1.05, len(feats))
    result = fit_with_holdout(feats, seconds, holdout_every=4)
    assert result.held_out.samples == holdout_mask(len(feats), 4).sum() > 0
    assert result.train.samples + result.held_out.samples == len(feats)
    assert result.held_out.mape < 0.15
    assert result.describe()["objective"] == "relative"


def test_fit_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no step"):
        fit_coefficients([], [])
    with pytest.raises(ValueError, match="positive"):
        fit_coefficients(_grid()[:2], [1e-3, 0.0])


def test_steps_training_data_targets() -> None:
    columns = {f.name: [] for f in dataclasses.fields(BatchFeatures)}
    columns.update(start_s=[], end_s=[], duration_s=[])
    for i, feats in enumerate([*_grid()[:3], BatchFeatures()]):
        for key, value in dataclasses.asdict(feats).items():
            columns[key].append(value)
        columns["start_s"].append(float(i))
        columns["end_s"].append(i + 0.01)
        columns["duration_s"].append(0.008)
    feats, wall, start = steps_training_data(columns, "wall")
    assert len(feats) == 3 and np.allclose(wall, 0.01)  # the empty step is skipped
    assert start == [0.0, 1.0, 2.0]
    assert np.allclose(steps_training_data(columns, "execute")[1], 0.008)
    with pytest.raises(ValueError, match="target"):
        steps_training_data(columns, "other")
    with pytest.raises(ValueError, match="lacks"):
        steps_training_data({"end_s": []})


def test_api_server_fit_and_profile_round_trip(tmp_path: Path) -> None:
    api = fit_api_server([16, 128, 512], [1e-4 + 1e-7 * n for n in (16, 128, 512)])
    assert api.per_request_s == pytest.approx(1e-4)
    assert api.per_prompt_token_s == pytest.approx(1e-7)
    feats = _grid()
    profile = make_profile(fit_with_holdout(feats, predict(TRUE, feats)), device="cpu",
                           model="tiny", dtype="float32", versions={"torch": "x"},
                           date="2026-01-01T00:00:00+00:00", api_server=ApiServerCost(),
                           extra={"grid_points": len(feats)})
    write_profile(profile, tmp_path / "p.json")
    loaded = load_profile(tmp_path / "p.json")
    assert loaded.coefficients == profile.coefficients
    assert loaded.fit is not None and loaded.fit["grid_points"] == len(feats)
    assert loaded.step_time_quantiles is None and loaded.step_time_drift_quantiles is None
    # The step-time scatter tables pass through: fast table, drift table and window.
    noisy = make_profile(fit_with_holdout(feats, predict(TRUE, feats)), device="cpu",
                         model="tiny", dtype="float32", versions={}, date="2026-01-01",
                         api_server=ApiServerCost(), step_time_quantiles=(0.5, 1.5),
                         step_time_drift_quantiles=(0.8, 1.2), step_time_drift_window_s=0.25)
    write_profile(noisy, tmp_path / "noisy.json")
    loaded = load_profile(tmp_path / "noisy.json")
    assert (loaded.step_time_quantiles, loaded.step_time_drift_quantiles,
            loaded.step_time_drift_window_s) == ((0.5, 1.5), (0.8, 1.2), 0.25)


def test_replay_run_directories_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path / 'steps.parquet'}: no such file"):
        read_replay_steps(tmp_path)
    (tmp_path / "steps.parquet").write_text("x")
    with pytest.raises(ValueError, match=f"{tmp_path / 'steps.parquet'}: "):
        profile_from_replays([tmp_path])


def _steps_table(path: Path, feats: list[BatchFeatures], seconds: np.ndarray) -> None:
    """A replay's steps.parquet with these features and back-to-back wall times."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ends = np.cumsum(seconds)
    columns: dict[str, list[object]] = {
        f.name: [getattr(x, f.name) for x in feats] for f in dataclasses.fields(BatchFeatures)}
    columns |= {"start_s": list(ends - seconds), "end_s": list(ends),
                "duration_s": list(seconds)}
    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path / "steps.parquet")


def _replay_like() -> list[BatchFeatures]:
    """120 steps as a replay has them: decodes of 1-16 sequences, prefills of 16-256 tokens,
    and at index 7 one long prefill (4096 tokens), the step a stall there would bend most."""
    out = []
    for i in range(120):
        q, b = (16 * (1 + i % 16), 0) if i % 3 == 0 else (0, 1 + i % 16)
        if i == 7:
            q, b = 4096, 0
        out.append(BatchFeatures(num_prefill_tokens=q, num_decode_tokens=b,
                                 num_seqs=b + (q > 0), num_prefill_seqs=int(q > 0),
                                 prefill_attention_pairs=q * (q + 1) // 2,
                                 prefill_kv_tokens=q, decode_kv_tokens=b * 100))
    return out


def test_find_stalls_marks_exactly_the_steps_far_above_the_fit() -> None:
    feats = _replay_like()
    seconds = predict(TRUE, feats)
    assert not find_stalls(feats, seconds).mask.any()  # exact data: no stall
    stalled = seconds.copy()
    many = list(range(60, 120, 3))  # 20 of the 40 prefills 8x: a fit in squared seconds
    stalled[many] *= 8.0  # follows them and marks none; marking against the median step
    stalled[50] *= 4.5  # marks the long prefill (7); a decode step just over the ratio
    stalled[53] *= 3.5  # and one just under it (any ratio outside ~3.6-4.4 fails here)
    stalls = find_stalls(feats, stalled)
    assert np.flatnonzero(stalls.mask).tolist() == sorted([50, *many])
    assert stalls.seconds == pytest.approx(float(stalled[[50, *many]].sum()))


def test_find_stalls_refits_until_the_marked_set_is_stable() -> None:
    """A quarter of the steps 8x bend the first fit enough to hide a step at 4.1x; the refit
    without them finds it (one pass would not)."""
    feats = _replay_like()
    stalled = predict(TRUE, feats)
    quarter = list(range(0, 120, 4))
    stalled[quarter] *= 8.0
    stalled[1] *= 4.1
    assert np.flatnonzero(find_stalls(feats, stalled).mask).tolist() == sorted([1, *quarter])


def test_find_stalls_leaves_enough_steps_to_fit() -> None:
    feats = _replay_like()[:8]
    stalled = predict(TRUE, feats)
    stalled[[1, 2]] += 3.0  # marking both would leave 6 < MIN_REPLAY_STEPS steps
    assert not find_stalls(feats, stalled).mask.any()
    assert not find_stalls([], []).mask.any()


def test_replay_profile_fits_without_stalls_and_counts_them(tmp_path: Path) -> None:
    feats = _replay_like()
    seconds = predict(TRUE, feats)
    stalled = seconds.copy()
    stalled[[1, 2]] += 3.0  # first steps of a fresh process: kernels compiling
    _steps_table(tmp_path / "a", feats[:60], stalled[:60])
    _steps_table(tmp_path / "b", feats[60:], stalled[60:])
    profile = profile_from_replays([tmp_path / "a", tmp_path / "b"])
    assert np.allclose(predict(profile.coefficients, feats), seconds, rtol=1e-6)
    assert profile.fit is not None
    stalls = profile.fit["left_out_stalls"]
    assert (stalls["steps"], profile.fit["replay_steps"]) == (2, 118)
    assert stalls["seconds"] == pytest.approx(float(stalled[[1, 2]].sum()))
    assert profile.step_time_quantiles is not None
    assert max(profile.step_time_quantiles) == pytest.approx(1.0)  # the fit is exact
    # without stalls nothing is left out; the model is named, not where it lay
    _steps_table(tmp_path / "c", feats, seconds)
    (tmp_path / "c" / "run.json").write_text(json.dumps(
        {"model": {"dir": "/root/.cache/rt/configs/llama-3.1-8b"}, "device": "NVIDIA H200"}))
    clean = profile_from_replays([tmp_path / "c"])
    assert (clean.model, clean.device) == ("llama-3.1-8b", "NVIDIA H200")
    assert clean.fit is not None
    assert (clean.fit["left_out_stalls"]["steps"], clean.fit["replay_steps"]) == (0, 120)
