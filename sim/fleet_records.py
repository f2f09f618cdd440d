"""The records of a fleet run: the single-engine request and step rows, plus where each
request went (`replica`) and how long routing took (`routing_s`, a part of E2E of its own:
`routing_s` + `runtime.records.PART_COLUMNS` sum to E2E)."""

from __future__ import annotations

from array import array
from collections.abc import Mapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, cast

from runtime import EngineCore, Recorder
from runtime.records import REQUEST_FIELDS, RequestRecord, RunResult, new_step_columns
from sim.record_columns import RecordColumns
from workloads import Trace


@dataclass(slots=True)
class FleetRequestRecord(RequestRecord):
    """A request row of a fleet run: the single-engine columns, plus where it went.

    `routing_s` is a part of E2E of its own (arrival -> reaching the replica's API server),
    so `routing_s` + the parts of `runtime.records.PART_COLUMNS` sum to E2E.
    """

    replica: int = 0
    routing_s: float = 0.0
    router: int | None = None  # the router replica that routed it (None: one router)

    def to_row(self) -> dict[str, object]:
        row = RequestRecord.to_row(self)
        row["replica"] = self.replica
        row["routing_s"] = self.routing_s
        if self.router is not None:  # a column only with several routers
            row["router"] = self.router
        return row


FLEET_REQUEST_COLUMNS = ("replica", "routing_s")


@dataclass(slots=True)
class PDRequestRecord(FleetRequestRecord):
    """A request row of a P/D fleet run (`sim.pd`). `replica` is where it decoded (the
    replica that streams the response), `prefill_replica` where its prompt was computed
    (the same replica unless the request was disaggregated).

    `kv_transfer_s` is a part of E2E of its own: `routing_s` + `kv_transfer_s` + the parts of
    `runtime.records.PART_COLUMNS` sum to E2E. The queue parts (`queue_*`, by cause) add up
    the time queued on both replicas; `prefill_queue_s` + `decode_queue_s` splits the same
    sum by replica (decode queue: 0 unless disaggregated).
    """

    prefill_replica: int = 0
    kv_transfer_s: float = 0.0
    kv_transfer_bytes: int = 0
    prefill_queue_s: float = 0.0
    decode_queue_s: float = 0.0

    def to_row(self) -> dict[str, object]:
        row = FleetRequestRecord.to_row(self)
        for name in PD_REQUEST_COLUMNS:
            row[name] = getattr(self, name)
        return row


PD_REQUEST_COLUMNS = ("prefill_replica", "kv_transfer_s", "kv_transfer_bytes",
                      "prefill_queue_s", "decode_queue_s")
FLEET_STEP_COLUMNS = ("replica",)


@dataclass(frozen=True, slots=True)
class ReplicaSummary:
    """Per-replica totals of a fleet run."""

    replica: int
    num_requests: int
    num_steps: int
    prefix_cache_queries: int
    prefix_cache_hits: int


@dataclass(slots=True)
class FleetResult(RunResult):
    """A fleet run's records: requests (trace order, `FleetRequestRecord`), steps of every
    replica (replica-major, each replica's steps in order, with a `replica` column), the
    fleet's prefix-cache totals and one `ReplicaSummary` per replica."""

    replicas: list[ReplicaSummary] = field(default_factory=list)


def fleet_record(record: RequestRecord, replica: int, arrival_s: float,
                 router: int | None = None) -> FleetRequestRecord:
    """The replica's record timed from the trace arrival (the replica saw the request arrive
    when it reached its API server, `routing_s` later)."""
    values = _request_values(record)  # in field order: request_id, arrival_s, ...
    # one starred tuple: mypy reads positional arguments after a starred one of unknown
    # length as too many, though `values[2:]` fills exactly the fields up to `replica`
    return FleetRequestRecord(*(values[0], arrival_s, *values[2:], replica,
                                record.arrival_s - arrival_s, router))


