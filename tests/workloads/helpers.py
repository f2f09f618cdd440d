"""Shared paths and small builders for the workloads tests."""

from __future__ import annotations

from pathlib import Path

from workloads import Trace, TraceRequest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"


def write(path: Path, text: str) -> Path:
    """Write `text` to `path` exactly (no newline added) and return the path."""
    path.write_text(text, encoding="utf-8")
    return path


def simple_trace(arrivals: list[float], prompt_len: int = 10, output_len: int = 5) -> Trace:
    """Requests "0", "1", ... with the given arrival times (s) and fixed lengths (tokens)."""
    return Trace(tuple(TraceRequest(str(i), t, prompt_len, output_len)
                       for i, t in enumerate(arrivals)), name="simple")
