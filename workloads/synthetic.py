"""Synthetic traces with `vllm bench serve` flags: random, prefix repetition, multi-turn, resample.

One integer seed (vLLM's `--seed`, carried by `ArrivalProcess.seed`) drives everything: the
arrival gaps come from `numpy.random.RandomState(seed)` (`workloads.arrivals`) and the lengths
from `numpy.random.default_rng(seed)`, the generator vLLM's datasets use.

**random** (`--dataset-name random`), as vLLM's `RandomDataset`: with `r = --random-range-ratio`
(0 <= r < 1), input lengths are drawn first as `rng.integers(floor(I*(1-r)), ceil(I*(1+r)) + 1,
size=N)` and output lengths second as `rng.integers(max(floor(O*(1-r)), 1), max(ceil(O*(1+r)),
1) + 1, size=N)`, I = `--random-input-len` minus the tokenizer's special tokens (0 here unless
given), O = `--random-output-len`. So for the same seed, rt and vLLM get the same lengths and the
same arrival times. Each prompt is `--random-prefix-len` tokens shared by every request
(stream `p:random-prefix`) followed by its own input tokens: prompt_len = prefix + input.
The token ids themselves are rt's (`workloads.tokens`), not vLLM's tokenizer-dependent ones.

**prefix_repetition**: `num_prefixes` shared prefixes (`p:prefix-<k>`) of `prefix_len` tokens,
each request one of them (balanced, shuffled by the seed) plus `suffix_len` unique tokens, and
`output_len` output tokens.

**multi_turn**: conversations of `num_turns` turns; conversation starts follow the arrival
process, turn t arrives `turn_gap_s` x t seconds after its conversation's start. Turn t's prompt
is turn t-1's prompt, then turn t-1's output tokens (`o:<id>`), then a new user message, so the
later prompt contains the earlier prompt and output token for token. User-message and output
lengths use the random dataset's ranges; an optional shared system prompt of `prefix_len`
tokens opens every conversation.

**resample**: (prompt_len, output_len) pairs drawn with replacement from a loaded trace, so the
joint length distribution is the trace's empirical one; arrivals from the arrival process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from workloads.arrivals import ArrivalProcess
from workloads.errors import TraceError
from workloads.stats import time_stats
from workloads.trace import MAX_ARRIVAL_S, MAX_TOKENS, UNIQUE_PREFIX, Span, Trace, TraceRequest

RANDOM_PREFIX_KEY = "p:random-prefix"  # stream of the shared --random-prefix-len tokens
MAX_PREFIXES = 1 << 20  # --prefix-repetition-num-prefixes' limit (a count)
# --num-prompts at most (2^24): 1e20 was numpy's "Maximum allowed dimension exceeded"; a
# million requests take ~13 s and 0.5 GB to generate here, this many ~4 min and ~8 GB
MAX_REQUESTS = 1 << 24


@dataclass(frozen=True, slots=True)
class RandomLengths:
    """vLLM's random-dataset lengths (tokens): `input_len`, `output_len`, `range_ratio` in
    [0, 1), shared `prefix_len`, and the tokenizer's `num_special_tokens` that vLLM subtracts
    from `input_len` (0 unless you mirror a specific tokenizer)."""

    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_special_tokens: int = 0

    def __post_init__(self) -> None:
        _in_range(self.input_len, 0, "--random-input-len")
        _in_range(self.output_len, 1, "--random-output-len")
        _in_range(self.prefix_len, 0, "--random-prefix-len")
        _at_least(self.num_special_tokens, 0, "num_special_tokens")
        if not 0.0 <= self.range_ratio < 1.0:
            raise TraceError("must be in [0, 1)", column="--random-range-ratio",
                             value=self.range_ratio)
        # the longest prompt (shared prefix + the longest draw) and output, each <= MAX_TOKENS
        _fits(self.prefix_len + self.input_bounds()[1], "--random-input-len", self.input_len,
              "with --random-prefix-len and --random-range-ratio")
        _fits(self.output_bounds()[1], "--random-output-len", self.output_len,
              "with --random-range-ratio")

    def input_bounds(self) -> tuple[int, int]:
        """Inclusive [low, high] of the sampled input length (prefix excluded)."""
        real = max(0, self.input_len - self.num_special_tokens)
        return (math.floor(real * (1 - self.range_ratio)),
                math.ceil(real * (1 + self.range_ratio)))

    def output_bounds(self) -> tuple[int, int]:
        """Inclusive [low, high] of the sampled output length (at least 1)."""
        return (max(math.floor(self.output_len * (1 - self.range_ratio)), 1),
                max(math.ceil(self.output_len * (1 + self.range_ratio)), 1))

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`n` input and `n` output lengths, drawn in vLLM's order (inputs first)."""
        in_low, in_high = self.input_bounds()
        if self.prefix_len + in_low < 1:
            raise TraceError("prompts could be empty: raise --random-input-len or "
                             "--random-prefix-len", column="--random-input-len",
                             value=self.input_len)
        out_low, out_high = self.output_bounds()
        inputs = rng.integers(in_low, in_high + 1, size=n)
        outputs = rng.integers(out_low, out_high + 1, size=n)
        return inputs, outputs


