"""Which implementation of the scheduler/KV core runs: "compiled" when its hot modules were
compiled with mypyc (`RT_COMPILE=1 pip install -e .`, see setup.py) and Python imported the
extensions, else "pure". Records and benchmarks name it (run.json's "runtime")."""

from __future__ import annotations

from importlib.machinery import EXTENSION_SUFFIXES
from typing import Literal

import runtime.scheduler

Implementation = Literal["compiled", "pure"]


def implementation() -> Implementation:
    """"compiled" if the scheduler module is a C extension, else "pure" (all of setup.py's
    modules are compiled together or none are)."""
    path = runtime.scheduler.__file__ or ""
    return "compiled" if path.endswith(tuple(EXTENSION_SUFFIXES)) else "pure"
