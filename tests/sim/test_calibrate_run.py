"""`rt calibrate`'s sources (which fit, and the combinations refused in one line) and the
profile's fit summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import EngineFlags
from sim.calibrate_flags import CalibrationSources
from sim.calibrate_run import NO_DRIFT, fit_lines, runs_profile, steps_profile
from sim.cost.profile_model import ProfileCoefficients
from sim.profile import Profile


def test_mode_and_refused_combinations() -> None:
    steps, runs = [Path("a")], [Path("r")]
    assert CalibrationSources().mode(with_model=True, step_drift=False) == "grid"
    assert CalibrationSources(from_steps=steps).mode(True, False) == "grid"
    assert CalibrationSources(from_steps=steps).mode(False, True) == "steps"
    assert CalibrationSources(from_run=runs).mode(False, False) == "runs"
    with pytest.raises(ValueError, match="^--step-drift needs --from-steps alone"):
        CalibrationSources(from_steps=steps).mode(True, True)
    with pytest.raises(ValueError, match="^--from-run fits client timings alone"):
        CalibrationSources(from_run=runs, from_steps=steps).mode(False, False)
    with pytest.raises(ValueError, match="^--from-run fits client timings alone"):
        CalibrationSources(from_run=runs).mode(True, False)


def test_errors_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^--from-steps: "):
        steps_profile([tmp_path / "missing"], "wall", "test")

    def no_timings(path: Path) -> tuple[dict[str, list[object]], dict[str, object]]:
        return {"prompt_len": [3]}, {}

    with pytest.raises(ValueError, match="^--from-run "):
        runs_profile([tmp_path / "run"], no_timings, EngineFlags(), 0, "test")
    assert NO_DRIFT.startswith("--step-drift: ")


def test_fit_lines_give_quality_then_every_coefficient() -> None:
    coefficients = ProfileCoefficients(0.001, 2e-5, 3e-4, 0.0, 0.0, 1e-7)
    fit = {"held_out": {"samples": 4, "mape": 0.1, "p90_ape": 0.2, "worst_ape": 0.3,
                        "bias": -0.05}}
    profile = Profile("cpu", "tiny", "float32", {}, "2026-12-01", coefficients, fit=fit)
    assert fit_lines(profile) == [
        "fit on held out: 4 steps, MAPE 10.0%, p90 20.0%, worst 30.0%, total-time bias -5.0%",
        "  constant_s                     0.001 s",
        "  per_prefill_token_s            2e-05 s",
        "  per_decode_token_s             0.0003 s",
        "  per_seq_s                      0 s",
        "  per_prefill_attention_pair_s   0 s",
        "  per_decode_kv_token_s          1e-07 s"]


@pytest.mark.parametrize("fleet", [{"replicas": 2}, {"replicas": 3, "pools": [{"count": 3}]}])
def test_a_fleets_run_is_refused_for_the_client_side_fit(fleet: dict[str, object]) -> None:
    """`rt calibrate --from-run FLEET_RUN` fitted one engine's steps on the requests of
    several replicas (their chunks read as one engine's steps) and wrote the profile, exit 0
    (badinput23)."""
    replicas = fleet["replicas"]
    with pytest.raises(ValueError, match=f"^--from-run f: a fleet's run \\({replicas} "
                       "replicas\\); the client-side fit reads one engine's"):
        runs_profile([Path("f")], lambda p: ({}, {"fleet": fleet}), EngineFlags(), 0, "x")


def test_a_simulated_source_is_refused_naming_the_flag_and_path() -> None:
    """leftopen: a run `rt simulate` wrote (run.json kind "simulate") fitted the cost model
    to its own times, exit 0. Replays, endpoint runs (of `rt serve --simulate` too: timed at
    the client) and sources without a run.json are left to the fit."""
    kinds = {"sim": "simulate", "real": "replay", "client": "endpoint"}

    def run_info(path: Path) -> dict[str, str] | None:
        kind = kinds.get(path.parts[0])
        return None if kind is None else {"kind": kind}

    fine = CalibrationSources(from_steps=[Path("real"), Path("bare/steps.parquet")],
                              from_run=[Path("client"), Path("bench.json")])
    fine.check_measured(run_info)
    with pytest.raises(ValueError) as err:
        CalibrationSources(from_steps=[Path("real"), Path("sim/steps.parquet")]
                           ).check_measured(run_info)
    assert str(err.value) == (
        "--from-steps sim/steps.parquet: a simulated run (run.json kind 'simulate'): a profile "
        "fitted to a cost model's own times is circular; give a real engine's replay "
        "(`rt replay`)")
    with pytest.raises(ValueError) as err:
        CalibrationSources(from_run=[Path("client"), Path("sim")]).check_measured(run_info)
    assert str(err.value) == (
        "--from-run sim: a simulated run (run.json kind 'simulate'): a profile fitted to a "
        "cost model's own times is circular; give a client-timed run (`rt replay "
        "--endpoint`, or a vLLM bench file)")
