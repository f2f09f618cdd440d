"""Stop strings as vLLM 0.32's detokenizer checks them (backends/serve/stop_strings.py), on
ByteTokenizer text (ASCII: one token per character)."""

from __future__ import annotations

from backends.engine.sampling_options import SamplingOptions
from backends.engine.text import ByteTokenizer
from backends.serve.engine_client import OutputQueue
from backends.serve.messages import EngineOutputs, RequestOutput, SchedulerStats
from backends.serve.metrics import ServeMetrics
from backends.serve.openai_protocol import Parsed
from backends.serve.request_state import RequestState
from backends.serve.server import ServeConfig, Server
from backends.serve.stop_strings import StopMatch, StopStringText, find_stop
from runtime import SamplingParams

CODEC = ByteTokenizer(512)


def _text(stops: tuple[str, ...], include: bool = False, min_tokens: int = 0
          ) -> StopStringText:
    return StopStringText(CODEC.decoder(), stops, include, min_tokens)


def _run(text: StopStringText, outputs: list[str], last_is_stop_token: bool = False
         ) -> list[tuple[str, str | None, int]]:
    """Feed each string as one engine output; (delta, matched stop, tokens kept) each."""
    steps = []
    for i, chunk in enumerate(outputs):
        final = i == len(outputs) - 1
        step = text.step(CODEC.encode(chunk), last_is_stop_token and final, final)
        steps.append((step.delta, step.match.stop if step.match else None, step.num_kept))
        if step.match:
            break
    return steps


def test_find_stop_takes_the_one_that_completes_first() -> None:
    assert find_stop("abcdef", 3, ["ef", "de"]) == StopMatch("de", 3, 5)
    assert find_stop("abcdef", 3, ["cd", "x"]) == StopMatch("cd", 2, 4)  # starts before
    assert find_stop("abcdef", 2, ["bc"]) is None  # ended before the new text
    assert find_stop("aXbX", 4, ["X", "aX"]) == StopMatch("X", 1, 2)  # ties: list order
    assert find_stop("aXbX", 4, ["aX", "X"]) == StopMatch("aX", 0, 2)
    assert find_stop("abc", 0, ["c"]) is None


def test_one_token_per_output_holds_back_and_cuts_before_the_stop() -> None:
    steps = _run(_text(("lo w",)), list("hello world"))
    # 3 characters held back (len - 1); "lo w" completes at the 7th token: "hel" is left
    assert steps == [("", None, 1)] * 3 + [("h", None, 1), ("e", None, 1), ("l", None, 1),
                                           ("", "lo w", 1)]


def test_include_stop_str_in_output_keeps_it_and_holds_nothing_back() -> None:
    steps = _run(_text(("\n",), include=True), ["ab", "c\nd", "e"])
    assert steps == [("ab", None, 2), ("c\n", "\n", 2)]


def test_merged_outputs_drop_the_tokens_after_the_stop() -> None:
    steps = _run(_text(("cd", "bc")), ["abcdef"])
    assert steps == [("a", "bc", 3)]  # "bc" completes first, at the 3rd token


def test_min_tokens_defers_the_check_past_its_tokens() -> None:
    """vLLM: no check until more than min_tokens outputs, then only the text the tokens
    past the min_tokens-th added (a stop string ending inside the first ones is missed)."""
    steps = _run(_text(("x",), min_tokens=2), ["x", "x", "ax"])
    assert steps == [("x", None, 1), ("x", None, 1), ("a", "x", 2)]
    steps = _run(_text(("x",), min_tokens=2), ["xxax"])
    assert steps == [("xxa", "x", 4)]


def test_a_stop_token_s_text_is_left_out_and_the_rest_released_at_the_end() -> None:
    steps = _run(_text(("zz",)), ["ab", "cd"], last_is_stop_token=True)
    assert steps == [("a", None, 2), ("bc", None, 2)]  # "d" (the stop token) left out


# ---- the server: a stop string's finish, metrics and the engine ------------------------------


def _stats() -> SchedulerStats:
    return SchedulerStats(1, 0, 0.1, 0, 0, 0)


def _stop_server() -> tuple[Server, RequestState, list[str]]:
    """A Server (no engine process) with one request whose stop string is "cd"; the engine's
    abort is recorded in the list returned."""
    server = Server(ServeConfig("m", lambda: None))
    server.metrics = ServeMetrics("m", 256, 64, 16, True)
    server.codec = CODEC
    aborted: list[str] = []
    server.engine.abort = aborted.append  # type: ignore[method-assign,assignment]
    parsed = Parsed([5, 6, 7], SamplingParams(max_tokens=9), SamplingOptions(), False, False,
                    False, stop=("cd",))
    gen = RequestState("r", parsed, 0.0, CODEC.decoder(), OutputQueue())
    gen.stops = StopStringText(gen.decoder, parsed.stop, False, 0)
    server.gens["r"] = gen
    server.awaiting_first = 1
    return server, gen, aborted


def _histogram(server: Server, name: str) -> tuple[float | None, float | None]:
    """(count, sum) of one of the server's histograms."""
    assert server.metrics is not None
    labels = {"model_name": "m", "engine": "0"}
    get = server.metrics.registry.get_sample_value
    return get(f"{name}_count", labels), get(f"{name}_sum", labels)


def test_a_stop_string_finish_aborts_and_feeds_the_phase_histograms() -> None:
    """vLLM observes the queue/prefill/decode/inference times (and TPOT) of a request its
    detokenizer stopped: the engine's queued and scheduled times come with the first
    output, the token times are the steps' (engine clock)."""
    server, gen, aborted = _stop_server()
    outputs = [(10.0, RequestOutput("r", CODEC.encode("ab"), queued_s=9.0, scheduled_s=9.5)),
               (10.25, RequestOutput("r", CODEC.encode("x"))),
               (10.75, RequestOutput("r", CODEC.encode("cde")))]
    texts = []
    for timestamp, out in outputs:
        server.on_outputs(EngineOutputs(timestamp, [out], _stats()))
        gen.queue.put_nowait(out)
        texts.append(server._next(gen)[0])
    assert "".join(texts) == "abx" and aborted == ["r"] and "r" not in server.gens
    assert (gen.finish_reason, gen.stop_reason, gen.output_len) == ("stop", "cd", 5)
    assert _histogram(server, "vllm:request_queue_time_seconds") == (1, 0.5)
    assert _histogram(server, "vllm:request_prefill_time_seconds") == (1, 0.5)
    assert _histogram(server, "vllm:request_decode_time_seconds") == (1, 0.75)
    assert _histogram(server, "vllm:request_inference_time_seconds") == (1, 1.25)
    assert _histogram(server, "vllm:request_time_per_output_token_seconds") == (1, 0.75 / 4)
    server.engine.input.close(linger=0)
    server.engine.output.close(linger=0)
    server.engine.context.term()
    server.engine.tmpdir.cleanup()


def test_a_stop_string_before_a_stop_token_in_one_output_wins() -> None:
    """The engine stopped on a stop token (its text left out) and the same output completed
    a stop string earlier: the string is the stop reason, the stop token is dropped from the
    tokens kept (vLLM's offsets hold the skipped token at the text's end)."""
    steps = _run(_text(("cz", "q")), ["ab", "czd"], last_is_stop_token=True)
    assert steps == [("a", None, 2), ("b", "cz", 2)]
