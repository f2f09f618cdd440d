"""The API process's per-token and per-request work made cheaper (docs/serve.md, "The API
process's CPU per request and per token"), each against what it replaced: the byte
tokenizer's incremental decoder against UTF-8 decoded incrementally over the same bytes,
the templated usage event against the dict-built one."""

from __future__ import annotations

import codecs
import random

from backends.engine.text import ByteTokenizer
from backends.serve.sse import ChunkEncoder, event


def _reference(tokenizer: ByteTokenizer, steps: list[list[int]]) -> list[str]:
    """What the decoder returned before: every step through the incremental UTF-8 decoder."""
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    return [utf8.decode(b"".join(tokenizer.token_bytes(t) for t in ids)) for ids in steps]


def test_the_byte_decoder_gives_what_incremental_utf8_gave() -> None:
    tokenizer = ByteTokenizer(600)
    text = "aé€😀z"  # 1-, 2-, 3- and 4-byte characters, split over steps below
    ids = [3 + b for b in text.encode()]
    fixed = [[ids[0]], [ids[1]], [ids[2], ids[3]], [ids[4]], [ids[5], ids[6]], [],
             [ids[7], ids[8], ids[9]], [ids[10]], [0, 1, 2], [259], [599], [3 + 0xFF, 100]]
    decoder = tokenizer.decoder()
    got = [decoder.step(step) for step in fixed]
    assert got == _reference(tokenizer, fixed)
    assert got == ["a", "", "é", "", "€", "", "😀", "z", "", " ", "W", "\ufffda"]
    rng = random.Random(7)
    for _ in range(300):
        steps = [[rng.choice((rng.randrange(600), 3 + rng.choice((0x41, 0xC3, 0xA9, 0xE2,
                                                                   0x82, 0xF0, 0x9F, 0xFF))))
                  for _ in range(rng.choice((1, 1, 1, 2, 3)))] for _ in range(20)]
        decoder = tokenizer.decoder()
        assert [decoder.step(step) for step in steps] == _reference(tokenizer, steps)


def test_the_usage_event_is_the_dict_built_event() -> None:
    for chat, model in ((False, "m"), (True, "llama-3.1-8b"), (False, 'qu"oted é/ü')):
        encoder = ChunkEncoder("cmpl-" + "a" * 32, "chat.completion.chunk" if chat
                               else "text_completion", 1764633600, model, chat)
        for prompt, completion, cached in ((256, 1, 0), (3, 0, 0), (4095, 128, 4080)):
            usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                     "total_tokens": prompt + completion,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            assert encoder.usage(prompt, completion, cached) == \
                event({**encoder.head, "choices": [], "usage": usage})
