"""`rt simulate --replicas N --router POLICY` and `--fleet FILE` end to end: the records name
their replica, the fleet block is printed, one replica equals the single engine, and bad
fleet input is one line with exit 2."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from analysis.fleet import fleet_summary, imbalance, jain_index, replica_table
from analysis.report import result_dict
from analysis.rundir import load_run
from cli import app
from sim import fleet_run
from tests.sim.test_fleet_shares import mixed_fleet_file
from workloads import ArrivalProcess, RandomLengths, random_trace, write_rt_jsonl

runner = CliRunner()


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "small.jsonl"
    trace = random_trace(30, RandomLengths(input_len=200, output_len=20, range_ratio=0.5),
                         ArrivalProcess(request_rate=30.0, burstiness=1.0, seed=5))
    write_rt_jsonl(trace, path)
    return path


def simulate(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["simulate", *args])
    return result.exit_code, result.stdout, result.stderr


def test_round_robin_fleet_spreads_requests_and_prints_the_fleet_block(
        small_trace: Path, tmp_path: Path) -> None:
    code, out, err = simulate("--trace", str(small_trace), "--replicas", "3", "--router",
                              "round-robin", "--routing-latency-ms", "1",
                              "--result-dir", str(tmp_path / "f"))
    assert code == 0, err
    assert "===================== Fleet ======================" in out
    assert "Routing (fleet)" in out
    run = load_run(tmp_path / "f")
    assert list(run.requests["replica"]) == [i % 3 for i in range(30)]
    assert run.requests["routing_s"].round(9).eq(0.001).all()
    assert set(run.steps["replica"]) == {0, 1, 2}
    assert run.info["fleet"]["replicas"] == 3 and run.info["fleet"]["router"] == "round-robin"
    result = result_dict(run)  # rt report / rt compare carry the fleet figures
    assert result["fleet_replicas"] == 3 and result["fleet_request_imbalance"] == 1.0
    assert result["fleet_replica_shares"] == [round(1 / 3, 6)] * 3
    assert result["fleet_jain_requests"] == 1.0


@pytest.mark.parametrize("router", ["random", "least-outstanding"])  # apart, in lockstep
def test_sim_workers_write_the_same_records(router: str, small_trace: Path,
                                            tmp_path: Path) -> None:
    fleet = ["--trace", str(small_trace), "--replicas", "4", "--router", router]
    assert simulate(*fleet, "--result-dir", str(tmp_path / "one"))[0] == 0
    code, _, err = simulate(*fleet, "--sim-workers", "2", "--result-dir", str(tmp_path / "two"))
    assert code == 0, err
    assert "--sim-workers" not in err  # it applies: no note
    for name in ("requests.parquet", "steps.parquet"):
        one, two = (pd.read_parquet(tmp_path / run / name) for run in ("one", "two"))
        assert one.equals(two), name


def test_more_lockstep_processes_than_cpus_is_said(small_trace: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Lockstep waits for the slowest process at every decision: more processes than CPUs
    run slower than fewer (a pre-routed fleet's workers never wait on each other: no note)."""
    monkeypatch.setattr(fleet_run, "usable_cpus", lambda: 1)
    fleet = ["--trace", str(small_trace), "--replicas", "4", "--sim-workers", "3"]
    code, _, err = simulate(*fleet, "--router", "least-outstanding",
                            "--result-dir", str(tmp_path / "a"))
    assert code == 0, err
    assert ("note: --sim-workers 3: 3 processes in lockstep on 1 CPUs; every routing decision "
            "waits for the slowest process, so more processes than free CPUs run slower than "
            "fewer") in err
    code, _, err = simulate(*fleet, "--router", "random", "--result-dir", str(tmp_path / "b"))
    assert code == 0 and "--sim-workers" not in err, err


def test_sim_workers_behind_a_router_reading_replicas_run_in_one_process(
        small_trace: Path, tmp_path: Path) -> None:
    code, _, err = simulate("--trace", str(small_trace), "--replicas", "2", "--router", "llm-d",
                            "--sim-workers", "2", "--result-dir", str(tmp_path / "f"))
    assert code == 0, err
    assert err.count("--sim-workers") == 1
    assert ("note: --sim-workers 2: router 'llm-d' reads the replicas' metrics or KV events "
            "(or first tokens) as it routes; simulating the fleet in one process") in err