@dataclass(frozen=True, slots=True)
class PrefixRepetition:
    """vLLM's prefix-repetition workload (tokens): `num_prefixes` prefixes of `prefix_len`,
    `suffix_len` unique tokens per request, `output_len` output tokens."""

    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128

    def __post_init__(self) -> None:
        _in_range(self.prefix_len, 0, "--prefix-repetition-prefix-len")
        _in_range(self.suffix_len, 0, "--prefix-repetition-suffix-len")
        _at_least(self.num_prefixes, 1, "--prefix-repetition-num-prefixes")
        if self.num_prefixes > MAX_PREFIXES:  # a count of prefixes, not tokens
            raise TraceError(f"must be <= {MAX_PREFIXES:,}",
                             column="--prefix-repetition-num-prefixes", value=self.num_prefixes)
        _in_range(self.output_len, 1, "--prefix-repetition-output-len")
        _at_least(self.prefix_len + self.suffix_len, 1, "--prefix-repetition-suffix-len")
        _fits(self.prefix_len + self.suffix_len, "--prefix-repetition-suffix-len",
              self.suffix_len, "with --prefix-repetition-prefix-len")


@dataclass(frozen=True, slots=True)
class MultiTurn:
    """Multi-turn conversations: `num_turns` turns each, turn t at start + t x `turn_gap_s`
    seconds; message and output lengths from `lengths` (its prefix_len is the system prompt)."""

    num_turns: int = 4
    turn_gap_s: float = 10.0
    lengths: RandomLengths = field(default_factory=lambda: RandomLengths(256, 128))

    def __post_init__(self) -> None:
        _at_least(self.num_turns, 1, "--multi-turn-num-turns")
        # the last turn's prompt: the system prompt, every message and output before it,
        # and its own message
        lengths, turns = self.lengths, self.num_turns
        longest = (lengths.prefix_len + turns * lengths.input_bounds()[1]
                   + (turns - 1) * lengths.output_bounds()[1])
        _fits(longest, "--multi-turn-num-turns", turns,
              "with the message, output and system prompt lengths")
        if not (math.isfinite(self.turn_gap_s) and self.turn_gap_s >= 0):
            raise TraceError("must be a finite number >= 0 seconds",
                             column="--multi-turn-gap-s", value=self.turn_gap_s)
        if (turns - 1) * self.turn_gap_s > MAX_ARRIVAL_S:  # the last turn, from its start
            raise TraceError(f"{turns} turns span {(turns - 1) * self.turn_gap_s:.4g} s, past "
                             f"the {MAX_ARRIVAL_S:,.0f} s (194 days) a trace may span",
                             column="--multi-turn-gap-s", value=self.turn_gap_s)


def random_trace(num_prompts: int, lengths: RandomLengths, arrivals: ArrivalProcess) -> Trace:
    """`vllm bench serve --dataset-name random`: same lengths and arrival times per seed."""
    _requests(num_prompts)
    inputs, outputs = lengths.sample(np.random.default_rng(arrivals.seed), num_prompts)
    times = arrivals.arrival_times(num_prompts)
    requests = [_prefixed(str(i), float(times[i]), RANDOM_PREFIX_KEY, lengths.prefix_len,
                          int(inputs[i]), int(outputs[i])) for i in range(num_prompts)]
    return Trace(tuple(requests), name="random")


def prefix_repetition_trace(num_prompts: int, spec: PrefixRepetition,
                            arrivals: ArrivalProcess) -> Trace:
    """Requests sharing one of `spec.num_prefixes` prefixes each (balanced, seed-shuffled)."""
    _requests(num_prompts)
    rng = np.random.default_rng(arrivals.seed)
    which = rng.permutation(np.arange(num_prompts) % spec.num_prefixes)
    times = arrivals.arrival_times(num_prompts)
    requests = [_prefixed(str(i), float(times[i]), f"p:prefix-{int(which[i])}",
                          spec.prefix_len, spec.suffix_len, spec.output_len)
                for i in range(num_prompts)]
    return Trace(tuple(requests), name="prefix_repetition")


