"""runtime.records: the rows both drivers write."""

from __future__ import annotations

import dataclasses
from array import array

from runtime.records import REQUEST_FIELDS, STEP_FIELDS, RequestRecord, StepRecord, StepTimes


def test_request_row_is_asdict_with_a_copied_token_list() -> None:
    record = RequestRecord("r1", 0.5, 12, 3, queued_s=0.6, first_token_s=0.9, finish_s=1.2,
                           status="FINISHED_LENGTH_CAPPED", finish_reason="length",
                           output_len=3, token_times_s=[0.9, 1.05, 1.2], prefill_s=0.25)
    row = record.to_row()
    assert row == dataclasses.asdict(record)
    assert tuple(row) == REQUEST_FIELDS
    row["token_times_s"].append(9.0)  # type: ignore[attr-defined]
    assert record.token_times_s == [0.9, 1.05, 1.2]


def test_step_row_is_asdict() -> None:
    values = {name: i for i, name in enumerate(STEP_FIELDS)} | {"wait_reason": "kv_capacity"}
    record = StepRecord(**values)  # type: ignore[arg-type]
    assert record.to_row() == dataclasses.asdict(record) == values


def test_step_times_are_runs_of_the_end_column() -> None:
    ends = array("d", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    times = StepTimes(ends)
    assert len(times) == 0 and times == []
    times.add_steps(1, 2)
    times.add_steps(2, 4)  # continues the run: one run [1, 4)
    times.add_steps(5, 6)
    assert times._runs == array("q", [1, 4, 5, 6])
    assert list(times) == [0.2, 0.3, 0.4, 0.6]
    assert len(times) == 4 and times[-1] == 0.6 and times[1:3] == [0.3, 0.4]
    assert times == [0.2, 0.3, 0.4, 0.6] and times != [0.2, 0.3, 0.4]
    assert RequestRecord("r", 0.0, 1, 4, token_times_s=times).to_row()["token_times_s"] == \
        [0.2, 0.3, 0.4, 0.6]
