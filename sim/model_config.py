"""Dense decoder-only transformer shapes (Llama family), the sizes derived from them, and
the reader of a local Hugging Face config.json (`ModelSpec.from_hf_config`).

The derived sizes are pinned by tests against `/work/shared/reference/models_and_gpus.md`
§1b. All models here use a SiLU-gated MLP (gate, up, down), pre-RMSNorm, no MLP bias and no
o_proj bias. The named presets and `resolve_model` are `sim.model_presets`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Architecture of one model.

    Attributes:
        name: display name.
        hidden_size: h.
        num_layers: L.
        num_q_heads: n_q.
        num_kv_heads: n_kv (grouped-query attention when < n_q).
        head_dim: d.
        intermediate_size: I, the MLP width.
        vocab_size: V.
        tie_word_embeddings: the LM head is the embedding matrix.
        max_position_embeddings: the longest context the config declares, tokens.
        dtype_bytes: bytes per weight and per KV element (2 for bf16).
        qkv_bias: q, k and v projections carry a bias (Qwen2).
        qk_norm: RMSNorm over head_dim on q and k (Qwen3).
    """

    name: str
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype_bytes: int = 2
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelSpec.name must be a non-empty string, got {self.name!r}")
        for field in (
            "hidden_size",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "dtype_bytes",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelSpec.{field} must be a positive integer, got {value!r}")
        if self.num_q_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelSpec.num_kv_heads must divide num_q_heads={self.num_q_heads}, "
                f"got {self.num_kv_heads}"
            )
        for flag in ("tie_word_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"ModelSpec.{flag} must be a bool, got {getattr(self, flag)!r}")

    @property
    def linear_params(self) -> int:
        """P_lin: weights of the block linears (q, k, v, o, gate, up, down) over all layers."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * d * (self.num_q_heads + 2 * self.num_kv_heads)
        o = self.num_q_heads * d * h
        mlp = 3 * h * self.intermediate_size
        return self.num_layers * (qkv + o + mlp)

    @property
    def small_params(self) -> int:
        """Norm weights and biases: two RMSNorms per layer plus the final one, q/k norms,
        qkv biases."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        if self.qk_norm:
            norms += 2 * self.num_layers * self.head_dim
        biases = 0
        if self.qkv_bias:
            biases = self.num_layers * (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim
        return norms + biases

    @property
    def embedding_params(self) -> int:
        """V·h: the embedding table (also the LM head when tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """Every parameter: P_lin + norms + biases + embedding + LM head (if untied)."""
        heads = 1 if self.tie_word_embeddings else 2
        return self.linear_params + self.small_params + heads * self.embedding_params

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights in memory."""
        return self.total_params * self.dtype_bytes

    @property
    def weight_bytes_read_per_step(self) -> int:
        """Bytes of weights one forward pass streams from memory: every weight but the
        embedding table, which is only gathered row by row; the LM head is included (it is
        the embedding matrix when tied)."""
        params = self.linear_params + self.small_params + self.embedding_params
        return params * self.dtype_bytes

    @property
    def lm_head_bytes(self) -> int:
        """Bytes of the LM head matrix, V·h·b."""
        return self.embedding_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token over all layers: 2 (K and V) · L · n_kv · d · b."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def kv_heads_per_gpu(self, tensor_parallel_size: int) -> int:
        """KV heads one GPU holds under tensor parallelism: n_kv/t, or 1 when t > n_kv
        (vLLM then replicates KV heads). ValueError for a degree vLLM rejects."""
        t = tensor_parallel_size
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {t!r}")
        if self.num_q_heads % t != 0:
            raise ValueError(
                f"tensor_parallel_size={t} does not divide {self.name}'s "
                f"{self.num_q_heads} attention heads"
            )
        if self.num_kv_heads % t != 0 and t % self.num_kv_heads != 0:
            raise ValueError(
                f"tensor_parallel_size={t} neither divides nor is a multiple of {self.name}'s "
                f"{self.num_kv_heads} KV heads"
            )
        return max(self.num_kv_heads // t, 1)

    def kv_bytes_per_token_per_gpu(self, tensor_parallel_size: int) -> int:
        """KV cache bytes per token on one GPU under tensor parallelism."""
        kv_heads = self.kv_heads_per_gpu(tensor_parallel_size)
        return 2 * self.num_layers * kv_heads * self.head_dim * self.dtype_bytes

    def describe(self) -> dict[str, Any]:
        """JSON-ready fields and derived sizes."""
        return {
            "name": self.name,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_q_heads": self.num_q_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "dtype_bytes": self.dtype_bytes,
            "qkv_bias": self.qkv_bias,
            "qk_norm": self.qk_norm,
            "total_params": self.total_params,
            "linear_params": self.linear_params,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelSpec:
        """A ModelSpec from a local Hugging Face config.json (or a directory holding one) of
        a dense Llama-family model. ValueError, one line naming the file, on bad input."""
        return _from_hf_config(Path(path))


def _read_json_object(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _field(file: Path, config: dict[str, Any], key: str) -> int:
    if key not in config or config[key] is None:
        raise ValueError(f"{file}: missing field {key!r}")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{file}: field {key!r} must be a positive integer, got {value!r}")
    return value


def _dtype_bytes(file: Path, config: dict[str, Any]) -> int:
    # transformers 5.x writes "dtype"; 4.x wrote "torch_dtype".
    dtype = config.get("dtype", config.get("torch_dtype", "bfloat16"))
    if dtype is None:
        return 2
    key = str(dtype).removeprefix("torch.")
    if key not in _DTYPE_BYTES:
        raise ValueError(f"{file}: field 'dtype' has unsupported value {dtype!r}")
    return _DTYPE_BYTES[key]


def _from_hf_config(path: Path) -> ModelSpec:
    file = path / "config.json" if path.is_dir() else path
    config = _read_json_object(file)
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}  # a multimodal wrapper's language model
    for moe_key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(moe_key):
            raise ValueError(f"{file}: mixture-of-experts configs ({moe_key!r}) are not supported")
    hidden = _field(file, config, "hidden_size")
    num_heads = _field(file, config, "num_attention_heads")
    if config.get("num_key_value_heads") is None:
        num_kv = num_heads  # HF convention: absent means multi-head attention
    else:
        num_kv = _field(file, config, "num_key_value_heads")
    if config.get("head_dim") is None:
        if hidden % num_heads != 0:
            raise ValueError(
                f"{file}: missing field 'head_dim' and hidden_size={hidden} is not a "
                f"multiple of num_attention_heads={num_heads}"
            )
        head_dim = hidden // num_heads
    else:
        head_dim = _field(file, config, "head_dim")
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise ValueError(f"{file}: field 'tie_word_embeddings' must be a bool, got {tied!r}")
    model_type = str(config.get("model_type", ""))
    qkv_bias = config.get("attention_bias", model_type == "qwen2")
    if not isinstance(qkv_bias, bool):
        raise ValueError(f"{file}: field 'attention_bias' must be a bool, got {qkv_bias!r}")
    name = config.get("_name_or_path") or file.resolve().parent.name or "model"
    num_layers = _field(file, config, "num_hidden_layers")
    intermediate = _field(file, config, "intermediate_size")
    vocab = _field(file, config, "vocab_size")
    max_positions = _field(file, config, "max_position_embeddings")
    dtype_bytes = _dtype_bytes(file, config)
    try:
        return ModelSpec(
            name=str(name),
            hidden_size=hidden,
            num_layers=num_layers,
            num_q_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            intermediate_size=intermediate,
            vocab_size=vocab,
            tie_word_embeddings=tied,
            max_position_embeddings=max_positions,
            dtype_bytes=dtype_bytes,
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
        )
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from None
