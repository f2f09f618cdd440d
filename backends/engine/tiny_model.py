"""A tiny random-weight Llama, built with transformers and saved once to a local directory.

Nothing is downloaded: the weights come from a fixed seed, so every machine builds the same
model. It is the default model of `rt replay` and `rt serve` and the model of the engine tests.
Its shape is one that vLLM's CPU backend serves too (head size 32: the CPU attention refuses
16; 2,048 positions), and a byte-level tokenizer is saved beside it, so `vllm serve DIR` and
`vllm bench serve --tokenizer DIR` run on it (`../shared/tools/vllm_serve/`).

The tokenizer is rt's `ByteTokenizer` (`backends/engine/text.py`) written as a Hugging Face
tokenizer: the same ids for every text (but the special tokens' texts) and the same text for
every id (tested), so token counts stay one per byte and the router's byte ids
(`backends/route/prompt.py`) line up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# v2: head size 32, 2,048 positions, a tokenizer (the first, unversioned one had head size 16).
DEFAULT_TINY_DIR = Path.home() / ".cache" / "rt" / "tiny-llama-v2"
_DONE_MARK = "rt-tiny-llama.done"  # written last: a directory with it is complete


@dataclass(frozen=True, slots=True)
class TinyLlamaSpec:
    """Shape of the tiny model (defaults: 2 layers, hidden 128, 4 heads of 32, 2 KV heads,
    intermediate 256, vocab 512, 2,048 positions).

    `initializer_range` is larger than Llama's 0.02 so that logits are peaked: greedy argmax
    then has clear margins and engine-vs-transformers comparisons are robust to rounding.
    """

    num_layers: int = 2
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    initializer_range: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size <= 10:
            raise ValueError(f"vocab_size must be > 10, got {self.vocab_size}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads")


def build_tiny_llama(path: Path | None = None, spec: TinyLlamaSpec | None = None,
                     tokenizer: bool = True) -> Path:
    """Create (once) and return the directory of the tiny Llama: config.json +
    model.safetensors, fp32, and (`tokenizer`, vocabularies of >= 259 ids) the byte-level
    tokenizer. Without one, rt falls back to `ByteTokenizer`, the same ids, and a replay's
    API-server process starts ~2 s sooner (unpickling a transformers tokenizer imports
    transformers and torch). An existing complete directory is reused as is."""
    path = Path(path) if path is not None else DEFAULT_TINY_DIR
    if (path / _DONE_MARK).is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinyLlamaSpec()
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    # arg-type: transformers' `to` is @functools.wraps(nn.Module.to) and typeshed's _Wrapped
    # has no __get__, so mypy does not bind `self` (the call is the ordinary Module.to).
    model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer and spec.vocab_size >= _BYTE_END:
        byte_tokenizer(spec.vocab_size).save_pretrained(path)
    (path / _DONE_MARK).write_text("complete\n")
    return path


# %%
# The tiny model's tokenizer: rt's ByteTokenizer as a Hugging Face tokenizer

_SPECIAL = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2, as ByteTokenizer's
_BYTE_END = len(_SPECIAL) + 256
_FILLER_MARK = "\u2063"  # invisible separator: makes the extra ids' strings unique
# rt's fallback chat template (`simple_chat_text`): "role: content" lines, then "assistant:".
_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] "
                  "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer(vocab_size: int) -> Any:
    """A `PreTrainedTokenizerFast` with `ByteTokenizer`'s ids: byte b is id 3 + b (a BPE with
    no merges over the ByteLevel alphabet, so text is one token per UTF-8 byte); ids 259 and
    up are never produced by encoding and decode to one printable ASCII character,
    chr(32 + (id - 259) mod 95), as ByteTokenizer's do. No BOS is added (ByteTokenizer adds
    none). One difference: the special tokens' own texts (`<pad>`, `<s>`, `</s>`) in a prompt
    encode as those tokens, as in any Hugging Face tokenizer. Its chat template renders the
    messages as ByteTokenizer's fallback does."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    if vocab_size < _BYTE_END:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {_BYTE_END}")
    chars = _bytes_to_unicode()
    vocab = {token: i for i, token in enumerate(_SPECIAL)}
    vocab.update({chars[b]: len(_SPECIAL) + b for b in range(256)})
    for k in range(vocab_size - _BYTE_END):  # decoded: the character; the marks are dropped
        vocab[chars[32 + k % 95] + _FILLER_MARK * (k // 95 + 1)] = _BYTE_END + k
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_FILLER_MARK, ""),
                                           decoders.ByteLevel()])
    tokenizer.add_special_tokens(list(_SPECIAL))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=_SPECIAL[0], bos_token=_SPECIAL[1],
        eos_token=_SPECIAL[2], chat_template=_CHAT_TEMPLATE, model_max_length=1 << 30)


# %%
# Realistically sized random-weight Llamas (the engine benchmark on a GPU)

DEFAULT_MODELS_DIR = Path.home() / ".cache" / "rt"

# Llama-3.2-1B's shape (rope scaling left out: RoPE cost is the same).
LLAMA_3_2_1B: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "bos_token_id": 128000, "eos_token_id": 128001, "pad_token_id": 128004,
}
# Llama-3.2-3B's shape.
LLAMA_3_2_3B: dict[str, Any] = {
    **LLAMA_3_2_1B, "hidden_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 24, "head_dim": 128,
}

# Llama-3.1-8B's shape (shared/reference/models_and_gpus.md): the same family, untied.
LLAMA_3_1_8B: dict[str, Any] = {
    **LLAMA_3_2_1B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "head_dim": 128, "max_position_embeddings": 131072, "tie_word_embeddings": False,
}

# `--model NAME --random-weights`: shapes by the simulator's preset names.
CONFIG_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": LLAMA_3_2_1B, "llama-3.2-3b": LLAMA_3_2_3B, "llama-3.1-8b": LLAMA_3_1_8B,
}


def preset_config_dir(name: str, root: Path | None = None) -> Path:
    """A directory holding only the config.json of preset `name` (one of CONFIG_PRESETS),
    for `--random-weights`: written once under `root` (default ~/.cache/rt/configs)."""
    if name not in CONFIG_PRESETS:
        raise ValueError(f"--model {name}: not a directory, and not a preset "
                         f"({', '.join(CONFIG_PRESETS)}) for --random-weights")
    path = (root or DEFAULT_MODELS_DIR / "configs") / name
    if not (path / "config.json").is_file():
        from transformers import LlamaConfig

        path.mkdir(parents=True, exist_ok=True)
        LlamaConfig(**CONFIG_PRESETS[name]).save_pretrained(path)
    return path


def build_random_llama(path: Path, config_overrides: dict[str, Any], seed: int = 0,
                       dtype: str = "bfloat16", init_device: str | None = None) -> Path:
    """Create (once) and return a random-weight Llama directory (config.json +
    model.safetensors in `dtype`) of the shape `config_overrides` gives (LlamaConfig
    keyword arguments). Weights are initialised on `init_device` (default: CUDA when
    available, which takes seconds for a 1B model) from `seed`; nothing is downloaded.
    An existing complete directory is reused as is."""
    path = Path(path)
    if (path / _DONE_MARK).is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = init_device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = LlamaConfig(**config_overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(getattr(torch, dtype))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    del model
    (path / _DONE_MARK).write_text("complete\n")
    return path