def multi_turn_trace(num_prompts: int, spec: MultiTurn, arrivals: ArrivalProcess) -> Trace:
    """`num_prompts` requests in ceil(num_prompts / num_turns) conversations (the last one
    may be shorter); ids are "<conversation>-<turn>", session ids "<conversation>"."""
    _requests(num_prompts)
    conversations = -(-num_prompts // spec.num_turns)
    user, out = spec.lengths.sample(np.random.default_rng(arrivals.seed), num_prompts)
    starts = arrivals.arrival_times(conversations)
    requests: list[TraceRequest] = []
    for conv in range(conversations):
        first = conv * spec.num_turns
        turns = min(spec.num_turns, num_prompts - first)
        requests += _conversation(conv, float(starts[conv]), spec,
                                  user[first:first + turns], out[first:first + turns])
    requests.sort(key=lambda r: r.arrival_s)  # stable: turns of one conversation stay ordered
    return Trace(tuple(requests), name="multi_turn")


def resample_trace(source: Trace, num_prompts: int, arrivals: ArrivalProcess) -> Trace:
    """Lengths drawn jointly with replacement from `source`; unique prompts; new arrivals."""
    _requests(num_prompts)
    if len(source) == 0:
        raise TraceError("cannot resample an empty trace", column="--dataset-path")
    cols = source.columns()
    pick = np.random.default_rng(arrivals.seed).integers(0, len(source), size=num_prompts)
    times = arrivals.arrival_times(num_prompts)
    requests = [TraceRequest(str(i), float(times[i]), int(cols.prompt_len[j]),
                        int(cols.output_len[j])) for i, j in enumerate(pick)]
    return Trace(tuple(requests), name=f"resample:{source.name}")


def resample_like(source: Trace, seed: int, num_requests: int | None = None) -> Trace:
    """Other requests like `source`'s: `num_requests` of them (default: as many), lengths
    resampled from it, Poisson arrivals at its mean rate (all at t = 0 when it has no span),
    drawn from `seed`."""
    stats = time_stats(source.columns().arrival_s) if len(source) else None
    rate = stats.mean_rate if stats is not None else math.inf
    count = len(source) if num_requests is None else num_requests
    return resample_trace(source, count, ArrivalProcess(rate, 1.0, seed))


def _conversation(conv: int, start: float, spec: MultiTurn, user: np.ndarray,
                  out: np.ndarray) -> list[TraceRequest]:
    system = spec.lengths.prefix_len
    segments: list[Span] = [Span(RANDOM_PREFIX_KEY, system)] if system else []
    requests: list[TraceRequest] = []
    for turn, (user_len, out_len) in enumerate(zip(user.tolist(), out.tolist(), strict=True)):
        rid = f"{conv}-{turn}"
        if turn:
            previous = requests[-1]
            segments.append(Span(previous.output_key, previous.output_len))
        if user_len:
            segments.append(Span(UNIQUE_PREFIX + rid, user_len))
        requests.append(TraceRequest(rid, start + turn * spec.turn_gap_s,
                                sum(s.length for s in segments), out_len,
                                segments=tuple(segments), session_id=str(conv)))
    return requests


def _prefixed(rid: str, arrival_s: float, prefix_key: str, prefix_len: int, own_len: int,
              output_len: int) -> TraceRequest:
    """A request of `prefix_len` shared tokens then `own_len` unique ones."""
    if prefix_len == 0:
        return TraceRequest(rid, arrival_s, own_len, output_len)
    spans = [Span(prefix_key, prefix_len)]
    if own_len:
        spans.append(Span(UNIQUE_PREFIX + rid, own_len))
    return TraceRequest(rid, arrival_s, prefix_len + own_len, output_len, segments=tuple(spans))


def _at_least(value: int, minimum: int, option: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"must be an integer >= {minimum}", column=option, value=value)


def _requests(num_prompts: int) -> None:
    """--num-prompts: at least 1, at most `MAX_REQUESTS`."""
    _at_least(num_prompts, 1, "--num-prompts")
    if num_prompts > MAX_REQUESTS:
        raise TraceError(f"must be <= {MAX_REQUESTS:,}", column="--num-prompts",
                         value=num_prompts)


def _in_range(value: int, minimum: int, option: str) -> None:
    """`_at_least`, and at most `MAX_TOKENS` (a length in tokens)."""
    _at_least(value, minimum, option)
    if value > MAX_TOKENS:
        raise TraceError(f"must be <= {MAX_TOKENS:,}", column=option, value=value)


def _fits(tokens: int, option: str, value: int, combined: str) -> None:
    """TraceError naming `option` and its `value` when the lengths it sets, `combined` with
    the others named, reach `tokens` > `MAX_TOKENS` (a request's length)."""
    if tokens > MAX_TOKENS:
        raise TraceError(f"{combined} makes requests of up to {tokens:,} tokens, more than "
                         f"{MAX_TOKENS:,}", column=option, value=value)