def as_fleet_record(record: RequestRecord, replica: int, arrival_s: float,
                    router: int | None = None) -> FleetRequestRecord:
    """`fleet_record`, or the record itself when a fleet replica made it a
    `FleetRequestRecord` on arrival (`replica`, `routing_s` set: `sim.fleet_replica`) and
    nothing is left to set: it reached replica `replica` at its arrival and no router is named
    (records stay the replica's own, which drivers may read again)."""
    if (isinstance(record, FleetRequestRecord) and record.arrival_s == arrival_s
            and record.replica == replica and router is None):
        return record
    return fleet_record(record, replica, arrival_s, router)


# a record's fields as a tuple in declaration order, the fleet record's leading positional
# arguments (a dict of them and keyword arguments took 2.4x as long: ~3% of a fleet run)
_request_values = attrgetter(*REQUEST_FIELDS)
assert REQUEST_FIELDS[:2] == ("request_id", "arrival_s"), REQUEST_FIELDS


@dataclass(frozen=True, slots=True)
class ReplicaOutcome:
    """What a fleet's result reads of one replica once it has run: its finished records
    (client times, `sim.api_server.deliver_to_clients` applied), its step count and
    prefix-cache totals (its step rows: `ReplicasOutcome`). Picklable: a worker process
    sends it back (`sim.fleet_workers`)."""

    index: int  # the replica's index in the fleet
    records: list[RequestRecord]  # in finishing order
    num_steps: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    def __reduce__(self) -> tuple[object, ...]:
        """Pickled with its records as columns (`sim.record_columns`: ~10x faster)."""
        columns = RecordColumns.of(self.records)
        return (_unpickled_outcome, (self.index, self.records if columns is None else columns,
                                     self.num_steps, self.prefix_cache_queries,
                                     self.prefix_cache_hits))


def _unpickled_outcome(index: int, records: list[RequestRecord] | RecordColumns,
                       num_steps: int, queries: int, hits: int) -> ReplicaOutcome:
    if isinstance(records, RecordColumns):
        records = records.records()
    return ReplicaOutcome(index, records, num_steps, queries, hits)


def replica_outcome(index: int, core: EngineCore) -> ReplicaOutcome:
    """Replica `index`'s outcome from its engine core, every request finished."""
    recorder = core.recorder
    assert not recorder.live, f"{len(recorder.live)} requests never finished"
    stats = core.scheduler.prefix_cache_stats
    return ReplicaOutcome(index, recorder.finished, recorder.num_steps, stats.queries,
                          stats.hits)


@dataclass(frozen=True, slots=True)
class ReplicasOutcome:
    """Replicas' outcomes (a fleet's, or a worker's contiguous range of them) and their step
    rows, replica by replica in the same order."""

    replicas: list[ReplicaOutcome]
    step_columns: dict[str, MutableSequence[object]]


def replicas_outcome(replicas: Sequence[tuple[int, EngineCore]]) -> ReplicasOutcome:
    """The outcome of replicas that have run (index, core), their steps joined in order."""
    columns = _joined_steps([core.recorder for _, core in replicas])
    return ReplicasOutcome([replica_outcome(index, core) for index, core in replicas], columns)


def assembled_result(trace: Trace, parts: Sequence[ReplicasOutcome], wall_s: float,
                     router_of: Mapping[str, int] | None = None) -> FleetResult:
    """The fleet's records from the outcomes of consecutive ranges of its replicas, in
    replica order (one part: its step columns are the result's, gaining the `replica`
    column; several: joined): requests in trace order, timed from their trace arrival;
    steps replica by replica with a `replica` column; prefix-cache totals; one summary per
    replica. With `router_of` (request id -> router replica, several routers), request rows
    gain a `router` column."""
    order = {req.request_id: i for i, req in enumerate(trace)}
    arrivals = {req.request_id: req.arrival_s for req in trace}
    requests: list[RequestRecord] = []
    summaries = []
    queries = hits = 0
    joined = (dict(parts[0].step_columns) if len(parts) == 1
              else _moved_step_columns([part.step_columns for part in parts]))
    replicas = array("q")  # each step's replica
    columns: dict[str, Sequence[object]] = {**joined, "replica": replicas}
    for outcome in (replica for part in parts for replica in part.replicas):
        index = outcome.index
        requests += [as_fleet_record(record, index, arrivals[record.request_id],
                                     None if router_of is None else router_of[record.request_id])
                     for record in outcome.records]
        replicas.extend(array("q", [index]) * outcome.num_steps)
        queries += outcome.prefix_cache_queries
        hits += outcome.prefix_cache_hits
        summaries.append(ReplicaSummary(index, len(outcome.records), outcome.num_steps,
                                        outcome.prefix_cache_queries, outcome.prefix_cache_hits))
    requests.sort(key=lambda r: order[r.request_id])
    return FleetResult(requests=requests, step_columns=columns, prefix_cache_queries=queries,
                       prefix_cache_hits=hits, wall_s=wall_s, replicas=summaries)


