"""A run's steps per engine, for the interval lookups `analysis.timelines` makes: one
`StepIndex` for a single engine, one per replica of a fleet run (steps with a `replica`
column; a request's timeline is read from its own replica's steps)."""

from __future__ import annotations

import numpy as np
import pandas as pd

QUEUE_PARTS = {"token_budget": "queue_token_budget_s", "max_num_seqs": "queue_max_num_seqs_s",
               "kv_capacity": "queue_kv_capacity_s",
               "preempted_this_step": "queue_preempted_step_s"}
EPS = 1e-9


class StepIndex:
    """One engine's step intervals (in time order), for interval lookups. `replica` is the
    fleet replica the steps are of (None: a single engine)."""

    def __init__(self, steps: pd.DataFrame, replica: int | None = None) -> None:
        empty = steps.empty
        self.replica = replica
        self.step = np.empty(0, np.int64) if empty else steps["step"].to_numpy(np.int64)
        self.start = np.empty(0) if empty else steps["start_s"].to_numpy(np.float64)
        self.end = np.empty(0) if empty else steps["end_s"].to_numpy(np.float64)
        codes = {reason: i + 1 for i, reason in enumerate(QUEUE_PARTS)}  # 0: none/unknown
        self.reason_code = np.array([] if empty else [codes.get(r, 0) for r in
                                                      steps["wait_reason"]], dtype=np.int8)
        self.preempted = np.empty(0, np.int64) if empty else \
            steps["num_preempted"].to_numpy(np.int64)
        self.prefill_tokens = np.empty(0, np.int64) if empty else \
            steps["num_prefill_tokens"].to_numpy(np.int64)

    def overlapping(self, lo: float, hi: float) -> range:
        """Indices of steps whose interval overlaps [lo, hi)."""
        first = int(np.searchsorted(self.end, lo + EPS, side="left"))
        last = int(np.searchsorted(self.start, hi - EPS, side="left"))
        return range(first, max(first, last))

    def ending_in(self, lo: float, hi: float) -> range:
        """Indices of steps ending in (lo, hi]."""
        return range(int(np.searchsorted(self.end, lo + EPS, side="left")),
                     int(np.searchsorted(self.end, hi + EPS, side="left")))


class EngineSteps:
    """A run's steps per engine: one `StepIndex` per replica of a fleet run (steps with a
    `replica` column, each replica's in time order), one for a single engine."""

    def __init__(self, steps: pd.DataFrame) -> None:
        self.fleet = "replica" in steps.columns
        self.single = StepIndex(steps.iloc[:0] if self.fleet else steps)
        self.replicas: dict[int, StepIndex] = {}
        if self.fleet and not steps.empty:
            for replica, mine in steps.groupby("replica", sort=True):
                ordered = mine.sort_values("start_s", kind="stable")
                self.replicas[int(replica)] = StepIndex(ordered, int(replica))

    def of(self, replica: object) -> StepIndex:
        """The steps of `replica` (an empty index for a replica without steps); a single
        engine's steps whatever `replica` is."""
        if not self.fleet or replica is None:
            return self.single
        r = int(replica)  # type: ignore[call-overload]
        return self.replicas.setdefault(r, StepIndex(pd.DataFrame(), r))

    def sides(self, row: pd.Series) -> tuple[StepIndex, StepIndex | None]:
        """The steps a request (a row of requests.parquet) ran on, and those of the replica
        that prefilled it when that is another one (P/D); else None."""
        replica = row.get("replica") if self.fleet else None
        prefill = row.get("prefill_replica") if self.fleet else None
        elsewhere = prefill is not None and replica is not None and \
            int(prefill) != int(replica)
        return self.of(replica), self.of(prefill) if elsewhere else None
