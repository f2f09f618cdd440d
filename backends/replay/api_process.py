"""The replay's API server: its own process, as vLLM's API server is to its engine core.

    API server process                      engine (the replay's main thread)
    ------------------                      ---------------------------------
    token ids made                   --->   Ready()
    waits for the clock's zero       <---   starts the clock, sends it
    at each arrival time: tokenize,  --->   HandOver(request_id, token ids, handover_s)
    ...                              --->   Done() after the last request
    on an exception                  --->   ApiServerFailed(text), then exits
    returns once `stop` is set       <---   stop (the end, an error or Ctrl-C)

A thread in the engine's process would share its GIL: a request arriving while the engine
runs Python waits for the interpreter (up to the 5 ms switch interval, measured p90 ~2 ms on
the CPU backend), a delay no serving system with a separate front end has and the simulator
does not model. Timestamps are `time.perf_counter()` seconds, which on Linux is
CLOCK_MONOTONIC, one clock for every process of the machine; hand-over times are seconds
since the start the engine sends.

This module imports no torch (the child starts in ~0.7 s with `spawn`, before the clock);
the tokenizer, if any, is pickled across. As with any `spawn` child, a script that calls
`replay()` needs the `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import multiprocessing
import queue
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as EventType
from typing import Protocol

from workloads import Trace, prompt_token_ids

_START_TIMEOUT_S = 120.0  # a tokenizer's unpickling and the texts of a long trace


class Tokenizer(Protocol):
    def encode(self, text: str) -> Sequence[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class HandOver:
    """A tokenized request leaving the API server (`handover_s`: seconds since the start)."""

    request_id: str
    prompt_token_ids: list[int]
    handover_s: float


@dataclass(frozen=True, slots=True)
class ApiServerFailed:
    """The API server raised; `message` is its exception as one line."""

    message: str


@dataclass(frozen=True, slots=True)
class Ready:
    """The API server has made every prompt's token ids (and texts) and waits for the
    clock's zero."""


@dataclass(frozen=True, slots=True)
class Done:
    """Every request of the trace has been handed over."""


Message = HandOver | ApiServerFailed | Done


def _serve(trace: Trace, vocab_size: int, seed: int, tokenizer: Tokenizer | None,
           out: Connection, zero: multiprocessing.Queue[float], stop: EventType) -> None:
    """The child's main: release, tokenize, hand over; return once `stop` is set."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    try:
        ids = {req.request_id: prompt_token_ids(req, vocab_size, seed) for req in trace}
        # Each prompt's text is made before the clock starts: detokenizing is not timed.
        texts = ({rid: tokenizer.decode(tokens) for rid, tokens in ids.items()}
                 if tokenizer is not None else {})
        out.send(Ready())
        started = _wait_for_zero(zero, stop)
        if started is None:
            return
        for req in trace:
            # A semaphore's timed wait: microsecond wake-ups (a pipe's poll rounds up to ms).
            if stop.wait(max(0.0, started + req.arrival_s - time.perf_counter())):
                return
            if tokenizer is not None:
                tokenizer.encode(texts[req.request_id])  # the real tokenizer cost
            # Sent from this thread, so the hand-over is in the engine's pipe ~30 µs after
            # its time stamp (a Queue's feeder thread adds 0.1-0.3 ms: requests that then
            # miss the step boundary they reached).
            out.send(HandOver(req.request_id, ids[req.request_id],
                              time.perf_counter() - started))
        out.send(Done())
    except BaseException as err:  # noqa: BLE001 - reported to the engine, which re-raises
        out.send(ApiServerFailed(f"{type(err).__name__}: {err}"))


def _wait_for_zero(zero: multiprocessing.Queue[float], stop: EventType) -> float | None:
    """The perf_counter() value of time 0, or None if stopped before the start."""
    while not stop.is_set():
        try:
            return float(zero.get(timeout=0.2))
        except queue.Empty:
            continue
    return None


class ApiServerProcess:
    """The engine's handle on the API-server process: `start()` (blocks until the child is
    ready), `begin(zero)`, then `get()` until Done or ApiServerFailed; `stop()` always
    (idempotent)."""

    def __init__(self, trace: Trace, vocab_size: int, seed: int,
                 tokenizer: Tokenizer | None) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process running torch
        self.inbox, self.outbox = ctx.Pipe(duplex=False)  # child -> engine
        self.zero: multiprocessing.Queue[float] = ctx.Queue()
        self.stopping = ctx.Event()
        self.process = ctx.Process(target=_serve, name="rt-api-server", daemon=True,
                                   args=(trace, vocab_size, seed, tokenizer, self.outbox,
                                         self.zero, self.stopping))

    def start(self) -> None:
        """Spawn the child and wait for its ready (RuntimeError if it fails first)."""
        self.process.start()
        self.outbox.close()  # the child's copy is the only writer: its exit reads as EOF
        message = self._get(_START_TIMEOUT_S)
        if not isinstance(message, Ready):
            self.stop()
            raise RuntimeError(f"the API server did not start: {message}")

    def begin(self, zero: float) -> None:
        """Start releasing requests; `zero` is the perf_counter() value of time 0."""
        self.zero.put(zero)

    def get(self, block: bool) -> Message | None:
        """The next message; None (nothing yet) at once when not `block` and nothing is
        queued. A child that died without a word is reported as ApiServerFailed (never a
        hang)."""
        if not block:
            message = self._receive() if self.inbox.poll() else None
        else:
            message = self._get(None)
        assert not isinstance(message, Ready), "Ready comes once, before begin()"
        return message

    def _get(self, timeout_s: float | None) -> Message | Ready:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            if self.inbox.poll(0.2):
                return self._receive()
            if not self.process.is_alive() and not self.inbox.poll():
                return self._died()
        return ApiServerFailed(f"no answer within {timeout_s:g} s")

    def _receive(self) -> Message | Ready:
        try:
            return self.inbox.recv()  # type: ignore[no-any-return]
        except EOFError:  # the child closed its end: it is gone
            return self._died()

    def _died(self) -> ApiServerFailed:
        self.process.join(timeout=1.0)
        return ApiServerFailed(f"the API server process exited ({self.process.exitcode})")

    def stop(self) -> None:
        self.stopping.set()
        if self.process.is_alive():
            self.process.join(timeout=2.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=2.0)
        self.inbox.close()
        self.zero.cancel_join_thread()
        self.zero.close()
