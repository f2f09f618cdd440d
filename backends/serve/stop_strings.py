"""Stop strings, checked on the API server's side as vLLM 0.32 checks them (its output
processor's detokenizer, v1/engine/detokenizer.py): the engine only makes tokens, so the
real engine and `rt serve --simulate` stop on the same text for the same tokens.

Per engine output, the new tokens are decoded one at a time, noting the text's length after
each. Once more than `min_tokens` outputs exist, the text that those tokens added (plus the
characters before it that a stop string could start in) is searched for every stop string;
the one that completes earliest wins (ties: list order). The text is then cut before it
(after it with `include_stop_str_in_output`), the tokens after the one that completed it
are dropped (several come at once when outputs merged), and the request finishes with
`finish_reason` "stop" and `stop_reason` the string (the engine is told to abort it).

A stream holds back the last `len(longest stop string) - 1` characters until the request
finishes (a stop string may start in them), none when the stop strings are kept in the text.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from backends.engine.text import IncrementalDecoder
from backends.serve.messages import RequestOutput


@dataclass(frozen=True, slots=True)
class StopMatch:
    """A stop string found: which, and where the output text is cut (characters)."""

    stop: str
    start: int  # where the stop string starts in the text
    end: int  # where it ends

    def cut(self, include: bool) -> int:
        return self.end if include else self.start


def find_stop(text: str, new_chars: int, stops: Sequence[str]) -> StopMatch | None:
    """The stop string that completes earliest within the last `new_chars` characters of
    `text` (one that starts before them and ends inside counts), ties in `stops`' order."""
    if not new_chars or not stops:
        return None
    best: StopMatch | None = None
    for stop in stops:
        # the earliest start whose end lies in the new text: len(text) - new_chars + 1 - len
        start = text.find(stop, max(len(text) - new_chars + 1 - len(stop), 0))
        if start != -1 and (best is None or start + len(stop) < best.end):
            best = StopMatch(stop, start, start + len(stop))
    return best


@dataclass(slots=True)
class StepText:
    """What one engine output adds to a request with stop strings."""

    delta: str  # the text a client gets now
    match: StopMatch | None  # the stop string that ended it, if one did
    num_kept: int  # how many of the output's tokens count (all, unless a match dropped some)


class StopStringText:
    """A request's output text with its stop strings checked (see the module docstring)."""

    def __init__(self, decoder: IncrementalDecoder, stops: tuple[str, ...], include: bool,
                 min_tokens: int) -> None:
        self.decoder = decoder
        self.stops = stops
        self.include = include
        self.min_tokens = min_tokens
        self.hold_back = 0 if include else max(map(len, stops)) - 1  # characters
        self.text = ""
        self.sent = 0  # characters of `text` already returned
        self.num_tokens = 0  # output tokens so far, a skipped stop token included

    def step(self, new_ids: Sequence[int], skip_last: bool, finished: bool) -> StepText:
        """Decode `new_ids` (the last one's text left out when `skip_last`: a stop token),
        check the stop strings, and return the text to send (`finished`: the engine ended
        the request; a match ends it too)."""
        num_before = self.num_tokens
        offsets = [len(self.text)]  # the text's length after each new token
        for token in new_ids[:-1] if skip_last else new_ids:
            self.text += self.decoder.step((token,))
            offsets.append(len(self.text))
        if skip_last:
            offsets.append(len(self.text))
        self.num_tokens += len(new_ids)
        match = self._check(offsets, num_before)
        num_kept = len(new_ids)
        if match is not None:
            num_kept = bisect_left(offsets, match.end, lo=1)
            self.text = self.text[:match.cut(self.include)]
            finished = True
        return StepText(self._delta(finished), match, num_kept)

    def take(self, item: RequestOutput, skip_last: bool,
             running_times: tuple[float | None, float | None, float | None, float | None]
             ) -> tuple[str, RequestOutput]:
        """`item`'s text through the check; a match ends the request: the output then keeps
        the tokens up to the one that completed the stop string, `finish_reason` "stop" and
        `stop_reason` the string. Its times (queued, scheduled, first and last token) are the
        engine's last output's, or `running_times` when the engine still runs it (the API
        server's record of its outputs, as vLLM's output processor tracks them)."""
        step = self.step(item.new_token_ids, skip_last, item.finish_reason is not None)
        if step.match is None:
            return step.delta, item
        times = (item.queued_s, item.scheduled_s, item.first_token_s, item.last_token_s) \
            if item.finish_reason is not None else running_times
        stopped = RequestOutput(item.request_id, item.new_token_ids[:step.num_kept], "stop",
                                step.match.stop, item.num_cached_tokens,
                                item.num_preemptions, *times)
        return step.delta, stopped

    def _check(self, offsets: list[int], num_before: int) -> StopMatch | None:
        """vLLM checks only once more than min_tokens outputs exist, in the text the tokens
        past the min_tokens-th added."""
        if self.num_tokens <= self.min_tokens:
            return None
        checked_from = offsets[max(self.min_tokens - num_before, 0)]
        return find_stop(self.text, len(self.text) - checked_from, self.stops)

    def _delta(self, finished: bool) -> str:
        end = len(self.text) - (0 if finished else self.hold_back)
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:end], end
        return delta
