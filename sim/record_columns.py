"""Finished request records as columns, the way a fleet worker's records cross a pipe
(`sim.fleet_workers`, `sim.fleet_records.ReplicaOutcome`).

Pickled one by one, a record is a slotted dataclass with a `StepTimes` of its own: on the
Azure conversation excerpt (19,366 records of 16 replicas) 0.26 s to dump and 0.26 s to load,
most of a parallel fleet's added CPU and, loaded in the parent, on its critical path. As
columns (each field a list, in field order; the token times' step runs joined into one
array with each record's bounds) the same records dump and load in a few hundredths of a
second, and are rebuilt equal: same class, same field values, token times over the same
`end_s` column (which travels once, with the step columns).
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from runtime.records import RequestRecord, StepTimes


@dataclass(frozen=True, slots=True)
class PackedTimes:
    """Token times that are all `StepTimes` over one `ends` column: their runs joined;
    record i's are runs[bounds[i]:bounds[i + 1]]."""

    ends: Sequence[float]
    runs: array[int]
    bounds: array[int]  # len(records) + 1 offsets into `runs`

    @classmethod
    def of(cls, times: Sequence[object]) -> PackedTimes | None:
        """`times` packed, or None unless every one is a `StepTimes` over the same column."""
        first = times[0] if times else None
        if not isinstance(first, StepTimes):
            return None
        ends = first.ends
        runs, bounds = array("q"), array("q", [0])
        for t in times:
            if not (isinstance(t, StepTimes) and t.ends is ends):
                return None
            runs += t.runs
            bounds.append(len(runs))
        return cls(ends, runs, bounds)

    def unpacked(self) -> list[StepTimes]:
        runs, bounds, ends = self.runs, self.bounds, self.ends
        return [StepTimes.of_runs(ends, runs[a:b])
                for a, b in zip(bounds, bounds[1:], strict=False)]


@dataclass(frozen=True, slots=True)
class RecordColumns:
    """Records of one dataclass as columns: `columns[j]` is field j of every record, in
    record order (the token times' column packed when `times` is given)."""

    kind: type[RequestRecord]
    columns: list[list[object]]
    times: PackedTimes | None  # token_times_s, packed (its column is then empty)

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> RecordColumns | None:
        """The records as columns, or None when they are not all of one class."""
        kinds = {type(record) for record in records}
        if len(kinds) != 1:
            return None
        kind = kinds.pop()
        if not all(f.init for f in dataclasses.fields(kind)):
            return None  # not rebuilt positionally
        names = [f.name for f in dataclasses.fields(kind)]
        columns: list[list[object]] = [list(map(attrgetter(name), records)) for name in names]
        at = names.index("token_times_s")
        times = PackedTimes.of(columns[at])
        if times is not None:
            columns[at] = []
        return cls(kind, columns, times)

    def records(self) -> list[RequestRecord]:
        """The records rebuilt (field values positional, in field order)."""
        columns = self.columns
        if self.times is not None:
            names = [f.name for f in dataclasses.fields(self.kind)]
            columns = list(columns)
            columns[names.index("token_times_s")] = list(self.times.unpacked())
        return list(map(self.kind, *columns))
