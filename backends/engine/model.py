"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) with rt's own forward pass.

transformers loads the weights and supplies the rotary embedding (so every RoPE scaling type
is exactly transformers'); the forward over a flattened mixed batch is ours:

    embed -> per layer: RMSNorm, q/k/v proj (+bias: Qwen2), q/k RMSNorm over head_dim
    (Qwen3), RoPE, reshape_and_cache into the paged KV cache, paged attention, o_proj,
    residual, RMSNorm, SwiGLU MLP, residual -> final RMSNorm and LM head on the sampling
    rows only.

Shapes: T = tokens in the step (all requests, flattened), S = sequences, H/Hkv = query/KV
heads, D = head_dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from backends.engine.attention import AttentionOps
from backends.engine.kv_cache import KVCache

if TYPE_CHECKING:  # transformers is imported where it is used (a second or more)
    from transformers import PreTrainedModel

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where the step's tokens go in the paged KV cache and what they attend to.

    Attributes:
        slot_mapping: [T] int64, block_id * block_size + offset of each new token's K/V.
        block_tables: [S, max_blocks] int32, each sequence's block ids (zero padded).
        seq_lens: [S] int32, KV length of each sequence after this step's tokens.
        query_start_loc: [S + 1] int32, query rows of sequence s are [qsl[s], qsl[s+1]).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the KV cache and the runner need to know of a model."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]


def resolve_dtype(name: str, device: torch.device, config_dtype: Any = None) -> torch.dtype:
    """`auto`: float32 on the CPU; on CUDA the checkpoint's dtype (bfloat16 if fp32/unset)."""
    if name in _DTYPES:
        return _DTYPES[name]
    if name != "auto":
        raise ValueError(f"--dtype must be auto, {', '.join(_DTYPES)}; got {name!r}")
    if device.type == "cpu":
        return torch.float32
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def load_config(model_dir: Path) -> Any:
    """The directory's transformers config; ValueError (one line) when it is missing, not
    a Llama-family decoder, or uses attention rt does not run (sliding windows)."""
    from transformers import AutoConfig

    if not model_dir.is_dir():
        raise ValueError(f"--model {model_dir}: not a directory")
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {model_dir}: no config.json (a local Hugging Face model "
                         "directory is needed)")
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--model {model_dir}: unreadable config.json: {first}") from err
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"--model {model_dir}: unsupported architecture {model_type!r} "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(f"--model {model_dir}: sliding-window attention layers are not "
                         "supported")
    return config


def _shape(config: Any) -> ModelShape:
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    eos = config.eos_token_id
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ModelShape(
        model_type=config.model_type, num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or
        config.num_attention_heads,
        head_dim=head_dim, vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings, eos_token_ids=eos_ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalise in fp32, cast back, then scale. [..., dim]"""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos, sin [T, D] (already scaled by the rope's attention factor)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


# A module whose forward maps a tensor to a tensor, held as what it is called as
# (nn.Module.__call__ is typed as returning Any): no wrapper call on the forward path.
TensorMap = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's modules and RMSNorm weights, looked up once (transformers'
    Llama-family layout: self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj)."""

    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    q_proj: TensorMap  # [T, hidden] -> [T, H * D]
    k_proj: TensorMap  # [T, hidden] -> [T, Hkv * D]
    v_proj: TensorMap  # [T, hidden] -> [T, Hkv * D]
    o_proj: TensorMap  # [T, H * D] -> [T, hidden]
    q_norm: torch.Tensor | None  # [D], Qwen3's RMSNorm over head_dim; None elsewhere
    k_norm: torch.Tensor | None  # [D], as q_norm
    gate_proj: TensorMap  # [T, hidden] -> [T, intermediate]
    up_proj: TensorMap  # [T, hidden] -> [T, intermediate]
    down_proj: TensorMap  # [T, intermediate] -> [T, hidden]

    @classmethod
    def of(cls, layer: nn.Module) -> _Layer:
        attn = layer.get_submodule("self_attn")
        qk_norm = hasattr(attn, "q_norm")
        return cls(
            input_norm=layer.get_parameter("input_layernorm.weight"),
            post_attention_norm=layer.get_parameter("post_attention_layernorm.weight"),
            q_proj=attn.get_submodule("q_proj"), k_proj=attn.get_submodule("k_proj"),
            v_proj=attn.get_submodule("v_proj"), o_proj=attn.get_submodule("o_proj"),
            q_norm=attn.get_parameter("q_norm.weight") if qk_norm else None,
            k_norm=attn.get_parameter("k_norm.weight") if qk_norm else None,
            gate_proj=layer.get_submodule("mlp.gate_proj"),
            up_proj=layer.get_submodule("mlp.up_proj"),
            down_proj=layer.get_submodule("mlp.down_proj"))


class PagedModel:
    """A loaded Llama-family model run by rt's forward over the paged KV cache."""

    def __init__(self, hf_model: PreTrainedModel, ops: AttentionOps) -> None:
        self.hf_model = hf_model
        self.config = hf_model.config
        self.shape = _shape(self.config)
        self.ops = ops
        self.embed_tokens: nn.Module = hf_model.get_submodule("model.embed_tokens")
        self.embed: TensorMap = self.embed_tokens  # [T] token ids -> [T, hidden]
        # model.layers is an nn.ModuleList: its children are the layers in order
        self.layers = [_Layer.of(layer)
                       for layer in hf_model.get_submodule("model.layers").children()]
        self.norm_weight = hf_model.get_parameter("model.norm.weight")  # [hidden]
        self.rotary_emb = hf_model.get_submodule("model.rotary_emb")
        self.lm_head: TensorMap = hf_model.get_submodule("lm_head")
        self.eps = float(self.config.rms_norm_eps)
        self.scale = float(self.shape.head_dim) ** -0.5
        from transformers.activations import ACT2FN

        self.act: TensorMap = ACT2FN[self.config.hidden_act]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.get_parameter("weight").device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.get_parameter("weight").dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64; logits_indices [N] int64 rows that sample.
        Returns logits [N, vocab] in fp32."""
        hidden = self.embed(input_ids)  # [T, hidden]
        cos: torch.Tensor
        sin: torch.Tensor
        cos, sin = self.rotary_emb(hidden, positions[None, :])  # [1, T, D] each
        cos, sin = cos[0], sin[0]
        for index, layer in enumerate(self.layers):
            hidden = self._layer(layer, hidden, cos, sin, meta, kv_cache, index)
        hidden = rms_norm(hidden[logits_indices], self.norm_weight, self.eps)  # [N, hidden]
        return self.lm_head(hidden).float()

    def _layer(self, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
               index: int) -> torch.Tensor:
        x = rms_norm(hidden, layer.input_norm, self.eps)
        hidden = hidden + self._attention(layer, x, cos, sin, meta, kv_cache, index)
        x = rms_norm(hidden, layer.post_attention_norm, self.eps)
        return hidden + self._mlp(layer, x)

    def _attention(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                   index: int) -> torch.Tensor:
        """x [T, hidden] -> attention output after o_proj, [T, hidden]."""
        shape = self.shape
        num_tokens = x.shape[0]
        q = layer.q_proj(x).view(num_tokens, shape.num_heads, shape.head_dim)
        k = layer.k_proj(x).view(num_tokens, shape.num_kv_heads, shape.head_dim)
        v = layer.v_proj(x).view(num_tokens, shape.num_kv_heads, shape.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3, before RoPE
            q = rms_norm(q, layer.q_norm, self.eps)
            k = rms_norm(k, layer.k_norm, self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        key_cache, value_cache = kv_cache.key_caches[index], kv_cache.value_caches[index]
        self.ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = self.ops.paged_attention(q.contiguous(), key_cache, value_cache,
                                       meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, self.scale)  # [T, H, D]
        return layer.o_proj(out.reshape(num_tokens, shape.num_heads * shape.head_dim))

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: down(act(gate(x)) * up(x)), [T, hidden]."""
        return layer.down_proj(self.act(layer.gate_proj(x)) * layer.up_proj(x))


def load_model(model_dir: Path, dtype: str, device: torch.device,
               ops: AttentionOps, random_weights_seed: int | None = None) -> PagedModel:
    """Load a local Llama-family model directory; ValueError (one line) for anything that
    is not one. With `random_weights_seed`, only its config.json is read and the weights
    are initialised at random from that seed, directly on `device` (an 8B model in seconds,
    nothing read from disk)."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    config = load_config(model_dir)
    torch_dtype = resolve_dtype(dtype, device, getattr(config, "dtype", None))
    try:
        if random_weights_seed is not None:
            torch.manual_seed(random_weights_seed)
            with torch.device(device):
                hf_model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    except (OSError, ValueError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--model {model_dir}: cannot load the weights: {first}") from err
    hf_model.eval()
    try:
        hf_model.to(device)
    except RuntimeError as err:  # CUDA out of memory and the like
        first = str(err).strip().splitlines()[0]
        raise ValueError(f"--model {model_dir}: does not fit on {device}: {first}") from err
    return PagedModel(hf_model, ops)
