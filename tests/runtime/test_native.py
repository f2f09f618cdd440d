"""The compiled core (setup.py's mypyc build, `RT_COMPILE=1`) writes the records of the pure
one. Both are copies of the checkout's `runtime` package in temporary folders, one compiled
there once per session (about a minute of one core), so the test needs no compiled install
and leaves the checkout as it is. Skipped, with the reason, only where mypyc, a C compiler or
the Python headers are missing; `tests/runtime/conftest.py` prints what ran."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest

from tests.runtime import compiled_core
from tests.runtime.compiled_core import (
    Built,
    compile_copy,
    copy_sources,
    imported,
    rt_with,
    run_with,
)

# small runs that cross the pool's paths: preemptions with prefix hits and priorities, and a
# fleet whose router reads the pools' KV events
RUNS = {
    "preempt": ["--first-n", "300", "--time-scale", "0.1", "--num-gpu-blocks-override", "400",
                "--policy", "priority"],
    "kv_events": ["--first-n", "200", "--replicas", "2", "--router", "dynamo-kv",
                  "--time-scale", "0.25"],
}


@pytest.fixture(scope="session")
def pure(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return copy_sources(tmp_path_factory.mktemp("pure"))


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Built:
    reason = compiled_core.missing_toolchain()
    if reason is not None:
        compiled_core.REPORT.append(f"compiled core: not built, {reason}")
        pytest.skip(f"the compiled core cannot be built here: {reason}")
    built = compile_copy(tmp_path_factory.mktemp("compiled"))
    compiled_core.REPORT.append(f"compiled core: built with mypyc in {built.seconds:.0f} s")
    return built


def test_each_copy_is_the_runtime_imported(pure: Built, compiled: Built) -> None:
    for built, implementation in ((pure, "pure"), (compiled, "compiled")):
        path, found = imported(built)
        assert path == built.root / "runtime" / "__init__.py"
        assert found == implementation


def test_the_compiled_simulator_and_its_configs_pickle(compiled: Built) -> None:
    """The engine loop and the roofline compile too; the setup a sweep or Ray task carries
    (config, cost model) still pickles and deep-copies, equal (its frozen dataclasses live
    in modules that are not compiled)."""
    code = ("import copy, pickle; from runtime.native import is_compiled; "
            "import sim.simulator, sim.cost.roofline; "
            "from sim.engine_args import EngineArgs, build_setup; "
            "s = build_setup(EngineArgs(), 'llama-3.1-8b', 'h200'); "
            "back = pickle.loads(pickle.dumps(s)); copy.deepcopy(s); "
            "print(is_compiled(sim.simulator), is_compiled(sim.cost.roofline), "
            "back.config == s.config, back.cost_model.efficiency == s.cost_model.efficiency)")
    assert run_with(compiled, code, []).split() == ["True", "True", "True", "True"]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_compiled_records_equal_pure(tmp_path: Path, pure: Built, compiled: Built,
                                     name: str) -> None:
    out = {side: tmp_path / side for side in ("pure", "compiled")}
    with ThreadPoolExecutor(2) as pool:  # the two subprocesses side by side
        runs = [pool.submit(rt_with, built, ["simulate", *RUNS[name], "--result-dir", str(path)])
                for built, path in ((pure, out["pure"]), (compiled, out["compiled"]))]
        for run in runs:
            run.result()
    for side, directory in out.items():
        assert json.loads((directory / "run.json").read_text())["runtime"] == side
    for table in ("requests.parquet", "steps.parquet"):
        expected = pd.read_parquet(out["pure"] / table)
        assert len(expected) > 0, table
        assert expected.equals(pd.read_parquet(out["compiled"] / table)), table
    compiled_core.REPORT.append(f"compiled core: {name} run's records equal pure Python's")
