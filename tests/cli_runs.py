"""A small trace and its simulated run directory, for CLI tests that need real run files."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

import cli
from workloads import Trace, TraceRequest, write_rt_jsonl


def simulated_run(root: Path) -> tuple[Path, Path]:
    """(trace, run directory) under `root`: 4 requests 0.5 s apart, 32 prompt and 4 output
    tokens each, simulated with the defaults."""
    trace = root / "t.jsonl"
    write_rt_jsonl(Trace(tuple(TraceRequest(f"r{i}", 0.5 * i, 32, 4) for i in range(4)),
                         "t"), trace)
    run = root / "run"
    result = CliRunner().invoke(cli.app, ["simulate", "--trace", str(trace),
                                          "--result-dir", str(run)])
    assert result.exit_code == 0, result.output
    return trace, run
