"""Roofline and profile cost models: hand formulas, regimes, monotonicity."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.batch import BatchFeatures
from sim.cost.api_server import ApiServerCost
from sim.cost.base import CostModel, decode_run_timer
from sim.cost.profile_model import ProfileCoefficients, ProfileCostModel
from sim.cost.roofline import RooflineCostModel, RooflineEfficiency
from sim.hardware import resolve_gpu
from sim.model_presets import resolve_model

LLAMA_8B = resolve_model("llama-3.1-8b")
LLAMA_70B = resolve_model("llama-3.1-70b")
H200 = resolve_gpu("h200")
H100 = resolve_gpu("h100-sxm")

# Datasheet and default-efficiency numbers, restated so the tests fail if either drifts.
ETA_F, ETA_B, OVERHEAD, PER_SEQ, ALPHA = 0.8, 0.9, 1.5e-3, 1.1e-6, 25e-6
H200_FLOPS, H200_BW = ETA_F * 989e12, ETA_B * 4.8e12
KV_8B = 131_072  # B/token
WEIGHTS_READ_8B = 15_009_849_344  # B: P_lin + LM head + norms, bf16
P_LIN_8B = 6_979_321_856


def decode(batch: int, context: int) -> BatchFeatures:
    """`batch` decodes, each with `context` tokens already cached."""
    return BatchFeatures(
        num_decode_tokens=batch, num_seqs=batch, decode_kv_tokens=batch * (context + 1)
    )


def prefill(tokens: int, context: int = 0) -> BatchFeatures:
    return BatchFeatures(
        num_prefill_tokens=tokens,
        num_seqs=1,
        num_prefill_seqs=1,
        prefill_attention_pairs=tokens * context + tokens * (tokens + 1) // 2,
        prefill_kv_tokens=context + tokens,
    )


def test_defaults_are_the_documented_ones() -> None:
    assert RooflineEfficiency() == RooflineEfficiency(ETA_F, ETA_B, OVERHEAD, PER_SEQ, ALPHA)


def test_decode_batch_of_one_is_the_memory_hand_formula() -> None:
    model = RooflineCostModel(LLAMA_8B, H200)
    context = 1000
    expected = (
        WEIGHTS_READ_8B / H200_BW  # every weight but the embedding, once
        + KV_8B * (context + 1) / H200_BW  # KV read
        + KV_8B * 1 / H200_BW  # KV write of the new token
        + OVERHEAD
        + PER_SEQ
    )
    assert model.step_time(decode(1, context)) == pytest.approx(expected, rel=1e-12)
    assert model.step_time(decode(1, context)) == pytest.approx(5.006e-3, abs=1e-6)


def test_large_prefill_is_compute_bound() -> None:
    model = RooflineCostModel(LLAMA_8B, H200)
    tokens = 8192
    pairs = tokens * (tokens + 1) // 2
    linear_flops = 2 * P_LIN_8B * tokens
    attention_flops = 4 * 32 * 32 * 128 * pairs
    lm_head_bytes = 2 * 128256 * 4096  # one row of logits: the head is still memory-bound
    expected = (
        linear_flops / H200_FLOPS
        + lm_head_bytes / H200_BW
        + attention_flops / H200_FLOPS
        + KV_8B * tokens / H200_BW
        + OVERHEAD
        + PER_SEQ
    )
    got = model.step_time(prefill(tokens))
    assert got == pytest.approx(expected, rel=1e-12)
    assert got == pytest.approx((linear_flops + attention_flops) / H200_FLOPS, rel=0.02)
    assert model.breakdown(prefill(tokens))["linear"] == pytest.approx(linear_flops / H200_FLOPS)


def test_linear_layers_cross_from_memory_to_compute_near_the_ridge() -> None:
    model = RooflineCostModel(LLAMA_8B, H200)
    # Block weights are 2·P_lin + norms bytes; compute catches up at T ≈ F/B achievable.
    ridge = H200_FLOPS / H200_BW
    assert model.breakdown(decode(int(ridge * 0.9), 0))["linear"] == pytest.approx(
        (WEIGHTS_READ_8B - 2 * 128256 * 4096) / H200_BW
    )
    big = int(ridge * 1.1)
    assert model.breakdown(decode(big, 0))["linear"] == pytest.approx(
        2 * P_LIN_8B * big / H200_FLOPS
    )


def test_tensor_parallel_70b_includes_the_allreduce() -> None:
    tp8 = RooflineCostModel(LLAMA_70B, H100, tensor_parallel_size=8)
    features = decode(256, 1000)
    parts = tp8.breakdown(features)
    ring_bytes = 2 * 7 / 8 * 256 * 8192 * 2
    expected_comm = 2 * 80 * (ALPHA + ring_bytes / 450e9)
    assert parts["allreduce"] == pytest.approx(expected_comm, rel=1e-12)
    assert parts["allreduce"] == pytest.approx(6.61e-3, abs=1e-5)  # ref §4.5: "about 6 ms"
    assert tp8.step_time(features) == pytest.approx(sum(parts.values()), rel=1e-12)
    # One KV head per GPU: 2·80·1·128·2 B per token.
    assert parts["decode_attention"] == pytest.approx(40_960 * 256 * 1001 / (ETA_B * 3.35e12))
    tp1 = RooflineCostModel(LLAMA_8B, H100)
    assert tp1.breakdown(features)["allreduce"] == 0.0


def test_empty_batch_costs_nothing() -> None:
    for model in (RooflineCostModel(LLAMA_8B, H200), ProfileCostModel(COEFFS)):
        assert model.step_time(BatchFeatures()) == 0.0
    assert set(RooflineCostModel(LLAMA_8B, H200).breakdown(BatchFeatures()).values()) == {0.0}


def test_breakdown_sums_to_step_time() -> None:
    model = RooflineCostModel(LLAMA_70B, H100, tensor_parallel_size=4)
    features = BatchFeatures(
        num_prefill_tokens=500,
        num_decode_tokens=100,
        num_seqs=102,
        num_prefill_seqs=2,
        prefill_attention_pairs=400 * 3000 + 400 * 401 // 2 + 100 * 101 // 2,
        prefill_kv_tokens=3400 + 100,
        decode_kv_tokens=100 * 2001,
    )
    assert model.step_time(features) == pytest.approx(
        sum(model.breakdown(features).values()), rel=1e-12
    )


def test_bad_tensor_parallel_degree_and_efficiency() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        RooflineCostModel(LLAMA_70B, H100, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"RooflineEfficiency.memory_efficiency .* got 1.5"):
        RooflineEfficiency(memory_efficiency=1.5)
    with pytest.raises(ValueError, match=r"RooflineEfficiency.step_overhead_s .* got -0.001"):
        RooflineEfficiency(step_overhead_s=-0.001)


def test_models_satisfy_the_protocol_and_describe_as_json() -> None:
    roofline = RooflineCostModel(LLAMA_70B, H100, tensor_parallel_size=8)
    profile = ProfileCostModel(COEFFS, {"device": "H200"})
    for model in (roofline, profile):
        assert isinstance(model, CostModel)
        assert json.loads(json.dumps(model.describe())) == model.describe()
    assert roofline.describe()["tensor_parallel_size"] == 8
    assert roofline.describe()["efficiency"]["memory_efficiency"] == ETA_B
    assert profile.describe()["device"] == "H200"
    assert profile.describe()["coefficients"]["per_seq_s"] == COEFFS.per_seq_s


# --------------------------------------------------------------------------------------------
# Monotonicity

FEATURE_FIELDS = [f.name for f in dataclasses.fields(BatchFeatures)]
features_strategy = st.builds(
    BatchFeatures, **{name: st.integers(0, 200_000) for name in FEATURE_FIELDS}
)
MONOTONE_MODELS = [
    RooflineCostModel(LLAMA_8B, H200),
    RooflineCostModel(LLAMA_70B, H100, tensor_parallel_size=8),
    RooflineCostModel(resolve_model("qwen2.5-7b"), resolve_gpu("l40s"), tensor_parallel_size=2),
]


@settings(max_examples=150, deadline=None)
@given(
    features=features_strategy,
    field=st.sampled_from(FEATURE_FIELDS),
    bump=st.integers(1, 100_000),
    which=st.integers(0, len(MONOTONE_MODELS)),
)
def test_step_time_never_decreases_when_a_feature_grows(
    features: BatchFeatures, field: str, bump: int, which: int
) -> None:
    model: CostModel = MONOTONE_MODELS[which] if which < len(MONOTONE_MODELS) else PROFILE
    grown = dataclasses.replace(features, **{field: getattr(features, field) + bump})
    assert model.step_time(grown) >= model.step_time(features) >= 0.0


# --------------------------------------------------------------------------------------------
# Profile model

COEFFS = ProfileCoefficients(
    constant_s=2.1e-3,
    per_prefill_token_s=7.5e-5,
    per_decode_token_s=3.0e-5,
    per_seq_s=4.0e-6,
    per_prefill_attention_pair_s=1.2e-9,
    per_decode_kv_token_s=2.5e-8,
)
PROFILE = ProfileCostModel(COEFFS)


@given(features=features_strategy)
@settings(max_examples=100, deadline=None)
def test_profile_is_the_exact_linear_combination(features: BatchFeatures) -> None:
    expected = (
        2.1e-3
        + 7.5e-5 * features.num_prefill_tokens
        + 3.0e-5 * features.num_decode_tokens
        + 4.0e-6 * features.num_seqs
        + 1.2e-9 * features.prefill_attention_pairs
        + 2.5e-8 * features.decode_kv_tokens
    )
    got = PROFILE.step_time(features)
    assert got == (expected if features.num_tokens else 0.0)


def test_profile_hand_example() -> None:
    features = BatchFeatures(
        num_prefill_tokens=100,
        num_decode_tokens=10,
        num_seqs=11,
        num_prefill_seqs=1,
        prefill_attention_pairs=5050,
        prefill_kv_tokens=100,
        decode_kv_tokens=10_010,
    )
    expected = 2.1e-3 + 7.5e-3 + 3.0e-4 + 4.4e-5 + 6.06e-6 + 2.5025e-4
    assert PROFILE.step_time(features) == pytest.approx(expected, rel=1e-14)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ProfileCoefficients)])
def test_profile_coefficients_must_be_non_negative(field: str) -> None:
    with pytest.raises(ValueError, match=rf"ProfileCoefficients.{field} .* got -1e-06"):
        dataclasses.replace(COEFFS, **{field: -1e-6})
    with pytest.raises(ValueError, match=rf"ProfileCoefficients.{field} .* got nan"):
        dataclasses.replace(COEFFS, **{field: float("nan")})


# --------------------------------------------------------------------------------------------
# API server


def test_api_server_cost() -> None:
    cost = ApiServerCost(per_request_s=1e-3, per_prompt_token_s=2e-6)
    assert cost.time(0) == 1e-3
    assert cost.time(1000) == pytest.approx(3e-3, rel=1e-15)
    assert ApiServerCost() == ApiServerCost(0.5e-3, 1e-6)
    with pytest.raises(ValueError, match="prompt_len .* got -1"):
        cost.time(-1)
    with pytest.raises(ValueError, match=r"ApiServerCost.per_request_s .* got -1"):
        ApiServerCost(per_request_s=-1)


# --------------------------------------------------------------------------------------------
# Decode runs in bulk

BULK_MODELS: list[CostModel] = [
    *MONOTONE_MODELS,
    RooflineCostModel(LLAMA_8B, resolve_gpu("b200"), efficiency=RooflineEfficiency(
        flops_efficiency=0.005, memory_efficiency=0.97)),  # decode attention compute-bound
    PROFILE,
    ProfileCostModel(ProfileCoefficients(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)),
    ProfileCostModel(ProfileCoefficients(-0.0, 1e-3, 0.0, 3.3e-7, 0.0, 1.7e-9)),
]


def decode_run_step_times(model: CostModel, num_seqs: int, decode_kv_tokens: int,
                          count: int) -> list[float]:
    """What `decode_run_times` computes, by `step_time` per step (the generic path)."""
    return [model.step_time(BatchFeatures(num_decode_tokens=num_seqs, num_seqs=num_seqs,
                                          decode_kv_tokens=decode_kv_tokens + k * num_seqs))
            for k in range(count)]


@settings(max_examples=300, deadline=None)
@given(which=st.integers(0, len(BULK_MODELS) - 1), num_seqs=st.integers(0, 5000),
       kv=st.integers(0, 10**9), count=st.integers(0, 70))
def test_decode_run_times_are_step_time_bit_for_bit(which: int, num_seqs: int, kv: int,
                                                    count: int) -> None:
    model = BULK_MODELS[which]
    timer = decode_run_timer(model)
    assert timer is not None
    got = timer(num_seqs, kv, count)
    expected = decode_run_step_times(model, num_seqs, kv, count)
    assert len(got) == count
    assert [t.hex() for t in got] == [float(t).hex() for t in expected]


def test_decode_run_timer_falls_back_without_a_bulk_form() -> None:
    class PerStep:
        def step_time(self, features: BatchFeatures) -> float:
            return 1e-3 * features.decode_kv_tokens

        def describe(self) -> dict[str, object]:
            return {}

    class Overriding(RooflineCostModel):  # its own step_time: the inherited bulk form is not it
        __slots__ = ()

        def step_time(self, features: BatchFeatures) -> float:
            return 2 * super().step_time(features)

    assert decode_run_timer(PerStep()) is None  # type: ignore[arg-type]
    assert decode_run_timer(Overriding(LLAMA_8B, H200)) is None
    assert decode_run_step_times(PerStep(), 3, 10, 3) == [1e-3 * 10, 1e-3 * 13, 1e-3 * 16]  # type: ignore[arg-type]
