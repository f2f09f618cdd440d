"""Decode runs of a replica whose KV events a router reads (`sim.fleet`).

A run's pool events are published together, stamped with the run's end. That is exact when
every step of the run ends by `limit_s`, the next routing decision minus the KV-event delay:
a decision then sees all of them, as it would have seen each at its own step's end, and no
earlier decision is left to see fewer. So a run is allowed only that far: its steps are
timed one at a time before any of them runs, and the first one that would end past the
limit cuts the run before it (the run is timed again without it; nothing ran yet).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from runtime.batch import BatchFeatures
from sim.simulator import EngineProcess


class _PastLimit(Exception):
    def __init__(self, start_s: float) -> None:
        super().__init__(start_s)
        self.start_s = start_s


def run_before(process: EngineProcess, clock: float, horizon: float,
               limit_s: float) -> float | None:
    """`EngineProcess.fast_forward` from `clock` with steps starting before `horizon` and
    ending by `limit_s` (seconds): the run's end, or None when no step fits."""
    horizon = min(horizon, limit_s)
    while horizon > clock:
        try:
            plan = process.core.plan_run(clock, horizon, _timer(process, limit_s),
                                         process.upcoming)
        except _PastLimit as past:
            horizon = past.start_s  # not run: time it again without that step
            continue
        end = None if plan is None else process.core.run_plan(plan)
        if end is not None and process.config.check_invariants:
            process.core.sync()
            process.core.scheduler.check_invariants()
        return end
    return None


def _timer(process: EngineProcess, limit_s: float) -> Callable[[BatchFeatures, float], float]:
    """Step durations in step order (as `EngineProcess.step_time`), raising `_PastLimit` at
    the first step that would end past `limit_s`."""
    indices = itertools.count(process.core.recorder.num_steps)

    def timed(features: BatchFeatures, start_s: float) -> float:
        duration = process.step_time(features, next(indices), start_s)
        if start_s + duration > limit_s:
            raise _PastLimit(start_s)
        return duration

    return timed