def test_one_replica_fleet_equals_the_single_engine(small_trace: Path, tmp_path: Path) -> None:
    assert simulate("--trace", str(small_trace), "--result-dir", str(tmp_path / "one"))[0] == 0
    code, _, err = simulate("--trace", str(small_trace), "--fleet", str(_fleet_file(
        tmp_path, count=1)), "--router", "llm-d", "--result-dir", str(tmp_path / "fleet"))
    assert code == 0, err
    single, fleet = load_run(tmp_path / "one"), load_run(tmp_path / "fleet")
    assert fleet.requests.drop(columns=["replica", "routing_s"]).equals(single.requests)
    assert fleet.steps.drop(columns=["replica"]).equals(single.steps)


def test_run_json_says_client_times_when_any_replica_delays_tokens(small_trace: Path,
                                                                  tmp_path: Path) -> None:
    """token_times "client" when any replica's front end has an output cost (here the third
    replica's, not the first's, whose setup run.json's other sections show)."""
    path = tmp_path / "fleet.toml"
    path.write_text(mixed_fleet_file(tmp_path))
    code, _, err = simulate("--trace", str(small_trace), "--fleet", str(path), "--router",
                            "round-robin", "--result-dir", str(tmp_path / "f"))
    assert code == 0, err
    assert load_run(tmp_path / "f").info["token_times"] == "client"


def _fleet_file(tmp_path: Path, count: int) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(f'[[pool]]\nname = "a"\ncount = {count}\ngpu = "h200"\n'
                    'model = "llama-3.1-8b"\n')
    return path


@pytest.mark.parametrize(("args", "needle"), [
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--replicas", "2", "--router", "nope"], "unknown router policy 'nope'"),
    (["--replicas", "2", "--router", "llm-d", "--router-arg", "queue=x"], "queue"),
    (["--replicas", "2", "--router-refresh-ms", "-1"],
     "--router-refresh-ms must be in [0, 3,600,000] ms, got -1.0"),
    (["--replicas", "2", "--routing-latency-ms", "1e308"],  # was a numpy error after the run
     "--routing-latency-ms must be in [0, 3,600,000] ms, got 1e+308"),
    (["--replicas", "2", "--kv-event-delay-ms", "nan"], "--kv-event-delay-ms must be in"),
    (["--replicas", "2", "--fleet", "x.toml"], "give --replicas or --fleet, not both"),
])
def test_bad_fleet_flags_are_one_line(small_trace: Path, tmp_path: Path, args: list[str],
                                      needle: str) -> None:
    code, out, err = simulate("--trace", str(small_trace), *args,
                              "--result-dir", str(tmp_path / "x"))
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("rt: error: ") and needle in err


def test_jain_and_imbalance_by_hand() -> None:
    assert jain_index([1, 1, 1, 1]) == 1.0
    assert jain_index([4, 0, 0, 0]) == 0.25  # 16 / (4 * 16)
    assert jain_index([3, 1]) == pytest.approx(16 / 20)  # (3+1)^2 / (2 * (9+1))
    assert imbalance([3, 1]) == 1.5 and imbalance([0, 0]) == 1.0


def test_replica_table_by_hand() -> None:
    requests = pd.DataFrame({
        "replica": [0, 0, 1], "prompt_len": [100, 300, 200], "cached_tokens": [0, 100, 50],
        "num_preemptions": [0, 2, 0], "status": ["FINISHED_LENGTH_CAPPED"] * 3,
        "output_len": [4, 4, 4],
        "arrival_s": [0.0, 1.0, 2.0], "first_token_s": [0.01, 1.03, 2.02]})
    steps = pd.DataFrame({"replica": [0, 0, 1], "kv_usage": [0.1, 0.3, 0.5]})
    table = replica_table(requests, steps)
    assert list(table["requests"]) == [2, 1] and list(table["prompt_tokens"]) == [400, 200]
    assert table["prefix_hit_rate"].tolist() == [0.25, 0.25]
    assert table["mean_kv_usage"].round(9).tolist() == [0.2, 0.5]
    assert list(table["preemptions"]) == [2, 0]
    assert table["p50_ttft_ms"].round(6).tolist() == [20.0, 20.0]
    summary = fleet_summary(table)
    assert summary["prefix_hit_rate"] == 0.25  # 150 of 600 prompt tokens
    assert summary["request_imbalance"] == pytest.approx(2 / 1.5)


