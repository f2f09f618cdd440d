"""The tiny model's tokenizer is rt's ByteTokenizer as a Hugging Face tokenizer (its decoder
giving merged outputs the token-by-token text), and its shape is one vLLM's CPU backend
serves (head size 32, 2,048 positions)."""

from __future__ import annotations

import random
from pathlib import Path

from backends.engine.setup import load_tokenizer
from backends.engine.text import ByteTokenizer, HfCodec, simple_chat_text
from backends.engine.tiny_model import TinyLlamaSpec, build_tiny_llama, byte_tokenizer


def test_byte_tokenizer_matches_rt_bytetokenizer() -> None:
    hf, rt = HfCodec(byte_tokenizer(512)), ByteTokenizer(512)
    rng = random.Random(0)
    for _ in range(100):
        text = "".join(chr(rng.randrange(9, 0x3000)) for _ in range(rng.randrange(1, 30)))
        assert hf.encode(text) == rt.encode(text), text
        ids = [rng.randrange(0, 512) for _ in range(rng.randrange(1, 30))]
        assert hf.decode(ids) == rt.decode(ids), ids
    assert hf.encode("hello") == [107, 104, 111, 111, 114]  # 3 + byte, no BOS
    assert hf.decode([259, 259 + 95, 511]) == "  " + chr(32 + (511 - 259) % 95)


def _stepped(codec: HfCodec, chunks: list[list[int]]) -> str:
    decoder = codec.decoder()
    return "".join(decoder.step(chunk) for chunk in chunks)


def test_merged_outputs_decode_as_one_token_at_a_time() -> None:
    """The API server merges a stream's queued outputs when its reader falls behind; the
    text must be what vLLM's token-by-token detokenizer gives. Here the last 3 ids end in
    an incomplete byte sequence: one at a time, the 2 before it still show ("?8"); merged,
    the whole step was held and lost (the request ends there). And 500 random cuttings."""
    codec = HfCodec(byte_tokenizer(512))
    ids = [451, 263, 480, 253, 58, 157, 285, 152, 364, 66, 283, 173]
    one_by_one = _stepped(codec, [[i] for i in ids])
    assert one_by_one == '"$?\ufffd7\ufffd:\ufffd*?8'
    assert _stepped(codec, [ids[:9], ids[9:]]) == one_by_one
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(512) for _ in range(12)]
        cuts = sorted(rng.sample(range(1, 12), 3))
        chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, 12], strict=True)]
        assert _stepped(codec, chunks) == _stepped(codec, [[i] for i in ids]), chunks


def test_byte_tokenizer_chat_template_is_rt_fallback() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    hf, rt = HfCodec(byte_tokenizer(512)), ByteTokenizer(512)
    assert hf.chat_prompt(messages) == rt.chat_prompt(messages)
    assert hf.decode(hf.chat_prompt(messages)) == simple_chat_text(messages)


def test_tiny_model_dir_has_a_vllm_cpu_shape_and_a_tokenizer(tmp_path: Path) -> None:
    spec = TinyLlamaSpec()
    assert spec.hidden_size // spec.num_heads == 32 and spec.max_position_embeddings == 2048
    path = build_tiny_llama(tmp_path / "tiny")
    tokenizer = load_tokenizer(path)
    assert tokenizer is not None and len(tokenizer) == spec.vocab_size
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
