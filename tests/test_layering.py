"""The import rules of the layout, checked on the source (AST), not by convention.

    cli.py    -> anything            (nothing imports cli)
    sim/      -> runtime, workloads  (never backends, analysis; never torch/triton/transformers)
    backends/ -> runtime, workloads  (never sim, analysis)
    workloads/, analysis/ -> nothing of the project
    runtime/  -> the standard library only, and no clock, randomness, I/O or logging
Only cli.py reads argv or the environment, or configures logging.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "sim", "backends", "workloads", "analysis")
PROJECT = set(PACKAGES) | {"cli"}
ALLOWED = {
    "runtime": {"runtime"},
    "sim": {"sim", "runtime", "workloads"},
    "backends": {"backends", "runtime", "workloads"},
    "workloads": {"workloads"},
    "analysis": {"analysis"},
}
GPU_STACK = {"torch", "triton", "transformers", "safetensors"}
# Standard-library modules the pure core must not use: drivers own time, I/O and randomness.
RUNTIME_FORBIDDEN_STDLIB = {
    "time", "datetime", "random", "logging", "os", "io", "pathlib", "threading",
    "asyncio", "socket", "subprocess", "sys", "multiprocessing",
}


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_project_imports_follow_the_layering(package: str) -> None:
    assert sources(package), f"{package}/ has no sources"
    for path in sources(package):
        project_imports = imported_modules(path) & PROJECT
        bad = project_imports - ALLOWED[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_runtime_uses_only_the_standard_library_and_no_clock() -> None:
    for path in sources("runtime"):
        for name in imported_modules(path) - {"runtime", "__future__"}:
            assert name in sys.stdlib_module_names, f"{path.name} imports {name}"
            assert name not in RUNTIME_FORBIDDEN_STDLIB, f"{path.name} imports {name}"


def test_only_backends_touch_the_gpu_stack() -> None:
    for package in ("runtime", "sim", "workloads", "analysis"):
        for path in sources(package):
            bad = imported_modules(path) & GPU_STACK
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_only_cli_reads_argv_environment_or_configures_logging() -> None:
    for package in PACKAGES:
        for path in sources(package):
            text = path.read_text()
            for needle in ("sys.argv", "os.environ", "os.getenv", "logging.basicConfig"):
                assert needle not in text, f"{path.relative_to(ROOT)} uses {needle}"


def test_a_violation_is_detected(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom sim.x import y\nfrom . import z\n")
    assert imported_modules(bad) == {"torch", "sim"}
