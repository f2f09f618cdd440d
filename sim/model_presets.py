"""The named models (`MODEL_PRESETS`, Hugging Face ids as `MODEL_ALIASES`) and
`resolve_model`, which takes a preset name or a local config.json / model directory.

The presets carry the published config.json values listed, with their sources, in
`/work/shared/reference/models_and_gpus.md` §1a; their derived sizes are pinned by tests
against §1b.
"""

from __future__ import annotations

from pathlib import Path

from sim.model_config import ModelSpec

# config.json values, reference §1a (sources listed there per model).
MODEL_PRESETS: dict[str, ModelSpec] = {
    # meta-llama/Llama-3.1-8B config (verbatim copy beside PARAMS = 8030261248); head_dim
    # implicit 4096/32.
    "llama-3.1-8b": ModelSpec(
        name="Llama-3.1-8B",
        hidden_size=4096,
        num_layers=32,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    # meta-llama/Meta-Llama-3.1-70B-Instruct config copies; Meta sku_list.py agrees.
    "llama-3.1-70b": ModelSpec(
        name="Llama-3.1-70B",
        hidden_size=8192,
        num_layers=80,
        num_q_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    # Llama-3.2-1B config.json (explicit head_dim 64, tied embeddings).
    "llama-3.2-1b": ModelSpec(
        name="Llama-3.2-1B",
        hidden_size=2048,
        num_layers=16,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    # Llama-3.2-3B config (unsloth / mlx-community copies of meta-llama/Llama-3.2-3B).
    "llama-3.2-3b": ModelSpec(
        name="Llama-3.2-3B",
        hidden_size=3072,
        num_layers=28,
        num_q_heads=24,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    # Qwen/Qwen2.5-7B (base) config copies; q/k/v carry biases (transformers Qwen2Attention).
    # The Instruct variant declares max_position_embeddings 32768.
    "qwen2.5-7b": ModelSpec(
        name="Qwen2.5-7B",
        hidden_size=3584,
        num_layers=28,
        num_q_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        qkv_bias=True,
    ),
    # Qwen/Qwen3-8B config.json copy; q/k RMSNorm over head_dim (modeling_qwen3).
    "qwen3-8b": ModelSpec(
        name="Qwen3-8B",
        hidden_size=4096,
        num_layers=36,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        qk_norm=True,
    ),
    # mistralai/Mistral-7B-v0.3 config (unsloth copy); v0.3 only grew the vocab to 32768.
    "mistral-7b": ModelSpec(
        name="Mistral-7B-v0.3",
        hidden_size=4096,
        num_layers=32,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=32768,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    ),
}

MODEL_ALIASES: dict[str, str] = {
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "meta-llama/meta-llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/meta-llama-3.1-70b-instruct": "llama-3.1-70b",
    "meta-llama/llama-3.2-1b": "llama-3.2-1b",
    "meta-llama/llama-3.2-1b-instruct": "llama-3.2-1b",
    "meta-llama/llama-3.2-3b": "llama-3.2-3b",
    "meta-llama/llama-3.2-3b-instruct": "llama-3.2-3b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen3-8b": "qwen3-8b",
    "mistral-7b-v0.3": "mistral-7b",
    "mistralai/mistral-7b-v0.3": "mistral-7b",
    "mistralai/mistral-7b-instruct-v0.3": "mistral-7b",
}


def resolve_model(name_or_path: str | Path) -> ModelSpec:
    """A preset by name (case-insensitive; Hugging Face ids accepted), or the model of a
    local config.json / model directory. ValueError naming the value otherwise."""
    if isinstance(name_or_path, str):
        key = name_or_path.strip().lower()
        key = MODEL_ALIASES.get(key, key)
        if key in MODEL_PRESETS:
            return MODEL_PRESETS[key]
    path = Path(name_or_path)
    if path.exists():
        return ModelSpec.from_hf_config(path)
    known = ", ".join(sorted(MODEL_PRESETS))
    raise ValueError(
        f"unknown model {str(name_or_path)!r}: not a preset and no such config.json or "
        f"directory; known models: {known}"
    )
