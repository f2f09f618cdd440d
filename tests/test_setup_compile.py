"""setup.py's fallback (#16, `RT_COMPILE=1`): a compile that fails leaves no extension
behind, an earlier build's included, so Python imports the (edited) sources."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_rejected_compile_removes_an_earlier_builds_extensions(tmp_path: Path) -> None:
    pytest.importorskip("mypyc.build")
    shutil.copy(ROOT / "setup.py", tmp_path)
    shutil.copytree(ROOT / "runtime", tmp_path / "runtime",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    earlier = [tmp_path / "runtime" / f"{name}{suffix}" for name in ("scheduler", "_native__mypyc")]
    earlier.append(tmp_path / "sim" / f"simulator{suffix}")  # the simulator's engine loop too
    earlier[-1].parent.mkdir()
    for path in earlier:  # stand-ins for an earlier RT_COMPILE=1 build's extensions
        path.write_bytes(b"an earlier build")
    with (tmp_path / "runtime" / "request_queue.py").open("a") as source:  # an edit mypyc refuses
        source.write('\nBROKEN: int = "a type error"\n')
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                          cwd=tmp_path, env={**os.environ, "RT_COMPILE": "1"},
                          capture_output=True, text=True, timeout=600)
    assert "installing pure Python" in done.stderr, done.stderr[-2000:]
    assert [path.name for path in earlier if path.exists()] == []  # else they shadow the edit
