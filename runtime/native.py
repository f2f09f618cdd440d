"""Which implementation of the scheduler/KV core runs: "compiled" when its hot modules were
compiled with mypyc (`RT_COMPILE=1 pip install -e .`, see setup.py) and Python imported the
extensions, else "pure". Records and benchmarks name it (run.json's "runtime")."""

from __future__ import annotations

from importlib.machinery import EXTENSION_SUFFIXES
from types import ModuleType
from typing import Literal

import runtime.scheduler

Implementation = Literal["compiled", "pure"]


def is_compiled(module: ModuleType) -> bool:
    """True if Python imported `module` from a C extension rather than its source."""
    path = getattr(module, "__file__", None) or ""
    return path.endswith(tuple(EXTENSION_SUFFIXES))


def implementation() -> Implementation:
    """"compiled" if the scheduler module is a C extension, else "pure" (all of setup.py's
    modules are compiled together or none are)."""
    return "compiled" if is_compiled(runtime.scheduler) else "pure"