def test_sweep_takes_replica_counts_and_routers_as_lists(small_trace: Path,
                                                         tmp_path: Path) -> None:
    result = runner.invoke(app, ["sweep", "--trace", str(small_trace), "--replicas", "1,2",
                                 "--router", "round-robin,least-outstanding", "--jobs", "1",
                                 "--no-plots", "--result-dir", str(tmp_path / "s")])
    assert result.exit_code == 0, result.stderr
    table = pd.read_csv(tmp_path / "s" / "sweep.csv")
    assert list(zip(table["replicas"], table["router"], strict=True)) == [
        (1, "round-robin"), (1, "least-outstanding"), (2, "round-robin"),
        (2, "least-outstanding")]
    runs = sorted((tmp_path / "s").glob("00[23]-*"))
    assert all("replica" in load_run(run).requests.columns for run in runs)
    assert list(load_run(runs[0]).requests["replica"]) == [i % 2 for i in range(30)]
    # one replica is the single engine: both routers give the same records
    one = sorted((tmp_path / "s").glob("00[01]-*"))
    assert load_run(one[0]).requests.equals(load_run(one[1]).requests)


def test_autoscaled_fleet_writes_its_timeline_plot_and_cost(small_trace: Path,
                                                           tmp_path: Path) -> None:
    code, out, err = simulate("--trace", str(small_trace), "--replicas", "3", "--autoscale",
                              "kv-threshold", "--autoscale-interval-s", "0.2",
                              "--startup-s", "0.1", "--gpu-cost-per-hour", "2",
                              "--result-dir", str(tmp_path / "a"))
    assert code == 0, err
    assert "Autoscaling policy:                      kv-threshold" in out
    run = load_run(tmp_path / "a")
    scaling = run.info["scaling"]
    assert run.info["autoscale"]["autoscale"] == "kv-threshold"
    assert scaling["policy"] == "kv-threshold" and len(run.requests) == 30
    assert scaling["cost"] == pytest.approx(2 * scaling["gpu_hours"])
    assert (tmp_path / "a" / "plots" / "replicas.png").is_file()
    report = runner.invoke(app, ["report", str(tmp_path / "a"), "--no-plots"])
    assert report.exit_code == 0 and "GPU-hours:" in report.stdout
    cost = f"{'Cost:':<40} {scaling['cost']:.2f}\n"
    assert cost in out and cost in report.stdout


def test_a_fixed_fleet_reports_gpu_hours(small_trace: Path, tmp_path: Path) -> None:
    code, out, err = simulate("--trace", str(small_trace), "--replicas", "2",
                              "--result-dir", str(tmp_path / "f"))
    assert code == 0, err
    scaling = load_run(tmp_path / "f").info["scaling"]
    assert scaling["policy"] is None and scaling["pools"][0]["serving"] == [2]
    assert scaling["gpu_hours"] == pytest.approx(2 * scaling["end_s"] / 3600)
    # no price given: the cost says so rather than 0.00, which would read as free
    assert scaling["cost"] == 0.0
    pool = out.split("Scaling")[-1].splitlines()[3]
    assert pool.split() == ["default", "2", "2", f"{scaling['gpu_hours']:.3f}", "-"]
    assert "Cost:                                    not priced (--gpu-cost-per-hour" in out


@pytest.mark.parametrize("args, message", [
    (["--min-replicas", "2"], "--min-replicas 2 needs --autoscale"),
    (["--autoscale", "hpa"], "--autoscale must be one of"),
    (["--autoscale", "kv-threshold", "--min-replicas", "3"],  # once after the start-up lines
     "--min-replicas 3 is above --replicas 2"),
    (["--autoscale", "kv-threshold", "--autoscale-arg", "x=1"], "--autoscale-arg"),
    (["--autoscale", "kv-threshold", "--pd-decider", "always"], "does not combine with P/D"),
    # badinput4: once a MemoryError traceback (the replicas' list made before any step)
    (["--autoscale", "kv-threshold", "--max-replicas", "99999999999999"],
     "--max-replicas must be at most 4096, got 99999999999999"),
    (["--autoscale", "kv-threshold", "--min-replicas", "4097", "--max-replicas", "5000"],
     "--min-replicas must be at most 4096, got 4097"),
    # printed a cost of inf or 300 digits
    (["--gpu-cost-per-hour", "1e308"], "--gpu-cost-per-hour must be at most 10000, got 1e+308"),
])
def test_bad_autoscale_input_is_one_line(small_trace: Path, tmp_path: Path, args: list[str],
                                         message: str) -> None:
    code, _, err = simulate("--trace", str(small_trace), "--replicas", "2", *args,
                            "--result-dir", str(tmp_path / "bad"))
    assert code == 2 and message in err, err
    assert len(err.splitlines()) == 1, err  # before vLLM's start-up lines


