"""`backends.heap.frozen_heap`: the collector around a timed stretch (a replay)."""

from __future__ import annotations

import gc
import sys

import pytest

from backends.heap import frozen_heap


def test_the_heap_is_frozen_inside_and_unfrozen_after_even_on_an_exception() -> None:
    thresholds = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == thresholds  # every generation still collects
    assert gc.get_freeze_count() == 0
    with pytest.raises(KeyboardInterrupt), frozen_heap():
        assert gc.get_freeze_count() > 0
        raise KeyboardInterrupt
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds


def test_a_callers_own_settings_are_left_as_they_are() -> None:
    gc.disable()
    try:
        with frozen_heap():
            assert gc.get_freeze_count() == 0 and not gc.isenabled()
    finally:
        gc.enable()
    # no other thread runs between the counts: one left by an earlier test that frees a
    # frozen object lowers the count (a fresh clone's suite once read 837114 == 837116)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen  # the caller's freeze kept
    finally:
        gc.unfreeze()
        sys.setswitchinterval(switch)
