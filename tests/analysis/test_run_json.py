"""run.json checked (`analysis.run_json`) and found for a calibration source
(`analysis.rundir.source_run_info`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.run_json import check_run_info
from analysis.rundir import INTERRUPTED_FILE, run_info, source_run_info

TRACE = {"name": "t", "requests": 4, "digest": "d"}


def test_the_head_alone_is_a_run_json_and_comes_back_as_is() -> None:
    info = run_info("replay", "r", TRACE)
    assert check_run_info(info, Path("r/run.json")) is info
    assert sorted(info) == ["kind", "name", "rt_version", "trace"]


@pytest.mark.parametrize(("fields", "problem"), [
    ({"fleet": None, "scaling": None, "model": {"name": None}}, None),  # nulls where allowed
    ({"trace": {**TRACE, "name": None}}, None),  # a trace without a name (workloads.Trace)
    ({"fleet": {"replicas": 0}}, "field 'fleet.replicas' must be an integer >= 1, got 0"),
    ({"trace": {**TRACE, "requests": True}},
     "field 'trace.requests' must be an integer >= 0, got true"),
    ({"endpoint": {"cache_config": [1]}},
     "field 'endpoint.cache_config' must be an object or null, got [1]"),
    ({"scaling": {"end_s": 1, "gpu_hours": 1, "cost": 1, "pools": [
        {"name": "a", "gpu_hours": 1, "cost": 1, "times_s": [0], "serving": [1],
         "provisioned": [1]},
        {"name": "b", "gpu_hours": 1, "cost": 1, "times_s": [0], "serving": [1]}]}},
     "field 'scaling.pools[1].provisioned' is missing"),
    ({"model": {"name": 3}}, "field 'model.name' must be a string or null, got 3"),
    ({"prefix_cache": {"queries": 1, "hits": "y" * 100}},  # cut to 60 characters
     "field 'prefix_cache.hits' must be an integer >= 0, got \"" + "y" * 56 + "..."),
])
def test_fields_are_checked_by_their_rules(fields: dict[str, object], problem: str | None
                                           ) -> None:
    info = {**run_info("simulate", "s", TRACE), **fields}
    if problem is None:
        assert check_run_info(info, Path("s/run.json")) is info
        return
    with pytest.raises(ValueError) as err:
        check_run_info(info, Path("s/run.json"))
    assert str(err.value) == f"s/run.json: {problem}"


def test_source_run_info_of_a_directory_its_steps_and_what_has_none(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "steps.parquet").write_text("")  # not read here
    assert source_run_info(run) is None  # a bare steps.parquet: no run.json
    assert source_run_info(run / "steps.parquet") is None
    info = run_info("simulate", "run", TRACE)
    (run / "run.json").write_text(json.dumps(info))
    assert source_run_info(run) == info
    assert source_run_info(run / "steps.parquet") == info
    assert source_run_info(run / "nope") is None  # not there: its reader names it
    bench = tmp_path / "bench.json"  # a vLLM bench file beside a run.json
    bench.write_text("{}")
    (tmp_path / "run.json").write_text("[]")
    assert source_run_info(bench) is None
    (run / "run.json").write_text("{}")
    with pytest.raises(ValueError, match=f"^{run / 'run.json'}: field 'kind' is missing$"):
        source_run_info(run)
    (run / INTERRUPTED_FILE).write_text("x\n")
    with pytest.raises(ValueError, match=f"^{run}: the write of this run was interrupted$"):
        source_run_info(run / "steps.parquet")
