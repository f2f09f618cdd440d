"""analysis.rundir.rt_version: the installed version, else the checkout's pyproject.toml."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest

from analysis import rundir


def _not_installed(name: str) -> str:
    raise importlib.metadata.PackageNotFoundError(name)


def test_installed_version_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    assert rundir.rt_version() == "9.9.9"


def test_a_plain_checkout_reads_its_pyproject(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setattr(importlib.metadata, "version", _not_installed)
    pyproject = Path(rundir.__file__).resolve().parents[1] / "pyproject.toml"
    with pyproject.open("rb") as file:
        expected = tomllib.load(file)["project"]["version"]
    assert rundir.rt_version() == expected != "unknown"
    # a tree without rt's pyproject beside the package: unknown
    (tmp_path / "analysis").mkdir()
    monkeypatch.setattr(rundir, "__file__", str(tmp_path / "analysis" / "rundir.py"))
    assert rundir.rt_version() == "unknown"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "1.0"\n')
    assert rundir.rt_version() == "unknown"
    (tmp_path / "pyproject.toml").write_text("not toml [")
    assert rundir.rt_version() == "unknown"
