"""Step-time noise: the quantile table, the per-step factor (a pure function of the step
index), its use in the simulator (stepping and fast-forwarding agree), the profile field and
the CLI flag's errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from runtime import BatchFeatures, CacheConfig, SchedulerConfig
from sim.cost_model import ApiServerCost, ProfileCoefficients, ProfileCostModel
from sim.engine_args import EngineArgs, build_setup
from sim.profile import Profile, load_profile, write_profile
from sim.simulator import SimConfig, simulate
from sim.step_noise import StepNoise, ratio_quantiles
from workloads import ArrivalProcess, RandomLengths, random_trace

COST = ProfileCostModel(ProfileCoefficients(2e-3, 2e-5, 1e-4, 1e-4, 0.0, 1e-7))


def test_ratio_quantiles_interpolate_order_statistics_with_mean_one() -> None:
    measured, predicted = [3.0, 1.0, 4.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]
    # ratios 1, 2, 3, 4 (the 0 s step is skipped), mean 2.5
    assert ratio_quantiles(measured, predicted, 4, trim=0) == pytest.approx(
        (0.4, 0.8, 1.2, 1.6))
    assert ratio_quantiles(measured, predicted, 3, trim=0) == pytest.approx((0.4, 1.0, 1.6))
    with pytest.raises(ValueError, match="2 or more timed steps"):
        ratio_quantiles([1.0], [1.0])


def test_ratio_quantiles_clip_the_rare_stall() -> None:
    # 99 steps at ratio 1 and one stalled 20x: trim 0.01 clips it to the 99th percentile.
    measured = [1.0] * 99 + [20.0]
    table = ratio_quantiles(measured, [1.0] * 100, 5)
    p99 = 1.0 + (20.0 - 1.0) * (0.99 * 99 - 98)  # between the 99th and 100th ratio
    mean = (99 + p99) / 100
    assert table == pytest.approx((1 / mean, 1 / mean, 1 / mean, 1 / mean, p99 / mean))
    assert max(ratio_quantiles(measured, [1.0] * 100, 5, trim=0)) > 10


def test_factor_is_a_pure_function_of_seed_and_step() -> None:
    noise = StepNoise((0.5, 1.5), seed=3)
    factors = [noise.factor(k) for k in range(20_000)]
    assert factors[:50] == [StepNoise((0.5, 1.5), seed=3).factor(k) for k in range(50)]
    assert factors[:50] != [StepNoise((0.5, 1.5), seed=4).factor(k) for k in range(50)]
    assert min(factors) >= 0.5 and max(factors) <= 1.5
    # Q linear from 0.5 to 1.5: the factor is uniform on [0.5, 1.5]
    assert sum(factors) / len(factors) == pytest.approx(1.0, abs=0.01)
    assert sum(f < 0.75 for f in factors) / len(factors) == pytest.approx(0.25, abs=0.02)


@pytest.mark.parametrize("bad", [(1.0,), (1.0, 0.0), (2.0, 1.0), (1.0, float("nan"))])
def test_step_noise_rejects_a_bad_table(bad: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="StepNoise.quantiles"):
        StepNoise(bad)


def _config(**kwargs: object) -> SimConfig:
    return SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16,
                                  max_model_len=2048),
        cache=CacheConfig(block_size=16, num_blocks=400), api_server=ApiServerCost(),
        vocab_size=512, check_invariants=True, **kwargs)  # type: ignore[arg-type]


def test_noisy_steps_equal_with_and_without_fast_forward() -> None:
    trace = random_trace(60, RandomLengths(120, 40, range_ratio=0.8),
                         ArrivalProcess(request_rate=30.0, burstiness=1.0, seed=2))
    noise = StepNoise((0.6, 0.8, 1.0, 1.2, 1.4), seed=9)
    slow = simulate(trace, _config(step_noise=noise, fast_forward=False), COST)
    fast = simulate(trace, _config(step_noise=noise, fast_forward=True), COST)
    assert [s.to_row() for s in fast.steps] == [s.to_row() for s in slow.steps]
    assert [r.to_row() for r in fast.requests] == [r.to_row() for r in slow.requests]
    # Every step took exactly the cost model's time times its factor.
    for s in slow.steps:
        features = BatchFeatures(
            s.num_prefill_tokens, s.num_decode_tokens, s.num_seqs, s.num_prefill_seqs,
            s.prefill_attention_pairs, s.prefill_kv_tokens, s.decode_kv_tokens)
        assert s.duration_s == COST.step_time(features) * noise.factor(s.step)
    plain = simulate(trace, _config(), COST)
    assert [s.duration_s for s in plain.steps] != [s.duration_s for s in slow.steps]


def _profile(quantiles: tuple[float, ...] | None) -> Profile:
    return Profile(device="cpu", model="tiny", dtype="float32", versions={"rt": "0"},
                   date="2026-11-30T00:00:00+00:00",
                   coefficients=COST.coefficients, step_time_quantiles=quantiles)


def test_profile_carries_the_table_and_build_setup_uses_it(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    write_profile(_profile((0.5, 1.0, 1.5)), path)
    assert load_profile(path).step_time_quantiles == (0.5, 1.0, 1.5)
    setup = build_setup(EngineArgs(num_gpu_blocks_override=200), "llama-3.1-8b", "h200",
                        str(path), seed=5, step_noise=True)
    assert setup.config.step_noise == StepNoise((0.5, 1.0, 1.5), 5)
    assert setup.describe()["step_noise"] is True

    write_profile(_profile(None), path)
    with pytest.raises(ValueError, match="has no step_time_quantiles"):
        build_setup(EngineArgs(), "llama-3.1-8b", "h200", str(path), step_noise=True)
    with pytest.raises(ValueError, match="--step-noise needs a --profile"):
        build_setup(EngineArgs(), "llama-3.1-8b", "h200", None, step_noise=True)

    data = json.loads(path.read_text())
    data["step_time_quantiles"] = [1.0, 0.5]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'step_time_quantiles' must be a list"):
        load_profile(path)
    assert replace(_profile(None), step_time_quantiles=(1.0, 2.0)).to_json_dict()[
        "step_time_quantiles"] == [1.0, 2.0]
