"""rt plan: pruning, the replica bisection, and the answer against an exhaustive search."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from sim.plan import Candidate, PlanFlags, ReplicaSearch, Shape, cheapest, replica_bounds, search
from workloads import ArrivalProcess, RandomLengths, random_trace, write_rt_jsonl

runner = CliRunner()
PRICES = {"h200": 4.0, "h100-sxm": 3.0, "l40s": 1.0}


def _trace(n: int = 60, rate: float = 40.0):  # type: ignore[no-untyped-def]
    return random_trace(n, RandomLengths(input_len=400, output_len=40, range_ratio=0.5),
                        ArrivalProcess(request_rate=rate, burstiness=1.0, seed=2))


@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 8), (3, 9), (2, 16)])
def test_bisection_finds_the_fewest_passing_replicas(lo: int, hi: int) -> None:
    for need in range(lo - 1, hi + 2):  # need <= lo-1: all pass; need > hi: none does
        s = ReplicaSearch(Candidate("h200", "m", 1, None, None, "round-robin"), lo, hi)
        while (n := s.next_count()) is not None:
            s.record(n, n >= need)
        expected = max(need, lo) if need <= hi else None
        assert s.best == expected, (lo, hi, need)
        assert len(s.tried) <= 2 + (hi - lo).bit_length()


def test_search_equals_exhaustive_with_a_known_judge() -> None:
    trace = _trace()
    flags = PlanFlags(slo="p99_ttft_ms=1", gpus="h100-sxm,h200", tensor_parallel_sizes="1,2",
                      max_gpus=8)
    need = {"h100-sxm": 5, "h200": 3}  # GPUs each kind needs, whatever the split

    def judge(shapes: list[Shape]) -> list[bool]:
        return [s.gpus >= need[s.candidate.gpu] for s in shapes]

    searches, pruned = search(flags.candidates(), trace, flags.max_gpus, PRICES, judge)
    assert not pruned
    every = [Shape(c, n, PRICES[c.gpu]) for c in flags.candidates()
             for n in range(1, 8 // c.tensor_parallel_size + 1)]
    passing = sorted((s for s in every if judge([s])[0]),
                     key=lambda s: (s.cost_per_hour, s.gpus, s.name()))
    assert cheapest(searches, PRICES)[0] == passing[0]
    assert passing[0].name() == "h200-llama-3.1-8b-tp1-round-robin-x3"  # $12/h < 5 x $3


def test_pruning_names_its_reason() -> None:
    trace = _trace()
    with pytest.raises(ValueError, match="does not fit|fit"):
        replica_bounds(Candidate("l40s", "llama-3.1-70b", 1, None, None, "round-robin"), trace,
                       8)
    long = random_trace(3, RandomLengths(input_len=200_000, output_len=10),
                        ArrivalProcess(10.0, 1.0, 0))
    with pytest.raises(ValueError, match="never fits one replica"):
        replica_bounds(Candidate("h200", "llama-3.1-8b", 1, None, None, "round-robin"), long, 8)
    heavy = random_trace(400, RandomLengths(input_len=8000, output_len=8),
                         ArrivalProcess(4000.0, 1.0, 0))
    with pytest.raises(ValueError, match="more than --max-gpus 1 allows"):
        replica_bounds(Candidate("l40s", "llama-3.1-8b", 1, None, None, "round-robin"), heavy,
                       1)


def test_rt_plan_answer_is_the_cheapest_passing_shape_of_an_exhaustive_run(
        tmp_path: Path) -> None:
    trace_path = tmp_path / "t.jsonl"
    write_rt_jsonl(_trace(80, 60.0), trace_path)
    common = ["--slo", "p99_ttft_ms=120", "--gpus", "l40s,h100-sxm", "--max-gpus", "3",
              "--jobs", "1"]
    result = runner.invoke(app, ["plan", str(trace_path), *common,
                                 "--result-dir", str(tmp_path / "plan")])
    assert result.exit_code == 0, result.stderr
    answer = (tmp_path / "plan" / "fleet.toml").read_text()
    # exhaustive: every GPU kind at 1..3 replicas, judged by the same SLO
    exhaustive = []
    for gpu in ("l40s", "h100-sxm"):
        for n in (1, 2, 3):
            out = tmp_path / f"x-{gpu}-{n}"
            flags = ["simulate", "--trace", str(trace_path), "--gpu", gpu, "--result-dir",
                     str(out), "--metric-percentiles", "99"]
            flags += ["--replicas", str(n)] if n > 1 else []
            assert runner.invoke(app, flags).exit_code == 0
            report = runner.invoke(app, ["report", str(out), "--no-plots", "--save-result",
                                         "--percentile-metrics", "ttft"])
            assert report.exit_code == 0
            p99 = json.loads((out / "result.json").read_text())["p99_ttft_ms"]
            if p99 <= 120:
                exhaustive.append((n * PRICES[gpu], n, gpu))
    cost, n, gpu = min(exhaustive)
    assert f'gpu = "{gpu}"' in answer and f"count = {n}\n" in answer


@pytest.mark.parametrize(("args", "needle"), [
    ([], "--slo is required"),
    (["--slo", "p99_nope_ms=1"], "nope"),
    (["--slo", "p99_ttft_ms=1", "--gpus", "tpu-v9"], "tpu-v9"),
    (["--slo", "p99_ttft_ms=1", "--gpu-cost", "h200=cheap"], "--gpu-cost"),
    # once "no shape ... meets" after the plan's table (nothing searched)
    (["--slo", "p99_ttft_ms=1", "--gpus", " "], "--gpus: empty list"),
    (["--slo", "p99_ttft_ms=1", "--models", ""], "--models: empty list"),
    (["--slo", "p99_ttft_ms=1", "--routers", ""], "--routers: empty list"),
    # badinput23: once the last of the two taken without a word, or a shape searched twice
    (["--slo", "p99_ttft_ms=1,p99_ttft_ms=5"], "--slo: 'p99_ttft_ms' given twice"),
    (["--slo", "p99_ttft_ms=1", "--gpu-cost", "h200=1,H200=2"],
     "--gpu-cost: 'H200' prices GPU h200 again"),
    (["--slo", "p99_ttft_ms=1", "--gpus", "h200,H200-SXM"], "--gpus: 'H200-SXM' is GPU h200 again"),
    (["--slo", "p99_ttft_ms=1", "--models", "qwen2.5-7b,qwen2.5-7b"],
     "--models: 'qwen2.5-7b' given twice"),
    (["--slo", "p99_ttft_ms=1", "--pd-ratios", "1:1,1:1"], "--pd-ratios: '1:1' given twice"),
    (["--slo", "p99_ttft_ms=1", "--address", "10.0.0.1:6379"],
     "--address '10.0.0.1:6379' needs --executor ray"),
])
def test_bad_plan_input_is_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    result = runner.invoke(app, ["plan", "--first-n", "20", *args,
                                 "--result-dir", str(tmp_path / "p")])
    assert result.exit_code == 2
    assert len(result.stderr.splitlines()) == 1 and needle in result.stderr


def test_pd_splits_are_searched_in_units_of_the_ratio() -> None:
    flags = PlanFlags(slo="p99_itl_ms=1", gpus="h200", pd_ratios="1:3", max_gpus=8)
    aggregated, split = flags.candidates()
    assert split.pd_ratio == (1, 3) and split.unit == 4
    assert split.roles(2) == ["prefill"] * 2 + ["decode"] * 6
    _, lo, hi = replica_bounds(split, _trace(), 8)
    assert (lo, hi) == (1, 2)  # 8 GPUs hold two units of 1 prefill + 3 decode replicas
    shape = Shape(split, 2, PRICES["h200"])
    assert (shape.num_replicas, shape.gpus, shape.cost_per_hour) == (8, 8, 32.0)
    assert shape.name() == "h200-llama-3.1-8b-tp1-round-robin-pd1-3-x8"
    toml = shape.fleet_toml()
    assert 'role = "prefill"\ncost_per_hour = 4\n' in toml and "count = 6\n" in toml
    assert "--pd-decider always" in toml
    with pytest.raises(ValueError, match="--pd-ratios: expected P:D"):
        PlanFlags(pd_ratios="2-2").candidates()


def test_rt_plan_simulates_a_pd_split(tmp_path: Path) -> None:
    trace_path = tmp_path / "t.jsonl"
    write_rt_jsonl(_trace(40, 20.0), trace_path)
    result = runner.invoke(app, ["plan", str(trace_path), "--slo", "p99_ttft_ms=10000",
                                 "--pd-ratios", "1:1", "--max-gpus", "2", "--jobs", "1",
                                 "--result-dir", str(tmp_path / "plan")])
    assert result.exit_code == 0, result.stderr
    assert "pd1-1-x2" in result.stdout
    record = json.loads(next((tmp_path / "plan").glob("*pd1-1-x2/plan.json")).read_text())
    assert record["replicas"] == 2 and record["gpus"] == 2


def test_a_price_or_gpu_spelt_otherwise_is_the_presets() -> None:
    """`--gpu-cost H200=100` was accepted and priced nothing (the plan kept h200's default
    $4/h); `--gpus H200` then failed for want of a price (badinput23)."""
    flags = PlanFlags(slo="p99_itl_ms=1", gpus="H200,a100", gpu_cost="H200=100,A100=7")
    assert [c.gpu for c in flags.candidates()] == ["h200", "a100-80gb"]
    prices = flags.prices()
    assert (prices["h200"], prices["a100-80gb"]) == (100.0, 7.0)
    assert "H200" not in prices and "A100" not in prices
