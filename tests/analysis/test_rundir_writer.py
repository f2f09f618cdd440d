"""The batched parquet writer: the same table a one-shot conversion of all rows gives."""

from __future__ import annotations

from array import array
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis import rundir


def _rows() -> list[dict[str, object]]:
    # a column None in the first batches then str; ints then a float; lists empty then not
    return [{"id": f"r{i}", "reason": None if i < 7 else "stop", "x": i if i != 9 else 2.5,
             "times": [] if i < 5 else [0.5 * i, 0.5 * i + 0.25]} for i in range(11)]


def test_batched_rows_equal_one_conversion(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rundir, "_BATCH_ROWS", 3)
    monkeypatch.setattr(rundir, "_GROUP_ROWS", 6)
    rows = _rows()
    rundir._write_table(tmp_path / "t.parquet", rows)
    written = pq.read_table(tmp_path / "t.parquet")
    reference = pa.Table.from_pylist(rows)
    assert written.schema == reference.schema
    assert written.equals(reference)
    assert pq.ParquetFile(tmp_path / "t.parquet").metadata.num_row_groups == 2


def test_typed_step_columns_equal_lists(tmp_path: Path) -> None:
    columns = {"step": array("q", [0, 1, 2]), "end_s": array("d", [0.5, 1.0, 1.5]),
               "wait_reason": [None, "kv_capacity", None]}
    rundir._write_table(tmp_path / "t.parquet", columns)
    reference = pa.table({name: list(values) for name, values in columns.items()})
    assert pq.read_table(tmp_path / "t.parquet").equals(reference)
