"""Text <-> token ids for the API server: the model's own tokenizer, or a fallback.

The fallback (`ByteTokenizer`) serves models without a tokenizer (the tiny random Llama,
`rt serve --simulate`). It is deterministic and needs nothing but the vocabulary size:

    encode   the text's UTF-8 bytes, byte b -> id 3 + b (ids 0, 1, 2 are pad, BOS, EOS);
             with a vocabulary under 259 ids, b -> 3 + b mod (vocab_size - 3)
    decode   ids 3..258 -> those bytes (decoded as UTF-8, invalid bytes as U+FFFD);
             ids >= 259 -> one printable ASCII character, chr(32 + (id - 259) mod 95);
             ids 0..2 -> nothing

So ASCII text is one token per character and round-trips exactly (vocab >= 259), and any
generated id has a text. Streaming decodes incrementally: a multi-byte character split over
several tokens appears with the token that completes it.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any, Protocol

_SPECIAL = 3  # pad, BOS, EOS
_BYTE_END = _SPECIAL + 256


class IncrementalDecoder(Protocol):
    def step(self, new_token_ids: Sequence[int]) -> str:
        """Text that the new tokens complete (possibly empty)."""
        ...


class TextCodec(Protocol):
    """What the API server needs of a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def decoder(self) -> IncrementalDecoder: ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]: ...


def simple_chat_text(messages: list[dict[str, str]]) -> str:
    """The chat template of models without one: `role: content` lines, then `assistant:`."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])


class ByteTokenizer:
    """The deterministic fallback tokenizer (see the module docstring)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size <= _SPECIAL:
            raise ValueError(f"vocab_size must be > {_SPECIAL}, got {vocab_size}")
        self.vocab_size = vocab_size
        self._modulus = min(256, vocab_size - _SPECIAL)

    def encode(self, text: str) -> list[int]:
        modulus = self._modulus
        return [_SPECIAL + b % modulus for b in text.encode("utf-8")]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for."""
        if token_id < _SPECIAL:
            return b""
        if token_id < _BYTE_END:
            return bytes((token_id - _SPECIAL,))
        return bytes((32 + (token_id - _BYTE_END) % 95,))

    def decode(self, token_ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids).decode("utf-8", "replace")

    def decoder(self) -> IncrementalDecoder:
        return _ByteDecoder(self)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(simple_chat_text(messages))


class _ByteDecoder:
    """Incremental UTF-8 over the ids' bytes. Every step of a stream runs it (at 200 streams,
    once per stream per engine step), so the common case is short: one id, and ASCII bytes
    while no partial character is held, decode as ASCII (the same text the incremental
    UTF-8 decoder gives for them, without its Python-level buffering)."""

    __slots__ = ("token_bytes", "utf8", "held")

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.token_bytes = tokenizer.token_bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.held = False  # `utf8` holds the first bytes of an unfinished character

    def step(self, new_token_ids: Sequence[int]) -> str:
        token_bytes = self.token_bytes
        data = token_bytes(new_token_ids[0]) if len(new_token_ids) == 1 \
            else b"".join(map(token_bytes, new_token_ids))
        if not self.held and data.isascii():
            return data.decode("ascii")
        text = self.utf8.decode(data)
        self.held = bool(self.utf8.getstate()[0])
        return text


class HfCodec:
    """A Hugging Face tokenizer: its own chat template when it has one."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def decoder(self) -> IncrementalDecoder:
        return _HfDecoder(self)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return self.encode(simple_chat_text(messages))


class _HfDecoder:
    """Decodes all outputs so far and returns the new suffix; text ending in U+FFFD (a
    character still incomplete) is held back until a later token completes it, and lost
    if none does, as vLLM's detokenizer (tokenizers' DecodeStream) holds it.

    vLLM steps its detokenizer one token at a time, however many tokens an output merges;
    so does this, in effect: several new ids give the text of the longest of their
    prefixes that does not end in U+FFFD (decoding all of them when they do not: the same
    text), never nothing for the whole step because its last token is incomplete."""

    def __init__(self, codec: HfCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.emitted = 0  # characters already returned

    def step(self, new_token_ids: Sequence[int]) -> str:
        ids = self.ids
        ids.extend(new_token_ids)
        decode = self.codec.decode
        # the longest prefix through this step's tokens whose text is complete
        for end in range(len(ids), len(ids) - len(new_token_ids), -1):
            text = decode(ids if end == len(ids) else ids[:end])
            if not text.endswith("\ufffd"):
                delta = text[self.emitted:]
                self.emitted = len(text)
                return delta
        return ""
