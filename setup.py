"""Optional compilation of the scheduler/KV core's hot modules with mypyc (#16).

Off by default: `pip install -e .` installs pure Python, as ever. `RT_COMPILE=1 pip install
-e .` (any spelling of pip install) also asks pip for mypy at build time and compiles
`COMPILED` to C extensions next to their sources (`runtime/*.cpython-*.so`,
`sim/simulator.cpython-*.so`, ..., which Python
then imports instead of the .py files). A compile that fails (no C compiler, no Python
headers, a mypyc error) leaves no extension behind and the install goes on in pure Python,
with a warning; `runtime.native.implementation()` says which one runs. Every run of this file
first deletes an earlier build's extensions, so a failed or skipped compile never leaves them
shadowing edited sources. The extensions do not follow later edits of the sources: install
again (`pip install -e .` without RT_COMPILE removes them, back to pure Python). Beware: any
setup.py command without RT_COMPILE=1 (`pip wheel .`, `python -m build`, `pip install .`)
also deletes the compiled extensions from the source tree; rerun `RT_COMPILE=1 pip install
-e .` afterwards to have them again. pip warns that `setup_requires` is deprecated when
RT_COMPILE=1; the warning is harmless.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

# The per-step modules (mypy --strict clean; a class subclassed by interpreted code says so
# with `mypyc_attr(allow_interpreted_subclasses=True)`): the runtime core's, and the
# simulator's engine loop and roofline cost model (their frozen config dataclasses live apart:
# compiled, one would not pickle). Left out: outputs.py (ReqIdList subclasses
# list), config.py, flags.py and records.py (subclassed by sim/ and backends/ classes), the
# router (per request), the rest of sim/ (per run or per request).
COMPILED = [f"runtime/{name}.py" for name in (
    "batch", "block_hash", "block_pieces", "block_pool", "cached_blocks", "decode_run", "engine",
    "free_block_queue", "kv_cache_manager", "kv_events", "pool_events", "pool_invariants",
    "recorder", "request", "request_queue", "scheduler", "steady", "steady_bucket",
    "step_columns")] + [
    "sim/simulator.py", "sim/cost/roofline.py"]
GROUP = "runtime._native"  # the shared library: runtime/_native__mypyc.*.so


def _warn(message: str) -> None:
    print(f"rt: {message}; installing pure Python", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: all of the extensions or none."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # a compiler's failure has no common type
            _warn(f"compiling with mypyc failed ({error})")
            for path in self.get_outputs():
                Path(path).unlink(missing_ok=True)
            _remove_extensions()


def _built_extensions() -> list[Path]:
    """The files a compiled build writes next to the sources: one per COMPILED module and the
    group's shared library, with this interpreter's extension suffix (.cpython-311-...so)."""
    root = Path(__file__).resolve().parent
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    modules = [root / Path(path).with_suffix(suffix) for path in COMPILED]
    return [*modules, root / "runtime" / (GROUP.split(".")[-1] + "__mypyc" + suffix)]


def _remove_extensions() -> None:
    """Delete an earlier compiled build's extensions, which would shadow the (maybe edited)
    sources; only those files, by name, and say so."""
    removed = [path for path in _built_extensions() if path.exists()]
    for path in removed:
        path.unlink()
    if removed:
        root = Path(__file__).resolve().parent
        names = ", ".join(str(path.relative_to(root)) for path in removed)
        print(f"rt: removed an earlier compiled build ({names}); pure Python from now on",
              file=sys.stderr)


def _extensions() -> list[object]:
    """mypyc's extensions for COMPILED, or none (not asked for, or mypyc unavailable)."""
    _remove_extensions()  # an earlier build's: a failed or skipped compile must not leave it
    if os.environ.get("RT_COMPILE") != "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:  # the build requirements' step: pip installs mypy, then asks again
        return []
    try:
        return list(mypycify(COMPILED, opt_level="3", group_name=GROUP))
    except (Exception, SystemExit) as error:  # mypyc exits on a type error
        _warn(f"mypyc rejected the modules ({error})")
        return []


setup(
    ext_modules=_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
    setup_requires=["mypy>=1.10"] if os.environ.get("RT_COMPILE") == "1" else [],
)
