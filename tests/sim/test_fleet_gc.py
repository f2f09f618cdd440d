"""The collector around a fleet run (`sim.fleet_gc`): paused while building, the built
objects frozen, only the youngest generation collected during the run, and everything as
the caller had it afterwards."""

from __future__ import annotations

import gc

import pytest

from sim.fleet_gc import built_and_run


@pytest.fixture
def collector():
    """Restores the collector's state whatever a test does to it."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()
    if enabled:
        gc.enable()


def test_build_paused_run_young_only_then_restored(collector: None) -> None:
    gc.enable()
    gc.set_threshold(700, 10, 10)
    seen: dict[str, object] = {}

    def build() -> list[object]:
        seen["enabled while building"] = gc.isenabled()
        return [[] for _ in range(3)]

    def run(built: list[object]) -> int:
        seen["frozen"] = gc.get_freeze_count() >= len(built)
        seen["enabled while running"] = gc.isenabled()
        seen["thresholds"] = gc.get_threshold()
        return len(built)

    assert built_and_run(build, run) == 3
    assert seen == {"enabled while building": False, "frozen": True,
                    "enabled while running": True, "thresholds": (700, 1 << 30, 1 << 30)}
    assert gc.get_threshold() == (700, 10, 10) and gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_restored_when_the_run_raises_and_caller_freeze_kept(collector: None) -> None:
    gc.disable()
    gc.set_threshold(500, 5, 5)
    gc.freeze()  # the caller's own frozen objects stay frozen

    def run(built: object) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        built_and_run(lambda: None, run)
    assert gc.get_threshold() == (500, 5, 5) and not gc.isenabled()
    assert gc.get_freeze_count() > 0
