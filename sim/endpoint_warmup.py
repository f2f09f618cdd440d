"""`rt fidelity --endpoint`'s warm-up: replays of traces resampled from TRACE, before any
measured replay, until the server's speed is steady or a bound is reached.

A fresh server's first requests are slow (connections, caches, a JIT; a CPU torch engine's
first ~100 requests ran client ITL p50 3.05 / 3.24 / 2.64 / 2.39 / 1.99 ms per 20 requests,
then 2.0-2.4 ms in the replays after them: docs/calibration.md, 2026-12-01). The warm-up is
cut into windows of `window_size(budget)` requests, each a replay of its own resampled trace
(the trace's lengths and mean rate, fresh token ids), and stops after the first window whose
client ITL median is within `WARMUP_TOLERANCE` of the window before it, or when `budget`
requests have been replayed. The windows' medians and the last step's drift are reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sim.client_steps import ClientRun
from workloads import Trace, resample_like

# Relative change of client ITL median between consecutive windows below which the server is
# steady. 20-request windows of a steady replay scatter 5-20% around its median on the 2-vCPU
# VM, so two agreeing within 5% is evidence of a steady server, not of luck alone.
WARMUP_TOLERANCE = 0.05
# The default bound: a CPU torch engine's first ~100 requests ran slow, and a 100-request
# warm-up brought the replays' p50 TTFT/ITL within 4% (docs/calibration.md, 2026-12-01).
WARMUP_REQUESTS = 100
WARMUP_WINDOWS = 5  # windows the budget is cut into (each at least MIN_WINDOW requests)
MIN_WINDOW = 10  # requests: fewer give an ITL median too noisy to compare
WarmupReplay = Callable[[Trace, Path, int], None]  # trace, run directory, token seed
ReadRun = Callable[[Path, Trace], ClientRun]


@dataclass(frozen=True, slots=True)
class WarmupWindow:
    """One warm-up window: its run directory, requests and client ITL median (ms; None when
    no request streamed two chunks)."""

    path: Path
    requests: int
    itl_median_ms: float | None


@dataclass(frozen=True, slots=True)
class Warmup:
    """The warm-up that ran: its windows in order, the bound and the tolerance."""

    windows: tuple[WarmupWindow, ...]
    budget: int
    tolerance: float = WARMUP_TOLERANCE

    @property
    def requests(self) -> int:
        return sum(w.requests for w in self.windows)

    @property
    def drift(self) -> float | None:
        """Relative change of ITL median from the second-last window to the last (a
        fraction), None with fewer than two windows or a window without ITLs."""
        if len(self.windows) < 2:
            return None
        before, last = self.windows[-2].itl_median_ms, self.windows[-1].itl_median_ms
        if before is None or last is None or before <= 0:
            return None
        return last / before - 1.0

    @property
    def stable(self) -> bool:
        drift = self.drift
        return drift is not None and abs(drift) <= self.tolerance

    def to_json_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "budget": self.budget, "tolerance": self.tolerance,
                "drift": self.drift, "stable": self.stable,
                "windows": [{"path": str(w.path), "requests": w.requests,
                             "itl_median_ms": w.itl_median_ms} for w in self.windows]}

    def lines(self) -> list[str]:
        """The console's account of the warm-up."""
        if not self.windows:
            return ["warm-up: none (--warmup-requests 0)"]
        medians = " / ".join("-" if w.itl_median_ms is None else f"{w.itl_median_ms:.2f}"
                             for w in self.windows)
        drift = self.drift
        if len(self.windows) < 2:
            how = "one window: no drift measured"
        elif drift is None:
            how = "no ITL to compare"
        else:
            how = (f"last window's drift {drift:+.1%} "
                   f"{'within' if self.stable else 'outside'} the {self.tolerance:.0%} tolerance")
        end = ("steady" if self.stable else f"stopped at the --warmup-requests bound "
               f"{self.budget}")
        return [f"warm-up: {self.requests} requests in {len(self.windows)} windows, client ITL "
                f"p50 {medians} ms; {how}: {end}"]


def window_size(budget: int) -> int:
    """Requests per warm-up window: the budget over `WARMUP_WINDOWS`, at least `MIN_WINDOW`
    (and at most the budget)."""
    return min(budget, max(MIN_WINDOW, math.ceil(budget / WARMUP_WINDOWS)))


def itl_median_ms(run: ClientRun) -> float | None:
    """Median inter-chunk gap over every request of the run, ms; None without any."""
    gaps = [np.diff(np.asarray(times)) for times in run.token_times_s.values()
            if len(times) > 1]
    values = np.concatenate(gaps) if gaps else np.empty(0)
    return float(np.median(values)) * 1e3 if values.size else None


def run_warmup(trace: Trace, budget: int, seed: int, token_seed: int, root: Path,
               replay: WarmupReplay, read: ReadRun) -> tuple[Warmup, int]:
    """Replay windows into root/warmup, root/warmup-2, ... until steady or `budget`
    requests; window k replays `resample_like(trace, seed + k, size)` (the trace's lengths
    and rate, as many requests as the window takes, however short the trace) with token seed
    `token_seed + k`. Returns the warm-up and the next unused token seed."""
    if budget < 0:
        raise ValueError(f"--warmup-requests must be >= 0, got {budget}")
    windows: list[WarmupWindow] = []
    size, done, k = (window_size(budget) if budget else 0), 0, 0
    while done < budget and len(trace):
        take = min(size, budget - done)
        source = Trace(resample_like(trace, seed + k, take).requests, f"warm-up {k + 1}")
        path = root / ("warmup" + (f"-{k + 1}" if k else ""))
        replay(source, path, token_seed + k)
        try:
            median = itl_median_ms(read(path, source))
        except ValueError:  # no request of the window streamed (a cold server failing all)
            median = None
        windows.append(WarmupWindow(path, len(source), median))
        done, k = done + len(source), k + 1
        if Warmup(tuple(windows), budget).stable:
            break
    return Warmup(tuple(windows), budget), token_seed + k