_POOL = 'name = "{}"\ncount = 2\ngpu = "h200"\nmodel = "llama-3.1-8b"\nrole = "{}"\n'


@pytest.mark.parametrize("roles, args, message", [
    # once one line, but after the start-up lines
    (["both"], ["--autoscale", "kv-threshold", "--min-replicas", "3"],
     "--min-replicas 3 is above pool 'p0''s count 2"),
    (["prefill"], ["--pd-decider", "always"], "a P/D fleet needs a pool that decodes"),
    # badinput4: ran as if aggregated, the decode-only replicas prefilling everything
    (["decode", "decode"], ["--pd-decider", "always"], "a P/D fleet needs a pool that prefills"),
    # once run without a word, the fleet file's pools taking none of them
    (["both"], ["--gpu", "a100-80gb"], "--fleet sets each pool's gpu: --gpu 'a100-80gb'"),
    (["both"], ["-tp", "2"], "--fleet sets each pool's tensor_parallel_size: "
                            "--tensor-parallel-size 2"),
    (["both"], ["--max-num-seqs", "8"], "--fleet sets each pool's engine flags: "
                                        "--max-num-seqs 8"),
    (["both"], ["--model", "qwen2.5-7b"], "--model 'qwen2.5-7b'"),
    (["both"], ["--profile", "calibrated"], "--profile 'calibrated'"),
    # badinput4: each pool may grow to --max-replicas; the fleet past 4096 ran
    (["both", "both"], ["--autoscale", "kv-threshold", "--max-replicas", "2049"],
     "--max-replicas 2049 for each of 2 pools is 4,098 replicas; a fleet holds at most 4096"),
])
def test_bad_fleet_file_combinations_are_one_line_before_any_output(
        small_trace: Path, tmp_path: Path, roles: list[str], args: list[str],
        message: str) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text("\n".join(f"[[pool]]\n{_POOL.format(f'p{i}', role)}"
                              for i, role in enumerate(roles)))
    code, out, err = simulate("--trace", str(small_trace), "--fleet", str(path), *args,
                              "--result-dir", str(tmp_path / "bad"))
    assert code == 2 and out == "" and message in err, err
    assert len(err.splitlines()) == 1, err


_FLEET = ": --replicas N or --fleet FILE"
_PD = " (--pd-decider always or prefix-threshold on a fleet, or pools with roles)"


@pytest.mark.parametrize("args, message", [
    # a fleet's flags on one engine
    (["--router", "llm-d"], "--router 'llm-d' needs a fleet" + _FLEET),
    (["--router-refresh-ms", "10"], "--router-refresh-ms 10.0 needs a fleet" + _FLEET),
    (["--routing-latency-ms", "5"], "--routing-latency-ms 5.0 needs a fleet" + _FLEET),
    (["--sim-workers", "4"], "--sim-workers 4 needs a fleet" + _FLEET),
    (["--gpu-cost-per-hour", "3"], "--gpu-cost-per-hour 3.0 needs a fleet" + _FLEET),
    # P/D's flags without P/D, on one engine or a fleet that does not disaggregate
    (["--pd-threshold", "100"], "--pd-threshold 100 needs P/D" + _PD),
    (["--replicas", "2", "--pd-transfer-gbps", "5"], "--pd-transfer-gbps 5.0 needs P/D" + _PD),
    (["--replicas", "2", "--prefill-router", "least-outstanding"],
     "--prefill-router 'least-outstanding' needs P/D" + _PD),
    (["--replicas", "2", "--prefill-router-arg", "x=1"],
     "--prefill-router-arg x=1 needs P/D" + _PD),
    (["--replicas", "2", "--pd-decider", "always", "--pd-threshold", "100"],
     "--pd-threshold 100 needs --pd-decider prefix-threshold"),
])
def test_a_flag_that_cannot_apply_is_refused_not_ignored(small_trace: Path, tmp_path: Path,
                                                         args: list[str], message: str) -> None:
    """Each ran without a word, the flag taking no effect (badinput23), as --min-replicas
    without --autoscale once did."""
    code, out, err = simulate("--trace", str(small_trace), *args,
                              "--result-dir", str(tmp_path / "x"))
    assert code == 2 and out == "" and err == f"rt: error: {message}\n", err
