"""Fleet and P/D runs as `rt simulate` writes them, through `rt report --html
--trace-events`: no part missing (the report used to raise KeyError: 'routing_s'), and every
request's timeline, read from its own replica's steps, tiles [arrival, finish) and adds up
to its recorded parts. And the replicas' small multiples stay bounded."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from analysis.engine_steps import EngineSteps
from analysis.html_fleet import shown_replicas
from analysis.html_report import html_report
from analysis.metrics import parts_of
from analysis.rundir import load_run
from analysis.timelines import engine_timeline, part_totals
from cli import app
from tests.analysis.handmade import fleet_run
from tests.analysis.test_trace_events import check_format

runner = CliRunner()
LOADED = ["--first-n", "80", "--time-scale", "0.1"]  # queues, and preempts on small pools
POOLS = """
[[pool]]
name = "p"
count = 1
gpu = "h200"
model = "llama-3.1-8b"
role = "prefill"

[pool.engine]
max_num_batched_tokens = 512
max_num_seqs = 8

[[pool]]
name = "d"
count = 2
gpu = "h200"
model = "llama-3.1-8b"
role = "decode"

[pool.engine]
max_num_seqs = 8
num_gpu_blocks_override = 300
"""


def _simulate(*args: str) -> None:
    result = runner.invoke(app, ["simulate", *LOADED, *args])
    assert result.exit_code == 0, result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fleets")
    (root / "pd.toml").write_text(POOLS)
    _simulate("--replicas", "3", "--router", "round-robin", "--routing-latency-ms", "1",
              "--max-num-seqs", "8", "--num-gpu-blocks-override", "300",
              "--result-dir", str(root / "fleet"))
    _simulate("--fleet", str(root / "pd.toml"), "--pd-decider", "always",
              "--result-dir", str(root / "pd"))
    return {"fleet": root / "fleet", "pd": root / "pd"}


@pytest.mark.parametrize("kind", ["fleet", "pd"])
def test_report_writes_html_and_trace_events(runs: dict[str, Path], kind: str,
                                             tmp_path: Path) -> None:
    html, trace = tmp_path / "r.html", tmp_path / "t.json"
    result = runner.invoke(app, ["report", str(runs[kind]), "--html", str(html),
                                 "--trace-events", str(trace), "--no-plots"])
    assert result.exit_code == 0, result.stderr
    text = html.read_text()
    assert 'id="replicas"' in text and 'data-plot="replica timelines"' in text
    assert ("KV transfer (P/D)" in text) == (kind == "pd")
    document = json.loads(trace.read_text())
    check_format(document)
    names = [e["args"]["name"] for e in document["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"]
    expected = (["replica 0", "replica 1", "replica 2"] if kind == "fleet" else
                ["replica 0 (p, prefill)", "replica 1 (d, decode)", "replica 2 (d, decode)"])
    assert names == [*expected, "requests"]


@pytest.mark.parametrize("kind", ["fleet", "pd"])
def test_timelines_add_up_to_the_recorded_parts(runs: dict[str, Path], kind: str) -> None:
    """Exact for every part but the split of a running request's gaps between preemption
    and decode, which is inferred (`analysis.timelines`); their sum is exact."""
    run = load_run(runs[kind])
    steps = EngineSteps(run.steps)
    parts = parts_of(run.requests)
    assert kind == "fleet" or int(run.requests["num_preemptions"].sum()) > 0, "loaded enough"
    for _, row in run.requests.iterrows():
        tl = engine_timeline(row, steps)
        ends = [t for s in tl.segments for t in (s.start_s, s.end_s)]
        assert ends[0] == tl.arrival_s and ends[-1] == pytest.approx(tl.finish_s, abs=1e-12)
        assert ends[1:-1:2] == pytest.approx(ends[2::2], abs=1e-12)  # back to back
        totals = part_totals(tl)
        for part in parts:
            if part not in ("preempted_s", "decode_s"):
                assert totals.get(part, 0.0) == pytest.approx(row[part], abs=1e-9), part
        running = totals.get("preempted_s", 0.0) + totals.get("decode_s", 0.0)
        assert running == pytest.approx(row["preempted_s"] + row["decode_s"], abs=1e-9)


def test_many_replicas_show_the_busiest_and_least_busy_half_and_half(tmp_path: Path) -> None:
    load = np.array([5, 1, 9, 3, 7, 2, 8, 4, 6, 0])
    assert shown_replicas(load, limit=4) == [1, 2, 6, 9]  # 9 and 8; 0 and 1 requests
    assert shown_replicas(load[:4], limit=4) == [0, 1, 2, 3]
    run = fleet_run(tmp_path)  # two replicas with requests, eight idle ones
    run = replace(run, info={**run.info, "fleet": {**run.info["fleet"], "replicas": 10}})
    text = html_report(run)
    rows = re.search(r'id="replicas".*?<tbody>(.*?)</tbody>', text, re.S).group(1)
    assert rows.count("<tr>") == 10
    assert "<td>replica 9</td><td data-v=\"0.0\">0</td>" in rows
    assert "8 of 10 replicas shown: the 4 busiest and the 4 least busy" in text
    figure = re.search(r'data-plot="replica timelines">(.*?)</figure>', text, re.S).group(1)
    labels = re.findall(r">(replica \d+)<", figure)  # ties: the lower index first
    assert labels == [f"replica {r}" for r in range(8)]
