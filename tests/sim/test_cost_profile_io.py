"""The rt-profile JSON file: round trip and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runtime.batch import BatchFeatures
from sim.cost.api_server import ApiServerCost
from sim.cost.profile_model import ProfileCoefficients
from sim.profile import (
    Profile,
    load_profile,
    profile_from_json_dict,
    shipped_profile,
    write_profile,
)

PROFILE = Profile(
    device="H200-SXM-141GB",
    model="Llama-3.1-8B",
    dtype="bfloat16",
    versions={"vllm": "0.19.1", "torch": "2.13.0"},
    date="2026-05-01T12:00:00Z",
    coefficients=ProfileCoefficients(
        constant_s=2.0e-3,
        per_prefill_token_s=6.0e-5,
        per_decode_token_s=2.0e-5,
        per_seq_s=3.0e-6,
        per_prefill_attention_pair_s=1.0e-9,
        per_decode_kv_token_s=2.0e-8,
    ),
    api_server=ApiServerCost(per_request_s=4e-4, per_prompt_token_s=1.5e-6),
    fit={"samples": 1200, "r2": 0.998},
)


def valid_json() -> dict[str, Any]:
    return PROFILE.to_json_dict()


@pytest.mark.parametrize("fit", [PROFILE.fit, None])
def test_round_trip(tmp_path: Path, fit: dict[str, Any] | None) -> None:
    profile = Profile(**{**{f: getattr(PROFILE, f) for f in PROFILE.__slots__}, "fit": fit})
    path = tmp_path / "p.json"
    write_profile(profile, path)
    assert load_profile(path) == profile
    text = path.read_text()
    assert text.endswith("}\n")
    data = json.loads(text)
    assert (data["format"], data["version"]) == ("rt-profile", 1)
    assert ("fit" in data) == (fit is not None)


def test_the_loaded_profile_drives_the_cost_model(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(valid_json()))
    model = load_profile(path).cost_model()
    features = BatchFeatures(num_decode_tokens=4, num_seqs=4, decode_kv_tokens=400)
    assert model.step_time(features) == 2.0e-3 + 2.0e-5 * 4 + 3.0e-6 * 4 + 2.0e-8 * 400
    assert model.describe()["device"] == "H200-SXM-141GB"
    assert model.describe()["versions"] == {"vllm": "0.19.1", "torch": "2.13.0"}


def edited(path: tuple[str, ...], value: object) -> dict[str, Any]:
    data = valid_json()
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


BAD: list[tuple[dict[str, Any] | list[int], str]] = [
    (edited(("coefficients", "per_seq_s"), -2e-6), "'coefficients.per_seq_s'"),
    (edited(("coefficients", "constant_s"), KeyError), "missing field 'coefficients.constant_s'"),
    (edited(("coefficients", "per_decode_token_s"), "fast"), "got 'fast'"),
    (edited(("coefficients", "per_decode_token_s"), True), "got True"),
    (edited(("coefficients", "per_decode_kv_token"), 1.0), "unknown field"),
    (edited(("api_server", "per_request_s"), -1), "'api_server.per_request_s'"),
    (edited(("api_server",), KeyError), "missing field 'api_server'"),
    (edited(("format",), "vidur"), "field 'format' must be 'rt-profile', got 'vidur'"),
    (edited(("version",), 3), "field 'version' must be one of [1, 2], got 3"),
    (edited(("step_time_stalls",), {"probability": 0.1, "quantiles_s": [0.0, 1e-3]}),
     "field 'step_time_stalls' needs 'version' 2 (got 1)"),
    (edited(("device",), ""), "field 'device' must be a non-empty string"),
    (edited(("versions",), {"vllm": 19}), "field 'versions.vllm' must be a string, got 19"),
    (edited(("fit",), [1, 2]), "field 'fit' must be a JSON object"),
    (edited(("coefficients",), 3), "field 'coefficients' must be a JSON object, got 3"),
    ([1, 2], "must be a JSON object"),
    # once a simulation, then a numpy error in its metrics (an int64 overflow)
    (edited(("coefficients", "constant_s"), 1e308),
     "field 'coefficients.constant_s' must be <= 60 s, got 1e+308"),
    (edited(("api_server", "per_request_s"), 61.0),
     "field 'api_server.per_request_s' must be <= 60 s, got 61.0"),
]


@pytest.mark.parametrize(("data", "message"), BAD)
def test_bad_profile_gives_one_line_naming_file_field_and_value(
    tmp_path: Path, data: object, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        load_profile(path)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"{path}: ")
    assert message in text


def test_negative_value_is_shown() -> None:
    with pytest.raises(ValueError, match=r"^x.json: field 'coefficients.per_seq_s' .* got -2e-06$"):
        profile_from_json_dict(edited(("coefficients", "per_seq_s"), -2e-6), "x.json")


def test_unreadable_files(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"format": "rt-profile",')
    with pytest.raises(ValueError, match=r"broken.json: not valid JSON \(") as info:
        load_profile(path)
    assert "\n" not in str(info.value)
    path.write_text('{"coefficients": {"constant_s": NaN}}')
    with pytest.raises(ValueError, match="broken.json: "):
        load_profile(path)
    with pytest.raises(ValueError, match="missing.json: no such profile file"):
        load_profile(tmp_path / "missing.json")
    path.write_text("[" * 100_000 + "]" * 100_000)  # once a RecursionError traceback
    with pytest.raises(ValueError, match=r"broken.json: not valid JSON \(nested too deeply\)$"):
        load_profile(path)


def test_profile_calibrated_is_the_shipped_one_for_gpu_and_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sim.profile
    from sim.engine_args import EngineArgs, build_setup

    monkeypatch.setattr(sim.profile, "SHIPPED_PROFILES", tmp_path)
    with pytest.raises(ValueError, match=r"no profile for --gpu h200 --model llama-3.1-8b "
                                         r"\(shipped: none yet\)"):
        build_setup(EngineArgs(), "llama-3.1-8b", "h200", "calibrated")
    profile = Profile(device="H200", model="llama-3.1-8b", dtype="bfloat16",
                      versions={"rt": "0"}, date="2026-11-30T00:00:00+00:00",
                      coefficients=ProfileCoefficients(1e-3, 1e-6, 1e-5, 1e-5, 0.0, 1e-8))
    write_profile(profile, tmp_path / "h200--llama-3.1-8b.json")
    setup = build_setup(EngineArgs(), "llama-3.1-8b", "H200", "calibrated")
    assert setup.cost_model.coefficients == profile.coefficients  # type: ignore[attr-defined]
    assert setup.profile_path == str(tmp_path / "h200--llama-3.1-8b.json")
    with pytest.raises(ValueError, match=r"--model qwen2.5-7b \(shipped: h200 \+ llama-3.1-8b\)"):
        build_setup(EngineArgs(), "qwen2.5-7b", "h200", "calibrated")


def test_the_shipped_h200_profile_loads_and_times_a_step() -> None:
    """sim/profiles/h200--llama-3.1-8b.json (fitted on the device from an H200's two
    calibration replays, 2026-12-04 17:29 UTC, dbdb93a): it parses, keeps the fit's record (3
    stall steps left out of 3,696), and its coefficients (19.57 ms a step + 0.281 ms a sequence
    + 2.20e-8 s a prefill attention pair) give a 16-sequence decode step 24.08 ms and a
    512-token prefill 22.75 ms (rt's host-bound engine: ~20-30 ms a step)."""
    profile = load_profile(shipped_profile("h200", "llama-3.1-8b"))
    assert profile.device == "NVIDIA H200" and profile.model == "llama-3.1-8b"
    assert profile.fit is not None
    assert profile.fit["left_out_stalls"]["steps"] == 3 and profile.fit["replay_steps"] == 3696
    model = profile.cost_model()
    decode = model.step_time(BatchFeatures(num_decode_tokens=16, num_seqs=16,
                                           decode_kv_tokens=16 * 600))
    pairs = 512 * 513 // 2
    prefill = model.step_time(BatchFeatures(num_prefill_tokens=512, num_seqs=1,
                                            num_prefill_seqs=1, prefill_attention_pairs=pairs,
                                            prefill_kv_tokens=512))
    c = profile.coefficients
    assert decode == pytest.approx(c.constant_s + 16 * c.per_seq_s)
    assert prefill == pytest.approx(c.constant_s + c.per_seq_s
                                    + pairs * c.per_prefill_attention_pair_s)
    # hand-computed from the file's coefficients: 0.0195749 + 16 x 0.000281265 s, and
    # 0.0195749 + 0.000281265 + 131,328 x 2.20149e-8 s
    assert decode == pytest.approx(0.024075, abs=1e-6)
    assert prefill == pytest.approx(0.022747, abs=1e-6)