def joined_step_columns(parts: Sequence[Mapping[str, Sequence[object]]]
                        ) -> dict[str, MutableSequence[object]]:
    """Step columns (`new_step_columns`' names and types) of `parts`, one after another."""
    columns = new_step_columns()
    _concatenate(columns, parts)
    return columns


def _moved_step_columns(parts: Sequence[dict[str, MutableSequence[object]]]
                        ) -> dict[str, MutableSequence[object]]:
    """`joined_step_columns`, each column taken out of the parts as it is joined: the parts'
    arrays and the join's are never all held at once (a parallel fleet's parent: ~80 MB on
    the Azure excerpt x16; a record's token times keep its part's `end_s`)."""
    columns = new_step_columns()
    for name, column in columns.items():
        _concatenate({name: column}, [{name: part.pop(name)} for part in parts])
    return columns


def _joined_steps(recorders: Sequence[Recorder]) -> dict[str, MutableSequence[object]]:
    """The recorders' steps, one recorder after another, typed as a single engine's (8 bytes
    a value). Recorders that share one set of columns (`Recorder(step_columns)`, run one
    after another: a pre-routed fleet's replicas) filled it in this order: it is taken as it
    is, no copy (the result's columns are the recorders'). Others are joined."""
    shared = recorders[0].step_columns if recorders else None
    if shared is not None and all(r.step_columns is shared for r in recorders):
        rows = 0
        for recorder in recorders:  # each recorder's rows follow the one before it
            assert recorder.first_row == rows, (recorder.first_row, rows)
            rows += recorder.num_steps
        assert rows == len(shared["step"]), (rows, len(shared["step"]))
        return dict(shared)
    assert all(r.first_row == 0 and r.num_steps == len(r.step_columns["step"])
               for r in recorders), "recorders sharing columns with others"
    return joined_step_columns([recorder.step_columns for recorder in recorders])


def _concatenate(columns: dict[str, MutableSequence[object]],
                 parts: Sequence[Mapping[str, Sequence[object]]]) -> None:
    """Append each part's columns to `columns`, part by part. A typed array takes the parts'
    bytes joined, then copied in (two copies, one allocation each: extending it part by part
    reallocates it as it grows, twice the time on the bench's 16 replicas)."""
    for name in parts[0] if parts else ():
        column = columns[name]
        if isinstance(column, array):
            column.frombytes(b"".join(_same_typecode(name, column, parts)))
        else:
            for part in parts:
                column.extend(part[name])


def _same_typecode(name: str, column: array[Any], parts: Sequence[Mapping[str, Sequence[object]]]
                   ) -> list[array[Any]]:
    """The parts' column `name`, each an array of `column`'s typecode (TypeError naming the
    column otherwise: joined as bytes, it would be read as another type)."""
    chunks = [part[name] for part in parts]
    for chunk in chunks:
        if not (isinstance(chunk, array) and chunk.typecode == column.typecode):
            found = chunk.typecode if isinstance(chunk, array) else type(chunk).__name__
            raise TypeError(f"step column {name!r}: a part is {found!r}, the joined column "
                            f"array({column.typecode!r})")
    return cast("list[array[Any]]", chunks)
