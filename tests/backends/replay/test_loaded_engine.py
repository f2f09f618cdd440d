"""`backends.replay.real_run.LoadedEngine` (cli18): what `rt fidelity` relies on. A fidelity
replay cut by Ctrl-C ends the command (exit 130) instead of fitting on partial records; the
engine's facts are the setup's. (Not a bug: pins what no fast test covered.)"""

from __future__ import annotations

import pytest

from backends.replay import real_run
from tests.backends.replay.test_real_run import SETUP, TRACE, _stub_replay
from tests.run_output import Exited, Recorder


def test_fidelity_replay_cut_by_ctrl_c_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    _stub_replay(monkeypatch, interrupted=True)
    out = Recorder()
    with pytest.raises(Exited):
        real_run.LoadedEngine(SETUP, None, out).replay(TRACE)
    assert out.calls[-1] == ("exit", 130)


def test_engine_facts_are_the_setups() -> None:
    engine = real_run.LoadedEngine(SETUP, None, Recorder())
    assert (engine.scheduler, engine.cache, engine.model, engine.seed, engine.tokenized) == (
        SETUP.scheduler, SETUP.cache, "m", 0, False)
