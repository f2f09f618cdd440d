"""The embedded default trace: the first 10 minutes of the Azure LLM inference conversation
trace 2023 (2,867 requests; attribution in `workloads/data/ATTRIBUTION.md`)."""

from __future__ import annotations

from pathlib import Path

from workloads.loaders import load_trace
from workloads.trace import Trace

DEFAULT_TRACE_PATH = Path(__file__).parent / "data" / "azure_conv_2023_first10min.csv"


def default_trace() -> Trace:
    return load_trace(DEFAULT_TRACE_PATH, "azure").trace
