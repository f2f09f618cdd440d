"""backends.engine.calibration_grid and `rt calibrate` / `rt fidelity` on the tiny Llama
(CPU). The fidelity tolerance is wide: CI machines are small and noisy."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import workloads
from backends.engine.calibration_grid import GridSpec, run_grid, time_api_server
from backends.engine.setup import RealEngineArgs, build_engine
from backends.engine.tiny_model import build_tiny_llama
from cli import app
from sim.profile import load_profile

TINY_GRID = GridSpec(prefill_chunks=(16, 48), cached_contexts=(0, 32), decode_batches=(1, 3),
                     decode_contexts=(20,), mixed=((2, 20, 16),), warmup=1, repeats=2,
                     time_limit_s=20.0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # No tokenizer: the calibration and fidelity mechanics are what is tested here, and each
    # replay's API-server process then starts ~2 s sooner (tokenizer: test_replay, serve).
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", tokenizer=False)


def test_grid_measures_designed_batches(tiny_dir: Path) -> None:
    setup = build_engine(RealEngineArgs(model_dir=tiny_dir, max_num_batched_tokens=64,
                                        max_num_seqs=8))
    grid = run_grid(setup.scheduler, setup.cache, setup.runner, setup.shape.vocab_size,
                    TINY_GRID)
    kinds = [m.kind for m in grid]
    assert kinds == ["prefill"] * 4 + ["decode"] * 2 + ["mixed"]
    cached = grid[3].features  # q = 48 on c = 32 cached tokens (a prefix-cache hit)
    assert (cached.num_prefill_tokens, cached.prefill_kv_tokens) == (48, 80)
    assert cached.prefill_attention_pairs == 48 * 32 + 48 * 49 // 2
    assert grid[5].features.num_decode_tokens == grid[5].features.num_seqs == 3
    mixed = grid[6].features
    assert (mixed.num_decode_tokens, mixed.num_prefill_tokens) == (2, 16)
    assert all(m.wall_s >= m.execute_s > 0 and m.repeats == 2 for m in grid)
    assert len(setup.runner.states) <= 4  # finished requests are dropped (but the last step's)


def test_grid_skips_points_beyond_the_budget(tiny_dir: Path) -> None:
    setup = build_engine(RealEngineArgs(model_dir=tiny_dir, max_num_batched_tokens=32,
                                        max_num_seqs=8))
    grid = run_grid(setup.scheduler, setup.cache, setup.runner, setup.shape.vocab_size,
                    TINY_GRID)
    assert all(m.features.num_tokens <= 32 for m in grid)


def test_api_server_timing() -> None:
    timing = time_api_server(512, None, (16, 256), 3)
    assert timing.method == "token ids" and len(timing.seconds) == 2
    assert all(s > 0 for s in timing.seconds)


cli_runner = CliRunner()


def _invoke(*args: str) -> tuple[int, str, str]:
    result = cli_runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_calibrate_and_fidelity_cli(tiny_dir: Path, tmp_path: Path) -> None:
    code, _, err = _invoke("calibrate", "--model", str(tiny_dir), "--quick",
                           "--max-num-batched-tokens", "256", "-o", str(tmp_path / "p.json"))
    assert code == 0, err
    profile = load_profile(tmp_path / "p.json")
    assert profile.model.startswith("tiny-llama") and profile.dtype == "float32"
    assert profile.fit is not None and profile.fit["grid_points"] >= 7
    assert "held out" in err

    trace = workloads.random_trace(40, workloads.RandomLengths(48, 8, 0.5),
                                   workloads.ArrivalProcess(40.0, 1.0, 0))
    trace_path = tmp_path / "t.jsonl"
    workloads.write_rt_jsonl(trace, trace_path)
    out_dir = tmp_path / "fid"
    args = ("fidelity", str(trace_path), "--model", str(tiny_dir), "--profile",
            str(tmp_path / "p.json"), "--max-num-batched-tokens", "256", "--no-plots",
            "--result-dir", str(out_dir))
    code, out, err = _invoke(*args, "--max-error", "20")  # 2000%: a noisy 2-core machine
    assert code == 0, err
    assert "p90_ttft_ms" in out and "per-step time prediction" in out
    assert "has no step-time scatter" in err  # a grid profile: deterministic steps
    report = json.loads((out_dir / "fidelity.json").read_text())
    assert report["ttft_per_request"]["requests"] == 40
    real = json.loads((out_dir / "real" / "run.json").read_text())
    sim = json.loads((out_dir / "sim" / "run.json").read_text())
    assert real["cache_config"]["num_blocks"] == sim["cache_config"]["num_blocks"]
    assert real["scheduler_config"] == sim["scheduler_config"]
    assert report["sim_runs"] == 1 and not (out_dir / "sim-2").exists()  # deterministic
    code, _, err = _invoke(*args, "--max-error", "0")
    assert code == 1 and "exceeds" in err

    code, _, err = _invoke("calibrate", "--from-steps", str(out_dir / "real"), "-o",
                           str(tmp_path / "s.json"))
    assert code == 0, err
    plain = load_profile(tmp_path / "s.json")
    assert plain.fit["replay_steps"] > 7  # type: ignore[index]
    assert plain.step_time_quantiles is not None and plain.step_time_drift_quantiles is None
    code, _, err = _invoke("calibrate", "--from-steps", str(out_dir / "real"), "--step-drift",
                           "-o", str(tmp_path / "d.json"))
    assert code == 0, err
    drift = load_profile(tmp_path / "d.json")
    # ~1 s of steps: several 0.25 s windows, so a drift table; the same coefficients.
    assert drift.step_time_drift_window_s == 0.25
    assert drift.step_time_drift_quantiles is not None
    assert len(drift.step_time_drift_quantiles) == 101
    assert drift.coefficients == plain.coefficients
    assert drift.step_time_quantiles != plain.step_time_quantiles  # within-window scatter
    code, _, err = _invoke("calibrate", "--model", str(tiny_dir), "--step-drift", "-o",
                           str(tmp_path / "x.json"))
    assert code == 2 and "--step-drift needs --from-steps alone" in err
    code, _, err = _invoke(*args, "--step-drift")
    assert code == 2 and "--step-drift needs a profile fitted here on replays" in err


def test_fidelity_calibrates_on_a_separate_replay(tiny_dir: Path, tmp_path: Path) -> None:
    trace = workloads.random_trace(30, workloads.RandomLengths(48, 8, 0.5),
                                   workloads.ArrivalProcess(40.0, 1.0, 0))
    trace_path = tmp_path / "t.jsonl"
    workloads.write_rt_jsonl(trace, trace_path)
    out_dir = tmp_path / "fid"
    code, out, err = _invoke("fidelity", str(trace_path), "--model", str(tiny_dir),
                             "--calibrate-on", "replay", "--max-num-batched-tokens", "256",
                             "--repeats", "2", "--sim-runs", "3", "--no-plots", "--result-dir",
                             str(out_dir))
    assert code == 0, err
    calibration = json.loads((out_dir / "calibration" / "run.json").read_text())
    calibration_2 = json.loads((out_dir / "calibration-2" / "run.json").read_text())
    real = json.loads((out_dir / "real" / "run.json").read_text())
    real_2 = json.loads((out_dir / "real-2" / "run.json").read_text())
    assert real_2["trace"]["digest"] == real["trace"]["digest"]  # the same trace, twice
    written = sorted(["calibration-2", "real-2", "real", "calibration"],  # not the answer
                     key=lambda name: (out_dir / name / "run.json").stat().st_mtime_ns)
    assert written == ["calibration", "real", "real-2", "calibration-2"]  # C R, R C
    assert calibration_2["trace"]["digest"] != calibration["trace"]["digest"]
    assert out.splitlines()[0].split() == ["metric", "real", "sim", "error", "noise",
                                           "sim_noise"]
    report = json.loads((out_dir / "fidelity.json").read_text())
    assert report["real_runs"] == 2 and report["ttft_per_request_noise"]["requests"] == 30
    assert report["metrics"]["p50_ttft_ms"]["noise"] >= 0
    profile = load_profile(out_dir / "profile.json")
    assert profile.step_time_quantiles is not None and len(profile.step_time_quantiles) == 101
    assert profile.step_time_drift_quantiles is None  # i.i.d. scatter unless --step-drift
    sims = [json.loads((out_dir / name / "run.json").read_text())
            for name in ("sim", "sim-2", "sim-3")]
    assert [run["step_noise"] for run in sims] == [True] * 3
    assert [run["step_noise_seed"] for run in sims] == [0, 1, 2]
    assert [run["name"] for run in sims] == ["sim", "sim-2", "sim-3"]
    assert {run["seed"] for run in sims} == {0}  # the token ids stay the replay's
    assert report["sim_runs"] == 3 and report["metrics"]["p50_ttft_ms"]["sim_noise"] > 0
    steps = [len(pd.read_parquet(out_dir / name / "steps.parquet"))
             for name in ("calibration", "calibration-2")]
    # Fitted on both calibration runs' steps (less the few without tokens).
    assert max(steps) < profile.fit["replay_steps"] <= sum(steps)  # type: ignore[index]
    # Out of sample: other requests (another trace) on the same engine configuration.
    assert calibration["trace"]["digest"] != real["trace"]["digest"]
    assert calibration["trace"]["requests"] == 30
    assert load_profile(out_dir / "profile.json").fit["replay_steps"] > 7  # type: ignore[index]
    assert "p50_itl_ms" in out
    for flags, message in [(("--calibrate-on", "nowhere"), "--calibrate-on must be grid or "
                             "replay"),
                           (("--repeats", "0"), "--repeats must be >= 1, got 0"),
                           (("--sim-runs", "0"), "--sim-runs must be >= 1, got 0"),
                           (("--step-drift", "--no-step-noise"),
                            "--step-drift with --no-step-noise")]:
        code, _, err = _invoke("fidelity", str(trace_path), "--model", str(tiny_dir), *flags,
                               "--result-dir", str(tmp_path / "x"))
        assert code == 2 and message in err, (flags, err)
    assert not (tmp_path / "x").exists()  # refused before anything ran
