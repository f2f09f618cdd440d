"""`rt trace convert --to` and `rt trace inspect`'s flags, and the max_model_len check."""

from __future__ import annotations

from pathlib import Path

import pytest

import workloads
from workloads.flags import WorkloadFlags
from workloads.trace_flags import ConvertFlags, InspectFlags


def test_convert_refuses_an_unknown_format_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(workloads.TraceError, match="--to") as err:
        ConvertFlags(to="csv")
    assert "'csv'" in str(err.value) and "must be rt, vidur or timed_trace" in str(err.value)
    trace = workloads.first_n(workloads.default_trace(), 5)
    ConvertFlags().write(trace, tmp_path / "t.jsonl")
    assert workloads.read_rt_jsonl(tmp_path / "t.jsonl") == trace


def test_inspect_statistics_of_the_default_trace() -> None:
    stats, kind, notes = InspectFlags(block_size=16).stats(WorkloadFlags(first_n=5), None)  # type: ignore[arg-type]
    assert stats == workloads.trace_stats(workloads.first_n(workloads.default_trace(), 5), 16)
    assert kind == "azure" and notes == ()


def test_check_max_model_len_names_the_request() -> None:
    trace = workloads.first_n(workloads.default_trace(), 3)
    longest = max(r.prompt_len + r.output_len for r in trace)
    workloads.check_max_model_len(trace, longest)
    with pytest.raises(ValueError, match=r"exceed max_model_len=\d+ \(clip the trace with "):
        workloads.check_max_model_len(trace, longest - 1)
