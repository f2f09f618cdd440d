"""Every `rt bench` command reports an unwritable --out the same way: one line, exit 2.

cli18 (ce0e67a) moved `rt bench sim/fleet/route`'s `out.write` into `user_errors` (one line,
exit 2) but left `rt bench scheduler` and `rt bench serve` writing outside it (a traceback,
exit 1): the same flag now fails two ways."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

import cli


def _unwritable(tmp_path: Path) -> Path:
    blocker = tmp_path / "file"
    blocker.write_text("")
    return blocker / "report.json"  # its parent is a file: mkdir fails (OSError)


def test_bench_sim_unwritable_out_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli.app, ["bench", "sim", "--no-baseline", "--out",
                                          str(_unwritable(tmp_path))])
    assert result.exit_code == 2 and result.stderr.startswith("rt: error: ")


def test_bench_scheduler_unwritable_out_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli.app, ["bench", "scheduler", "--quick", "--out",
                                          str(_unwritable(tmp_path))])
    assert result.exit_code == 2 and result.stderr.startswith("rt: error: "), result.exception
