"""`rt bench sim/fleet`'s flags: --scaling's sizes and its one-line errors, the traces loaded."""

from __future__ import annotations

import pytest

import workloads
from sim.bench_flags import DEFAULT_TRACE_NAME, FleetBenchFlags, SimBenchFlags


def test_scaling_sizes_and_errors() -> None:
    assert FleetBenchFlags(scaling="4, 16,64").sizes() == (4, 16, 64)
    for bad in ("4", "0,4", ""):
        with pytest.raises(ValueError, match=f"sizes >= 1, got {bad!r}"):
            FleetBenchFlags(scaling=bad)
    with pytest.raises(ValueError, match="--scaling: not a comma-separated list of int"):
        FleetBenchFlags(scaling="4,x")


def test_default_trace_first_n_and_names() -> None:
    trace, name = FleetBenchFlags(first_n=5).load()
    assert [r.request_id for r in trace] == [r.request_id for r in workloads.default_trace()][:5]
    assert name == f"{DEFAULT_TRACE_NAME}, first 5"
    assert list(SimBenchFlags().traces()) == [DEFAULT_TRACE_NAME]
