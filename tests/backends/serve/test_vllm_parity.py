"""`rt serve` measured the way vLLM's own tools measure it (issue 19): the chat stream's first
chunk with `choices` comes with the first token, the prompt-token counters after a prefix hit,
and `--simulate --model DIR` tokenizing with DIR's tokenizer under DIR's name."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.engine.sampling_options import SamplingOptions
from backends.engine.text import ByteTokenizer
from backends.serve.engine_client import OutputQueue
from backends.serve.messages import RequestOutput
from backends.serve.metrics import ServeMetrics
from backends.serve.openai_protocol import Parsed
from backends.serve.request_state import RequestState
from backends.serve.server import ServeConfig, Server
from runtime import SamplingParams

from .test_serve import Served


def _never_called() -> None:
    raise AssertionError("the engine is not started in this test")


def test_chat_role_chunk_waits_for_the_first_token() -> None:
    """No chunk carrying `choices` before the engine's first output: vLLM's client stamps
    TTFT at the first such chunk (vLLM sends the role chunk with the first token)."""

    async def scenario() -> list[tuple[bool, dict]]:
        server = Server(ServeConfig("m", _never_called))
        server.metrics = ServeMetrics("m", 256, 64, 16, True)
        codec = ByteTokenizer(512)
        parsed = Parsed([5, 6, 7], SamplingParams(max_tokens=2), SamplingOptions(), True,
                        False, False)
        gen = RequestState("r", parsed, 0.0, codec.decoder(), OutputQueue())
        server.gens["r"] = gen
        server.awaiting_first = 1
        token_sent = False
        chunks: list[tuple[bool, dict]] = []

        async def consume() -> None:
            async for data in server.stream(gen, "m", chat=True):
                for text in data.decode().split("\n\n"):  # the end: several in one write
                    if text.startswith("data: {"):
                        chunks.append((token_sent, json.loads(text[6:])))

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)  # the engine is still prefilling
        assert chunks == []
        token_sent = True
        gen.queue.put_nowait(RequestOutput("r", [3 + ord("h")]))
        await asyncio.sleep(0.01)  # written before the next step's output (no merge)
        gen.queue.put_nowait(RequestOutput("r", [3 + ord("i")], finish_reason="length"))
        await asyncio.wait_for(task, 5)
        engine = server.engine
        engine.input.close(linger=0)
        engine.output.close(linger=0)
        engine.context.term()
        engine.tmpdir.cleanup()
        return chunks

    chunks = asyncio.run(scenario())
    with_choices = [(after, c) for after, c in chunks if c.get("choices")]
    assert all(after for after, _ in with_choices)
    deltas = [c["choices"][0]["delta"] for _, c in with_choices]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "h"}, {"content": "i"}]


def test_outputs_queued_behind_a_slow_write_merge_into_one_chunk() -> None:
    """vLLM's RequestOutputCollector (delta mode): a stream that fell behind the engine
    catches up with one chunk carrying the queued tokens; an error behind them still ends
    the stream, after them."""
    from backends.serve.api_error import EngineDeadError
    from backends.serve.request_state import merge_queued

    gen = RequestState("r", Parsed([5], SamplingParams(max_tokens=9), SamplingOptions(), True,
                                  False, False), 0.0, ByteTokenizer(512).decoder(),
                      OutputQueue())
    for token in (1, 2, 3):
        gen.queue.put_nowait(RequestOutput("r", [token]))
    gen.queue.put_nowait(EngineDeadError())
    first = gen.queue.get_nowait()
    merged = merge_queued(gen, first)
    assert isinstance(merged, RequestOutput) and merged.new_token_ids == [1, 2, 3]
    assert isinstance(gen.deferred, EngineDeadError) and gen.queue.empty()
    gen.deferred = None
    gen.queue.put_nowait(RequestOutput("r", [5], finish_reason="length"))
    gen.queue.put_nowait(RequestOutput("r", [6]))  # never behind a final output
    done = merge_queued(gen, RequestOutput("r", [4]))
    assert isinstance(done, RequestOutput) and done.new_token_ids == [4, 5]
    assert done.finish_reason == "length" and gen.queue.qsize() == 1


@pytest.fixture(scope="module")
def fresh_simulated() -> Iterator[Served]:
    server = Served(["--simulate", "--max-model-len", "4096"])
    yield server
    server.stop()


def test_prompt_token_counters_after_a_prefix_hit(fresh_simulated: Served) -> None:
    """The issue's repro: the same 320-character prompt twice, max_tokens 4. One token per
    byte: 320 prompt tokens; the second request hits 19 blocks of 16 (a prompt's last
    token is always computed, so at most 319 tokens, block-aligned: 304)."""
    url = f"{fresh_simulated.url}/v1/completions"
    prompt = "".join(chr(ord("a") + i % 26) for i in range(320))
    for _ in range(2):
        done = httpx.post(url, json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True},
                          timeout=30)
        assert done.status_code == 200
    assert done.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 304
    text = httpx.get(f"{fresh_simulated.url}/metrics", timeout=5).text
    values = _samples(text)
    assert values["vllm:prompt_tokens_total"] == 640
    assert values["vllm:prompt_tokens_cached_total"] == 304
    assert values['vllm:prompt_tokens_by_source_total{source="local_cache_hit"}'] == 304
    assert values['vllm:prompt_tokens_by_source_total{source="local_compute"}'] == 336
    assert values["vllm:prefix_cache_hits_total"] == 304
    assert values["vllm:prefix_cache_queries_total"] == 640
    # Per step: computed prompt tokens of first outputs + new tokens (vLLM 0.32):
    # (320 + 1) + 1 + 1 + 1 and (16 + 1) + 1 + 1 + 1.
    assert values["vllm:iteration_tokens_total_sum"] == 344
    assert values["vllm:iteration_tokens_total_count"] == 8


def _samples(text: str) -> dict[str, float]:
    """Sample name (with a `source` label where present) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" in sample.labels:
                continue
            name = sample.name
            if "source" in sample.labels:
                name += f'{{source="{sample.labels["source"]}"}}'
            out[name] = out.get(name, 0.0) + sample.value
    return out


def _model_dir(path: Path) -> Path:
    """A config.json the simulator reads and a small word-level tokenizer beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "hello", "world", "again"] + [f"w{i}" for i in range(58)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 64,
              "max_position_embeddings": 2048, "head_dim": 32, "torch_dtype": "float32",
              "bos_token_id": 1, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_simulate_with_a_model_dir_uses_its_tokenizer_and_name(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "wordy")
    server = Served(["--simulate", "--model", str(model)])
    try:
        models = httpx.get(f"{server.url}/v1/models", timeout=5).json()
        assert models["data"][0]["id"] == str(model)  # vLLM's default served name
        counted = httpx.post(f"{server.url}/tokenize", timeout=5, json={
            "model": str(model), "prompt": "hello world hello again"}).json()
        assert counted["count"] == 4  # words, not the 23 bytes
        done = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
            "model": str(model), "prompt": "hello world", "max_tokens": 3,
            "ignore_eos": True}).json()
        assert done["usage"]["prompt_tokens"] == 2
    finally:
        server.stop()
