"""KV-cache transfers between replicas (P/D disaggregation), on a simulated clock.

A transfer of B bytes started at t alone on its link ends at

    t + latency_s + B / bandwidth_Bps

(BLIS's model: `--pd-transfer-base-latency` 0.05 ms, 25 GB/s). Transfers on one link share
its bandwidth equally while they move bytes (processor sharing, BLIS's fair-share contention):
n of them each move bandwidth / n bytes per second. The fixed latency (setup, RDMA
handshake) does not take bandwidth. Bytes are whole KV blocks: the blocks of the prompt not
already cached on the receiving side, at the model's K and V bytes per token over all layers
and tensor-parallel ranks (`sim.model_config.ModelSpec.kv_bytes_per_token`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import simpy

from runtime.kv_cache_manager import cdiv

GB = 1e9  # bytes: link speeds are decimal


@dataclass(frozen=True, slots=True)
class KvTransferConfig:
    """A link's speed: `bandwidth_Bps` bytes per second, `latency_s` fixed per transfer."""

    bandwidth_Bps: float = 25 * GB
    latency_s: float = 0.05e-3

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_Bps) and self.bandwidth_Bps > 0):
            raise ValueError(f"KV transfer bandwidth must be > 0 bytes/s, "
                             f"got {self.bandwidth_Bps}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"KV transfer latency must be >= 0 s, got {self.latency_s}")

    def alone_s(self, num_bytes: float) -> float:
        """Seconds a transfer takes with its link to itself."""
        return self.latency_s + num_bytes / self.bandwidth_Bps


def transfer_bytes(prompt_len: int, cached_tokens: int, block_size: int,
                   kv_bytes_per_token: int) -> int:
    """Bytes of the prompt's KV blocks the receiver lacks: every block of the prompt (the
    last one even if partial) but the `cached_tokens // block_size` it already holds."""
    num_blocks = cdiv(prompt_len, block_size) - cached_tokens // block_size
    return max(num_blocks, 0) * block_size * kv_bytes_per_token


_DONE_BYTES = 1e-3  # a transfer this close to done is done (float rounding of the shares)


class KvTransferLink:
    """One link (a prefill replica to a decode replica) shared by the transfers on it."""

    def __init__(self, env: simpy.Environment, config: KvTransferConfig) -> None:
        self.env = env
        self.config = config
        self._active: dict[int, tuple[list[float], Callable[[float], None]]] = {}
        self._ids = itertools.count()
        self._updated_s = 0.0  # when the remaining bytes were last brought up to date
        self._version = 0  # bumped on every change; a stale completion event is ignored

    @property
    def num_active(self) -> int:
        """Transfers moving bytes now (past their fixed latency)."""
        return len(self._active)

    def start(self, num_bytes: float, done: Callable[[float], None]) -> None:
        """Begin a transfer now; `done(end_s)` is called when its last byte has arrived."""
        if num_bytes < 0:
            raise ValueError(f"a transfer cannot move {num_bytes} bytes")
        delay = self.env.timeout(self.config.latency_s)
        delay.callbacks.append(lambda _: self._join(num_bytes, done))

    def _join(self, num_bytes: float, done: Callable[[float], None]) -> None:
        self._advance()
        self._active[next(self._ids)] = ([float(num_bytes)], done)
        self._reschedule()

    def _advance(self) -> None:
        """Take the bytes moved since the last update off every active transfer."""
        now = self.env.now
        if self._active and now > self._updated_s:
            moved = (now - self._updated_s) * self.config.bandwidth_Bps / len(self._active)
            for remaining, _ in self._active.values():
                remaining[0] -= moved
        self._updated_s = now

    def _reschedule(self) -> None:
        """Schedule the next completion: the smallest remaining transfer at the current
        share."""
        self._version += 1
        if not self._active:
            return
        first = min(self._active, key=lambda k: self._active[k][0][0])
        remaining = max(self._active[first][0][0], 0.0)
        delay = remaining * len(self._active) / self.config.bandwidth_Bps
        version = self._version
        self.env.timeout(delay).callbacks.append(lambda _: self._complete(version, first))

    def _complete(self, version: int, first: int) -> None:
        if version != self._version:
            return
        self._advance()
        done = [k for k, (remaining, _) in self._active.items()
                if k == first or remaining[0] <= _DONE_BYTES]
        callbacks = [self._active.pop(k)[1] for k in done]
        self._reschedule()
        for callback in callbacks:
            callback(self.env.now)
