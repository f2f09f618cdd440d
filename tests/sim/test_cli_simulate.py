"""`rt simulate` end to end through the CLI: output blocks, run directory, determinism, and
one-line errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from analysis.rundir import load_run
from cli import app
from workloads import ArrivalProcess, RandomLengths, random_trace, write_rt_jsonl

runner = CliRunner()


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "small.jsonl"
    trace = random_trace(40, RandomLengths(input_len=300, output_len=40, range_ratio=0.5),
                         ArrivalProcess(request_rate=20.0, burstiness=1.0, seed=3))
    write_rt_jsonl(trace, path)
    return path


def simulate(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["simulate", *args])
    return result.exit_code, result.stdout, result.stderr


def test_simulate_prints_both_blocks_and_writes_a_run_directory(
    small_trace: Path, tmp_path: Path
) -> None:
    code, out, err = simulate("--trace", str(small_trace), "--result-dir", str(tmp_path / "r"),
                              "--metric-percentiles", "50,90,99")
    assert code == 0, err
    assert "============ Serving Benchmark Result ============" in out
    assert "Successful requests:                     40" in out
    assert "P90 TTFT (ms):" in out and "P99 E2EL (ms):" in out
    assert "rt: where the time went" in out
    assert "GPU KV cache size: 918,864 tokens" in err
    assert "Maximum concurrency for 131,072 tokens per request: 7.01x" in err
    run = load_run(tmp_path / "r")
    assert len(run.requests) == 40 and len(run.steps) > 0
    assert run.info["scheduler_config"]["max_num_batched_tokens"] == 8192
    assert run.info["cache_config"]["num_blocks"] == 57429
    assert run.info["trace"]["requests"] == 40


def test_same_inputs_give_byte_identical_requests_parquet(small_trace: Path,
                                                          tmp_path: Path) -> None:
    for name in ("a", "b"):
        code, _, err = simulate("--trace", str(small_trace), "--result-dir", str(tmp_path / name),
                                "--num-gpu-blocks-override", "200", "--max-num-seqs", "8")
        assert code == 0, err
    first = (tmp_path / "a" / "requests.parquet").read_bytes()
    assert first == (tmp_path / "b" / "requests.parquet").read_bytes()
    assert (tmp_path / "a" / "steps.parquet").read_bytes() == \
        (tmp_path / "b" / "steps.parquet").read_bytes()


def test_synthetic_workload_flags(tmp_path: Path) -> None:
    code, out, err = simulate("--dataset-name", "random", "--num-prompts", "20",
                              "--request-rate", "5", "--random-input-len", "100",
                              "--random-output-len", "10", "--result-dir", str(tmp_path / "s"))
    assert code == 0, err
    assert "Total generated tokens:                  200" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "v100"], "unknown GPU 'v100'"),
        (["--max-num-seqs", "0"], "max_num_seqs must be >= 1, got 0"),
        (["--policy", "lifo"], "policy must be 'fcfs' or 'priority', got 'lifo'"),
        (["--trace", "/nonexistent/trace.csv"], "/nonexistent/trace.csv"),
        (["--metric-percentiles", "abc"], "--metric-percentiles"),
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str,
                                          tmp_path: Path) -> None:
    code, out, err = simulate(*args, "--result-dir", str(tmp_path / "x"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rt: error: ") and message in lines[0]
    assert not (tmp_path / "x").exists()


def test_profile_cost_model_and_its_api_server_costs(small_trace: Path, tmp_path: Path) -> None:
    from sim.cost.api_server import ApiServerCost
    from sim.cost.profile_model import ProfileCoefficients
    from sim.profile import Profile, write_profile

    profile = Profile(
        device="test", model="llama-3.1-8b", dtype="bfloat16", versions={}, date="2026-11-30",
        coefficients=ProfileCoefficients(
            constant_s=0.01, per_prefill_token_s=0.0, per_decode_token_s=0.0, per_seq_s=0.0,
            per_prefill_attention_pair_s=0.0, per_decode_kv_token_s=0.0),
        api_server=ApiServerCost(per_request_s=0.002, per_prompt_token_s=0.0))
    write_profile(profile, tmp_path / "p.json")
    code, _, err = simulate("--trace", str(small_trace), "--profile", str(tmp_path / "p.json"),
                            "--result-dir", str(tmp_path / "r"))
    assert code == 0, err
    run = load_run(tmp_path / "r")
    assert set(run.steps["duration_s"]) == {0.01}  # every step costs the constant
    assert (run.requests["api_server_s"] >= 0.002 - 1e-12).all()
    assert run.info["cost_model"]["kind"] == "profile"


def test_empty_workload_is_a_one_line_error(tmp_path: Path) -> None:
    failed_only = tmp_path / "burstgpt.csv"  # BurstGPT drops failed rows: nothing is left
    failed_only.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,"
                           "Log Type\n5,ChatGPT,100,0,100,Conversation log\n")
    code, _, err = simulate("--trace", str(failed_only), "--result-dir", str(tmp_path / "r"))
    assert code == 2
    errors = [line for line in err.strip().splitlines() if line.startswith("rt: error: ")]
    assert len(errors) == 1 and "no requests" in errors[0]
    assert not (tmp_path / "r").exists()


def test_trace_without_timestamps_takes_its_arrivals_from_the_rate_flags(tmp_path: Path) -> None:
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("num_prefill_tokens,num_decode_tokens\n10,5\n20,5\n30,5\n40,5\n")
    code, _, err = simulate("--trace", str(lengths), "--format", "lengths",
                            "--request-rate", "2", "--seed", "1",
                            "--result-dir", str(tmp_path / "r"))
    assert code == 0, err
    arrivals = load_run(tmp_path / "r").requests["arrival_s"].tolist()
    assert arrivals[-1] == pytest.approx(2.0)  # vLLM rescales the last arrival to N / rate


def test_resample_needs_its_dataset_path_and_excludes_trace(small_trace: Path,
                                                            tmp_path: Path) -> None:
    code, out, err = simulate("--dataset-name", "resample", "--dataset-path", str(small_trace),
                              "--num-prompts", "7", "--request-rate", "5",
                              "--result-dir", str(tmp_path / "r"))
    assert code == 0, err
    assert "Successful requests:                     7" in out
    assert "Request rate configured (RPS):           5.00" in out
    code, _, err = simulate("--dataset-name", "random", "--trace", str(small_trace),
                            "--result-dir", str(tmp_path / "x"))
    assert code == 2 and "either --trace or --dataset-name" in err


def test_max_model_len_beyond_the_model_is_refused(tmp_path: Path) -> None:
    code, _, err = simulate("--max-model-len", "200000", "--result-dir", str(tmp_path / "r"))
    assert code == 2 and "max_position_embeddings=131072" in err
