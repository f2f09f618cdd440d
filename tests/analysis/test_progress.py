"""The progress bar: shown on a terminal only, never as blank lines in a log."""

from __future__ import annotations

import itertools
import time

import pytest

from analysis.progress import progress


def test_a_bar_on_a_redirected_stderr_writes_nothing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    clock = itertools.count(0.0, 5.0)  # seconds: every reading 5 s after the last
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    with progress("planning", 3) as update:
        for done in range(1, 4):
            update(done, 3)
    assert capsys.readouterr().err == ""


def test_a_bar_on_a_terminal_is_drawn(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich: treat stderr as a terminal
    clock = itertools.count(0.0, 5.0)
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    with progress("planning", 3) as update:
        update(1, 3)
    assert "planning" in capsys.readouterr().err
