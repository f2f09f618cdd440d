"""A fleet request record: the replica's record field for field, timed from the trace
arrival, with where it went and how long routing took; step columns joined replica by
replica, typecodes checked."""

from __future__ import annotations

import dataclasses
from array import array

import pytest

from runtime.records import REQUEST_FIELDS, RequestRecord
from sim.fleet_records import FleetRequestRecord, _concatenate, as_fleet_record, fleet_record


def _record() -> RequestRecord:
    """A record with every field set to a value of its own (none left at its default)."""
    values: dict[str, object] = {}
    for i, name in enumerate(REQUEST_FIELDS):
        default = getattr(RequestRecord("x", 0.0, 0, 0), name)
        values[name] = (f"v{i}" if isinstance(default, str) or name.endswith(("_reason", "_id"))
                        else [0.5 + i, 1.5 + i] if name == "token_times_s" else i + 0.25)
    return RequestRecord(**values)  # type: ignore[arg-type]


def test_fleet_record_copies_every_field_and_times_from_the_trace_arrival() -> None:
    record = _record()
    row = fleet_record(record, replica=3, arrival_s=0.125, router=2)
    assert isinstance(row, FleetRequestRecord)
    for name in REQUEST_FIELDS:
        expected = 0.125 if name == "arrival_s" else getattr(record, name)
        assert getattr(row, name) == expected, name
    assert (row.replica, row.router) == (3, 2)
    assert row.routing_s == 1.25 - 0.125  # the replica saw it arrive at 1.25 (field 1)
    assert [f.name for f in dataclasses.fields(row)] == [*REQUEST_FIELDS, "replica",
                                                          "routing_s", "router"]


def test_fleet_record_without_router_replicas() -> None:
    row = fleet_record(RequestRecord("a", 2.0, 10, 5), replica=0, arrival_s=2.0)
    assert (row.request_id, row.arrival_s, row.routing_s, row.router) == ("a", 2.0, 0.0, None)


def test_a_replicas_own_fleet_record_is_passed_through_only_when_complete() -> None:
    """A fleet replica records `FleetRequestRecord`s from the arrival: the row is the record
    itself when it reached the replica at its arrival and no router is named, else a copy
    (the replica's record is left as it was: a P/D fleet reads it again)."""
    record = FleetRequestRecord("a", 2.0, 10, 5, replica=1, routing_s=0.0)
    assert as_fleet_record(record, 1, 2.0) is record
    for arrival_s, router in ((1.5, None), (2.0, 0)):
        row = as_fleet_record(record, 1, arrival_s, router)
        assert row is not record and (row.arrival_s, row.router) == (arrival_s, router)
        assert row.routing_s == 2.0 - arrival_s and record.arrival_s == 2.0
    other = as_fleet_record(record, 3, 2.0)  # another replica's index: a copy that says so
    assert other is not record and (other.replica, record.replica) == (3, 1)
    plain = as_fleet_record(RequestRecord("b", 3.0, 10, 5), 2, 3.0)
    assert (plain.replica, plain.routing_s) == (2, 0.0)


def test_step_columns_join_part_by_part() -> None:
    columns: dict[str, list[object] | array[float]] = {"x": array("d", [0.5]), "y": ["a"]}
    _concatenate(columns, [{"x": array("d", [1.5, 2.5]), "y": ["b"]},  # type: ignore[arg-type]
                           {"x": array("d"), "y": []}, {"x": array("d", [-1.0]), "y": ["c"]}])
    assert columns == {"x": array("d", [0.5, 1.5, 2.5, -1.0]), "y": ["a", "b", "c"]}


@pytest.mark.parametrize("part", [array("d", [1.5]), array("i", [1, 2]), [1]])
def test_step_column_join_refuses_another_type(part: object) -> None:
    """Joined as bytes, an array('d') in an array('q') column would be read as integers."""
    columns = {"x": array("q", [7])}
    with pytest.raises(TypeError, match="step column 'x': a part is '(d|i|list)', the joined "
                                        r"column array\('q'\)"):
        _concatenate(columns, [{"x": array("q", [1])}, {"x": part}])  # type: ignore[dict-item]
    assert columns["x"] == array("q", [7])  # nothing appended
