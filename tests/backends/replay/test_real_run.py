"""`backends.replay.real_run`: what `rt replay` hands its output (start-up lines, the model
note, progress, the run directory, the blocks) and how Ctrl-C ends it (exit 130), with the
replay itself stubbed (the real one: tests/backends/replay/test_replay.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from backends.replay import real_run
from backends.replay.run_output import INTERRUPTED
from runtime import CacheConfig, SchedulerConfig
from runtime.records import RunResult
from tests.run_output import Exited, Recorder
from workloads import ArrivalProcess, RandomLengths, random_trace, trace_info

RESULTS = {cut: RunResult([], {}, 0, 0, 1.0, cut) for cut in (False, True)}
TRACE = random_trace(3, RandomLengths(32, 4), ArrivalProcess(5.0))
SETUP: Any = SimpleNamespace(
    cache=CacheConfig(block_size=16, num_blocks=101),
    scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512),
    args=SimpleNamespace(model_dir=Path("m"), device="cpu", seed=0),
    shape=SimpleNamespace(model_type="llama", vocab_size=100), dtype="float32",
    attention="sdpa", runner=None, describe=lambda: {"engine": 1})


def _stub_replay(monkeypatch: pytest.MonkeyPatch, interrupted: bool) -> None:
    monkeypatch.setattr(real_run, "replay", lambda *args: RESULTS[interrupted])
    monkeypatch.setattr(real_run.ReplayConfig, "of", lambda setup, check: None)


def test_replay_prints_start_up_lines_then_writes_and_shows(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    _stub_replay(monkeypatch, interrupted=False)
    out = Recorder()
    real_run.run_replay(TRACE, SETUP, None, Path("r"), [99.0], False, out)
    assert out.calls == [
        ("tell", "GPU KV cache size: 1,616 tokens"),
        ("tell", "Maximum concurrency for 512 tokens per request: 3.16x"),
        ("say", "note: model m (llama) on cpu, float32, attention: sdpa"),
        ("progress", ("replaying", 3)),
        ("save", (Path("r"), "replay", trace_info(TRACE), RESULTS[False], {"engine": 1},
                  {"interrupted": False, "tokenizer": False})),
        ("show", (Path("r"), RESULTS[False], [99.0])),
    ]


def test_ctrl_c_writes_the_records_then_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    _stub_replay(monkeypatch, interrupted=True)
    out = Recorder()
    with pytest.raises(Exited):
        real_run.run_replay(TRACE, SETUP, None, Path("r"), [], False, out)
    assert [c[0] for c in out.calls[-4:]] == ["save", "show", "say", "exit"]
    assert out.calls[-2:] == [("say", INTERRUPTED), ("exit", 130)]


def test_replay_on_stops_the_command_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    _stub_replay(monkeypatch, interrupted=True)
    out = Recorder()
    assert real_run.replay_on(TRACE, SETUP, None, out).interrupted
    with pytest.raises(Exited):
        real_run.replay_on(TRACE, SETUP, None, out, stop_if_interrupted=True)
    assert out.calls[-1] == ("exit", 130)
