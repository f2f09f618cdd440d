"""Run rt with the core's compiled modules hidden: `python tests/runtime/pure_python.py ARGS`
is `rt ARGS` importing `runtime/*.py` even where `RT_COMPILE=1` left C extensions beside
them (setup.py). Other packages' extensions (numpy, ...) load as usual."""

from __future__ import annotations

import importlib.util
import sys
from importlib.machinery import SOURCE_SUFFIXES, FileFinder, SourceFileLoader
from pathlib import Path
from typing import Any


def hide_compiled() -> None:
    """Import the `runtime` package's own modules from their sources from now on."""
    spec = importlib.util.find_spec("runtime")  # finds the package without importing it
    assert spec is not None and spec.submodule_search_locations, "runtime not found"
    assert "runtime" not in sys.modules, "runtime already imported"
    runtime_dir = Path(spec.submodule_search_locations[0]).resolve()

    def sources_only(path: str) -> Any:
        if Path(path).resolve() != runtime_dir:
            raise ImportError(path)  # the next path hook answers for other folders
        return FileFinder(path, (SourceFileLoader, SOURCE_SUFFIXES))

    sys.path_hooks.insert(0, sources_only)
    sys.path_importer_cache.clear()


if __name__ == "__main__":
    hide_compiled()
    import cli

    sys.argv = ["rt", *sys.argv[1:]]
    cli.main()
