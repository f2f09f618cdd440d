"""Run directories are written atomically: a cut-short write never leaves a directory under
the run's name, and the partial one is marked, so `rt report` cannot misread it."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis import rundir


def test_an_interrupted_write_leaves_no_run_and_a_marked_partial(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run"
    calls = []

    def cut(table_path: Path, rows: object) -> None:
        calls.append(table_path.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C between the two tables
        table_path.write_bytes(b"")

    monkeypatch.setattr(rundir, "_write_table", cut)
    with pytest.raises(KeyboardInterrupt):
        rundir.write_run(path, [{"a": 1}], [], {"kind": "simulate"})
    assert not path.exists()
    partial = tmp_path / ".run.partial"
    assert (partial / rundir.INTERRUPTED_FILE).is_file()
    with pytest.raises(ValueError, match="interrupted"):
        rundir.load_run(partial)


def test_a_rewrite_replaces_the_run_whole(tmp_path: Path) -> None:
    path = tmp_path / "run"
    trace = {"name": "t", "requests": 1, "digest": "d"}
    rundir.write_run(path, [{"a": 1}], [{"s": 1}], rundir.run_info("simulate", "run", trace, n=1))
    rundir.write_run(path, [{"a": 2}, {"a": 3}], [], rundir.run_info("simulate", "run", trace,
                                                                      n=2))
    run = rundir.load_run(path)
    assert run.info["n"] == 2 and list(run.requests["a"]) == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no partial, no old


def test_a_runs_root_with_only_its_own_summary_may_be_reused(tmp_path: Path) -> None:
    """A plan whose every shape was pruned leaves plan.csv (and its figure) and no run
    directory: running it again into the same root is allowed; other files are not."""
    root = tmp_path / "plan"
    root.mkdir()
    (root / "plan.csv").write_text("shape\n")
    (root / "pareto.png").write_bytes(b"")
    rundir.check_runs_root(root, "plan.csv")
    with pytest.raises(ValueError, match=f"result directory {root}: holds other files"):
        rundir.check_runs_root(root, "sweep.csv")
