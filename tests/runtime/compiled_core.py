"""The compiled core (setup.py's mypyc build, `RT_COMPILE=1`) built for the tests outside the
tree: the `runtime` package's sources copied to a temporary folder and compiled there by the
project's own setup.py (`build_ext --inplace` in the copy), so the checkout and its install
stay pure. `rt_with` runs rt with such a copy first on PYTHONPATH."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# what the build reads besides runtime/: setup.py, and pyproject.toml for the package's
# metadata and mypy's settings (mypyc type-checks with them); its readme is named there
BUILD_FILES = ("setup.py", "pyproject.toml", "README.md")
REPORT: list[str] = []  # what the session did with the compiled core (conftest prints it)


@dataclass(frozen=True)
class Built:
    """A copy of the tree's `runtime` package in `root` (so `root` goes on PYTHONPATH)."""

    root: Path
    seconds: float  # wall time of the compile; 0.0 for a pure copy

    def __post_init__(self) -> None:
        if not (self.root / "runtime" / "__init__.py").is_file():
            raise ValueError(f"{self.root} holds no runtime package")
        if self.seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {self.seconds}")


def missing_toolchain() -> str | None:
    """Why mypyc cannot compile here (no mypyc, no C compiler, no Python headers), or None."""
    if importlib.util.find_spec("mypyc") is None:
        return "mypyc is not installed (it comes with mypy, in .[dev])"
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler!r}, $CC or the one Python was built with, not found)"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        return f"no Python headers ({headers} is missing; python3-dev)"
    return None


# the packages the build compiles from (runtime/, sim/'s engine loop) and type-checks with
COMPILED_PACKAGES = ("runtime", "sim", "workloads")


def copy_sources(root: Path) -> Built:
    """The compiled packages' sources only (no extension, no bytecode) under `root`."""
    for package in COMPILED_PACKAGES:
        shutil.copytree(ROOT / package, root / package,
                        ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    return Built(root, 0.0)


def compile_copy(root: Path) -> Built:
    """A copy of the sources compiled by setup.py. Raises with the build's output if it
    leaves no extension (setup.py's install would have fallen back to pure Python)."""
    copy_sources(root)
    for name in BUILD_FILES:
        shutil.copy2(ROOT / name, root / name)
    start = time.perf_counter()
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=root, env={**os.environ, "RT_COMPILE": "1"}, capture_output=True, text=True,
        timeout=900)
    seconds = time.perf_counter() - start
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    modules = (root / "runtime" / f"scheduler{suffix}", root / "sim" / f"simulator{suffix}")
    if build.returncode != 0 or not all(module.is_file() for module in modules):
        raise RuntimeError(f"the mypyc build left no extension (exit {build.returncode}):\n"
                           f"{build.stdout[-3000:]}\n{build.stderr[-3000:]}")
    return Built(root, seconds)


def run_with(built: Built, code: str, args: list[str]) -> str:
    """`python -c CODE ARGS` importing `runtime` from `built` and everything else from the
    checkout; its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(built.root), str(ROOT)]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=built.root, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{args} with {built.root} exited {done.returncode}:\n"
                           f"{done.stderr[-3000:]}")
    return done.stdout


def rt_with(built: Built, args: list[str]) -> None:
    """`rt ARGS` with `built`'s runtime package."""
    run_with(built, "import sys, cli; sys.argv = ['rt', *sys.argv[1:]]; cli.main()", args)


def imported(built: Built) -> tuple[Path, str]:
    """Where Python imports the runtime package from with `built`, and which implementation
    of the core that is ("compiled" or "pure")."""
    code = "import runtime, runtime.native as n; print(runtime.__file__); print(n.implementation())"
    path, implementation = run_with(built, code, []).split()
    return Path(path), implementation
