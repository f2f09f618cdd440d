"""Model and GPU presets: the derived sizes of the reference table, config.json loading and
lookups."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sim.hardware import GPU_PRESETS, GpuSpec, resolve_gpu
from sim.model_config import ModelSpec
from sim.model_presets import MODEL_PRESETS, resolve_model

# /work/shared/reference/models_and_gpus.md §1b: total params, P_lin, V·h, KV B/token (bf16).
DERIVED = {
    "llama-3.1-8b": (8_030_261_248, 6_979_321_856, 525_336_576, 131_072),
    "llama-3.1-70b": (70_553_706_496, 68_451_041_280, 1_050_673_152, 327_680),
    "llama-3.2-1b": (1_235_814_400, 973_078_528, 262_668_288, 32_768),
    "llama-3.2-3b": (3_212_749_824, 2_818_572_288, 394_002_432, 114_688),
    "qwen2.5-7b": (7_615_616_512, 6_525_288_448, 544_997_376, 57_344),
    "qwen3-8b": (8_190_735_360, 6_945_767_424, 622_329_856, 147_456),
    "mistral-7b": (7_248_023_552, 6_979_321_856, 134_217_728, 131_072),
}


@pytest.mark.parametrize("key", sorted(DERIVED))
def test_preset_derived_sizes_match_the_reference_table(key: str) -> None:
    model = MODEL_PRESETS[key]
    total, linear, embedding, kv = DERIVED[key]
    assert model.total_params == total
    assert model.linear_params == linear
    assert model.embedding_params == embedding
    assert model.kv_bytes_per_token == kv
    assert model.weight_bytes == 2 * total


def test_every_preset_is_pinned() -> None:
    assert set(MODEL_PRESETS) == set(DERIVED)


def test_weight_bytes_read_per_step_skip_the_embedding_gather() -> None:
    # §1b: Llama-3.1-8B streams 7.505 G params (P_lin + LM head + norms) = 15.01 GB.
    llama = MODEL_PRESETS["llama-3.1-8b"]
    assert llama.weight_bytes_read_per_step == 2 * (6_979_321_856 + 525_336_576 + 266_240)
    # Tied: the LM head is the embedding matrix, so everything is read.
    tied = MODEL_PRESETS["llama-3.2-1b"]
    assert tied.weight_bytes_read_per_step == tied.weight_bytes


def test_small_params_of_qwen() -> None:
    # §1b: Qwen2.5's qkv biases are 129,024 parameters, Qwen3's q/k norms 9,216.
    qwen25, qwen3 = MODEL_PRESETS["qwen2.5-7b"], MODEL_PRESETS["qwen3-8b"]
    assert qwen25.small_params - (2 * 28 + 1) * 3584 == 129_024
    assert qwen3.small_params - (2 * 36 + 1) * 4096 == 9_216


def test_kv_heads_under_tensor_parallelism() -> None:
    big = MODEL_PRESETS["llama-3.1-70b"]
    assert big.kv_heads_per_gpu(1) == 8
    assert big.kv_heads_per_gpu(8) == 1
    assert big.kv_heads_per_gpu(16) == 1  # replicated when t > n_kv
    assert big.kv_bytes_per_token_per_gpu(8) == 327_680 // 8
    assert big.kv_bytes_per_token_per_gpu(16) == big.kv_bytes_per_token_per_gpu(8)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        big.kv_heads_per_gpu(3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        big.kv_heads_per_gpu(0)


def test_model_spec_validates_fields() -> None:
    llama = MODEL_PRESETS["llama-3.1-8b"]
    with pytest.raises(ValueError, match="ModelSpec.hidden_size .* got 0"):
        dataclasses.replace(llama, hidden_size=0)
    with pytest.raises(ValueError, match="num_kv_heads must divide"):
        dataclasses.replace(llama, num_kv_heads=5)


# --------------------------------------------------------------------------------------------
# config.json

LLAMA_8B_CONFIG = {  # the keys transformers 5.x writes for meta-llama/Llama-3.1-8B
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "dtype": "bfloat16",
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0},
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}


def write_config(tmp_path: Path, config: dict[str, object]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_from_hf_config_reproduces_the_preset(tmp_path: Path) -> None:
    path = write_config(tmp_path, LLAMA_8B_CONFIG)
    for source in (path, tmp_path, str(tmp_path)):
        model = ModelSpec.from_hf_config(source)
        assert model.total_params == 8_030_261_248
        assert model.describe() | {"name": "x"} == MODEL_PRESETS["llama-3.1-8b"].describe() | {
            "name": "x"
        }
    assert resolve_model(str(tmp_path)).linear_params == 6_979_321_856


def test_from_hf_config_explicit_head_dim_bias_and_qk_norm(tmp_path: Path) -> None:
    qwen3 = {
        **LLAMA_8B_CONFIG,
        "model_type": "qwen3",
        "head_dim": 128,
        "num_hidden_layers": 36,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    }
    model = ModelSpec.from_hf_config(write_config(tmp_path, qwen3))
    assert model.total_params == 8_190_735_360 and model.qk_norm
    qwen2 = {
        **LLAMA_8B_CONFIG,
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "num_hidden_layers": 28,
        "intermediate_size": 18944,
        "vocab_size": 152064,
    }
    del qwen2["attention_bias"]
    assert ModelSpec.from_hf_config(write_config(tmp_path, qwen2)).total_params == 7_615_616_512
    small = {
        **LLAMA_8B_CONFIG,
        "hidden_size": 2048,
        "head_dim": 64,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    del small["dtype"]
    assert ModelSpec.from_hf_config(write_config(tmp_path, small)).total_params == 1_235_814_400


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": None}, "missing field 'num_hidden_layers'"),
        ({"vocab_size": -3}, "field 'vocab_size' must be a positive integer, got -3"),
        ({"dtype": "int3"}, "field 'dtype' has unsupported value 'int3'"),
        ({"num_local_experts": 8}, "mixture-of-experts"),
        ({"num_key_value_heads": 5}, "num_kv_heads must divide"),
    ],
)
def test_bad_config_gives_one_line_naming_the_file(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    config = {k: v for k, v in {**LLAMA_8B_CONFIG, **change}.items() if v is not None}
    path = write_config(tmp_path, config)
    with pytest.raises(ValueError) as info:
        ModelSpec.from_hf_config(path)
    text = str(info.value)
    assert "\n" not in text and text.startswith(str(path)) and message in text


def test_unreadable_config(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelSpec.from_hf_config(path)
    with pytest.raises(ValueError, match="no such file"):
        ModelSpec.from_hf_config(tmp_path / "nested")


def test_resolve_model_names() -> None:
    assert resolve_model("Llama-3.1-8B") is MODEL_PRESETS["llama-3.1-8b"]
    assert resolve_model("meta-llama/Llama-3.1-8B-Instruct") is MODEL_PRESETS["llama-3.1-8b"]
    assert resolve_model("mistralai/Mistral-7B-v0.3") is MODEL_PRESETS["mistral-7b"]
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'.*llama-3.1-8b"):
        resolve_model("gpt-5")


# --------------------------------------------------------------------------------------------
# GPUs


def test_gpu_presets_and_aliases() -> None:
    assert set(GPU_PRESETS) == {"a100-80gb", "h100-sxm", "h200", "b200", "l40s"}
    h200 = resolve_gpu("H200")
    assert h200 is resolve_gpu("h200-sxm") is GPU_PRESETS["h200"]
    assert (h200.mem_bandwidth_Bps, h200.bf16_dense_flops, h200.memory_bytes) == (
        4.8e12,
        989e12,
        141 * 10**9,
    )
    assert h200.total_memory_bytes == round(139.81 * 2**30)
    assert resolve_gpu("A100").bf16_dense_flops == 312e12
    assert resolve_gpu("h100").bf16_dense_flops == 989.4e12
    assert resolve_gpu("b200").bf16_dense_flops == 2250e12
    assert resolve_gpu("l40s").mem_bandwidth_Bps == 864e9


def test_unknown_gpu_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown GPU 'v100'; known GPUs: a100-80gb, b200"):
        resolve_gpu("v100")


def test_gpu_spec_validates() -> None:
    with pytest.raises(ValueError, match=r"GpuSpec.mem_bandwidth_Bps .* got -1"):
        GpuSpec("x", 1, -1, 1.0, 1.0)
    assert GpuSpec("x", 5, 1.0, 1.0, 1.0).total_memory_bytes == 5
