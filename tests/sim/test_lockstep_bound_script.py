"""docs/measure/fleet_lockstep_bound.py's timing of the replicas' engine calls: every call a
replica class makes counts once, for the decision it precedes. `KvReplica.fast_forward`
(KV-event routers: dynamo-kv, kv-aware, llm-d's precise scorer) overrides the method
without calling it, and `KvReplica.one_step` calls the one it overrides: the first was not
timed at all (1.35 s of 3.5 s at 16 dynamo-kv replicas counted as work outside the engine,
split over the processes), the second must not be timed twice; nor `plan_run` inside
`fast_forward`, while the one `Replica.sleep_through_run` makes before a run is timed (0.083 s
at 16 least-outstanding replicas). Here on stand-in classes
and a stand-in clock, so the seconds are exact."""

from __future__ import annotations

import collections
import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "measure" / "fleet_lockstep_bound.py"
NOW = [0.0]  # the stand-in clock, seconds


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fleet_lockstep_bound", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Engine:  # as `EngineProcess`: the methods, inherited by `Replica`
    def one_step(self, clock: float) -> float:
        NOW[0] += 2.0
        return clock

    def fast_forward(self, clock: float) -> float:
        self.plan_run(clock, clock + 1.0)
        NOW[0] += 1.0
        return clock

    def plan_run(self, clock: float, horizon: float) -> None:
        NOW[0] += 0.5


class Replica(Engine):
    def __init__(self, index: int) -> None:
        self.index = index
        self.fleet = SimpleNamespace(next_index=0)


class KvReplica(Replica):
    def fast_forward(self, clock: float) -> float:  # its own, not the one it overrides
        NOW[0] += 5.0
        return clock

    def one_step(self, clock: float) -> float:
        end = super().one_step(clock)
        NOW[0] += 1.0  # publishing its KV events
        return end


def test_each_engine_call_counts_once_for_the_decision_it_precedes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script()
    monkeypatch.setattr(script, "time", SimpleNamespace(perf_counter=lambda: NOW[0]))
    work: dict[tuple[int, int], float] = collections.defaultdict(float)
    undo = script._timed_per_decision(work, Replica)
    plain, kv = Replica(0), KvReplica(1)
    plain.one_step(0.0)
    kv.one_step(0.0)
    plain.fleet.next_index = kv.fleet.next_index = 4  # decisions 0-3 made
    plain.fast_forward(0.0)
    plain.plan_run(0.0, 1.0)  # as `Replica.sleep_through_run`, outside the other two
    kv.fast_forward(0.0)
    kv.one_step(0.0)
    undo()
    assert dict(work) == {(0, 0): 2.0, (0, 1): 3.0, (4, 0): 1.5 + 0.5,
                          (4, 1): 5.0 + 3.0}
    # undone: the classes as they were (`Replica` inherits again)
    assert not {"one_step", "fast_forward", "plan_run"} & set(vars(Replica))
    assert vars(KvReplica)["fast_forward"].__qualname__ == "KvReplica.fast_forward"
    assert vars(KvReplica)["one_step"].__qualname__ == "KvReplica.one_step"
