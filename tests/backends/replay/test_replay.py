"""The real-time replay driver and `rt replay`: every request served in full, arrivals
respected on the wall clock, attribution parts summing to E2E, the simulator's run directory
and console blocks, and one-line errors for bad input."""

from __future__ import annotations

import json
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from analysis.rundir import load_run
from backends.engine.setup import RealEngineArgs, build_engine
from backends.engine.tiny_model import build_tiny_llama
from backends.replay.driver import ReplayConfig, replay
from cli import app
from runtime.records import PART_COLUMNS, STEP_FIELDS, RequestRecord
from workloads import (
    ArrivalProcess,
    RandomLengths,
    Trace,
    TraceRequest,
    prompt_token_ids,
    random_trace,
    write_rt_jsonl,
)

cli_runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def small_trace() -> Trace:
    return random_trace(12, RandomLengths(input_len=40, output_len=6, range_ratio=0.5,
                                          prefix_len=16),
                        ArrivalProcess(request_rate=40.0, burstiness=1.0, seed=5))


def _replay(tiny_dir: Path, trace: Trace, **flags: object):  # type: ignore[no-untyped-def]
    setup = build_engine(RealEngineArgs(model_dir=tiny_dir, **flags))  # type: ignore[arg-type]
    config = ReplayConfig(setup.scheduler, setup.cache, setup.shape.vocab_size,
                          check_invariants=True)
    return replay(trace, config, setup.runner), setup


def test_replay_serves_every_request_in_real_time(tiny_dir: Path, small_trace: Trace) -> None:
    result, _ = _replay(tiny_dir, small_trace, block_size=4, max_num_batched_tokens=32,
                        max_num_seqs=4)
    assert [r.request_id for r in result.requests] == [r.request_id for r in small_trace]
    for req, record in zip(small_trace, result.requests, strict=True):
        assert record.status == "FINISHED_LENGTH_CAPPED"
        assert record.output_len == req.output_len == len(record.token_times_s)
        assert record.queued_s is not None and record.queued_s >= req.arrival_s
        assert record.engine_queued_s is not None and record.engine_queued_s >= record.queued_s
        e2e = record.finish_s - record.arrival_s  # type: ignore[operator]
        parts = sum(getattr(record, column) for column in PART_COLUMNS)
        assert parts == pytest.approx(e2e, abs=1e-9)
    assert result.wall_s >= small_trace[-1].arrival_s
    assert result.prefix_cache_hits > 0  # the 16-token shared prefix
    durations = result.step_columns["duration_s"]
    assert len(durations) == result.num_steps and all(d > 0 for d in durations)


def test_replay_records_match_the_schema(tiny_dir: Path, small_trace: Trace) -> None:
    result, _ = _replay(tiny_dir, small_trace)
    assert list(result.step_columns) == list(STEP_FIELDS)
    names = [f.name for f in fields(RequestRecord)]
    assert all(list(r.to_row()) == names for r in result.requests)


def test_replay_tokens_are_the_trace_ids(tiny_dir: Path) -> None:
    """The engine sees the simulator's prompt ids: a request's prompt is what
    `prompt_token_ids` gives, checked through the runner's state mid-run."""
    req = TraceRequest("only", 0.0, 20, 3)
    setup = build_engine(RealEngineArgs(model_dir=tiny_dir))
    seen: dict[str, list[int]] = {}
    execute = setup.runner.execute

    def spy(output):  # type: ignore[no-untyped-def]
        for new in output.scheduled_new_reqs:
            seen[new.req_id] = list(new.prompt_token_ids)
        return execute(output)

    setup.runner.execute = spy  # type: ignore[method-assign]
    replay(Trace((req,)), ReplayConfig(setup.scheduler, setup.cache, 512, seed=7),
           setup.runner)
    assert seen["only"] == prompt_token_ids(req, 512, 7)


def _invoke(*args: str) -> tuple[int, str, str]:
    result = cli_runner.invoke(app, ["replay", *args])
    return result.exit_code, result.stdout, result.stderr


def test_cli_replay_writes_a_run_directory(tiny_dir: Path, small_trace: Trace,
                                           tmp_path: Path) -> None:
    trace_path = tmp_path / "t.jsonl"
    write_rt_jsonl(small_trace, trace_path)
    code, out, err = _invoke(str(trace_path), "--model", str(tiny_dir), "--result-dir",
                             str(tmp_path / "run"), "--num-gpu-blocks-override", "32",
                             "--block-size", "16", "--time-scale", "0.5")
    assert code == 0, err
    assert "Successful requests:                     12" in out
    assert "rt: where the time went" in out
    assert "GPU KV cache size: 512 tokens" in err
    run = load_run(tmp_path / "run")
    assert list(run.requests.columns) == [f.name for f in fields(RequestRecord)]
    assert list(run.steps.columns) == list(STEP_FIELDS)
    assert len(run.requests) == 12 and (run.requests["status"] == "FINISHED_LENGTH_CAPPED").all()
    assert run.requests["arrival_s"].max() == pytest.approx(small_trace[-1].arrival_s * 0.5)
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["kind"] == "replay" and info["cache_config"]["num_blocks"] == 32
    assert info["attention"] == "torch" and info["trace"]["requests"] == 12


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: not a directory"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--dtype", "int3"], "--dtype must be auto"),
    (["--max-model-len", "100000"], "is longer than the model's max_position_embeddings"),
    (["--max-model-len", "64"], "exceed max_model_len=64"),
    (["--num-gpu-blocks-override", "1"], "--num-gpu-blocks-override must be >= 2"),
])
def test_cli_replay_user_errors_are_one_line(tiny_dir: Path, args: list[str],
                                             message: str) -> None:
    full = args if args[0] == "--model" else ["--model", str(tiny_dir), *args]
    code, _, err = _invoke(*full)
    assert code == 2
    assert err.startswith("rt: error: ") and message in err and err.count("\n") == 1


def test_cli_replay_rejects_an_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code, _, err = _invoke("--model", str(tmp_path))
    assert code == 2 and "unsupported architecture 'gpt2'" in err


def test_cli_replay_rejects_a_bad_trace(tiny_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x7,3\n")
    code, _, err = _invoke(str(bad), "--model", str(tiny_dir))
    assert code == 2 and err.startswith("rt: error: ") and "x7" in err


def test_kv_pool_from_memory_bytes(tiny_dir: Path) -> None:
    setup = build_engine(RealEngineArgs(model_dir=tiny_dir, kv_cache_memory=1 << 20,
                                        block_size=16))
    # 2 (K, V) x 2 layers x 16 tokens x 2 KV heads x 32 head_dim x 4 bytes = 16 KiB a block
    assert setup.pool.num_blocks == 64 and setup.cache.num_blocks == 64
    assert setup.runner.kv_cache.key_caches[0].shape == (64, 16, 2, 32)
    assert setup.runner.kv_cache.key_caches[0].dtype == torch.float32


@pytest.mark.parametrize("step_delay_s", [0.0, 0.05])
def test_ctrl_c_keeps_the_records_so_far(tiny_dir: Path, small_trace: Trace,
                                         step_delay_s: float) -> None:
    """Ctrl-C before a step the replay always takes: a step gives each of at most 4 requests
    one token, so the trace's 59 tokens take >= 15 steps however the wall clock batches them.
    Slow steps (`step_delay_s`, as on a loaded machine) batch more arrivals: 38 steps a run
    here unslowed, 20 at 20 ms a step, 18 at 50 ms (an interrupt after step 20 once never
    came, in a full suite run at load ~5)."""
    setup = build_engine(RealEngineArgs(model_dir=tiny_dir, max_num_seqs=4))
    execute, calls = setup.runner.execute, [0]
    steps = 10
    assert steps < sum(req.output_len for req in small_trace) / 4

    def interrupted(output):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] > steps:
            raise KeyboardInterrupt
        time.sleep(step_delay_s)
        return execute(output)

    setup.runner.execute = interrupted  # type: ignore[method-assign]
    config = ReplayConfig(setup.scheduler, setup.cache, setup.shape.vocab_size)
    result = replay(small_trace, config, setup.runner)
    assert result.interrupted and result.num_steps == steps
    statuses = {r.status for r in result.requests}
    assert "FINISHED_ABORTED" in statuses and 0 < len(result.requests) <= len(small_trace)
    for record in result.requests:
        e2e = record.finish_s - record.arrival_s  # type: ignore[operator]
        assert sum(getattr(record, c) for c in PART_COLUMNS) == pytest.approx(e2e, abs=1e-9)


class BrokenTokenizer:
    """Module level: pickled into the API-server process."""

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(map(str, token_ids))

    def encode(self, text: str) -> list[int]:
        raise RuntimeError("tokenizer exploded")


def test_an_api_server_failure_reaches_the_engine(tiny_dir: Path, small_trace: Trace) -> None:
    """A tokenizer that raises ends the API-server process: the replay raises its error
    instead of waiting forever for the next hand-over."""
    setup = build_engine(RealEngineArgs(model_dir=tiny_dir, max_num_seqs=4))
    config = ReplayConfig(setup.scheduler, setup.cache, setup.shape.vocab_size)
    with pytest.raises(RuntimeError, match="tokenizer exploded"):
        replay(small_trace, config, setup.runner, BrokenTokenizer())


def test_steps_run_with_the_startup_heap_frozen(tiny_dir: Path, small_trace: Trace) -> None:
    """No full garbage collection of the model's objects inside a timed step: they are
    frozen while the replay runs, and released after it."""
    import gc

    setup = build_engine(RealEngineArgs(model_dir=tiny_dir, max_num_seqs=4))
    execute, frozen = setup.runner.execute, []

    def watched(output):  # type: ignore[no-untyped-def]
        frozen.append(gc.get_freeze_count())
        return execute(output)

    setup.runner.execute = watched  # type: ignore[method-assign]
    config = ReplayConfig(setup.scheduler, setup.cache, setup.shape.vocab_size)
    replay(small_trace, config, setup.runner)
    assert frozen and min(frozen) > 100_000  # torch, transformers, the model
    assert gc.get_freeze_count() == 0


def test_random_weights_from_the_config_alone(tiny_dir: Path, tmp_path: Path) -> None:
    """--random-weights reads config.json only: seeded weights, not the checkpoint's."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((tiny_dir / "config.json").read_text())

    def weights(path: Path, **flags: object) -> dict[str, torch.Tensor]:
        setup = build_engine(RealEngineArgs(model_dir=path, **flags))  # type: ignore[arg-type]
        return dict(setup.runner.model.hf_model.state_dict())

    a = weights(config_only, random_weights=True, seed=3)
    b = weights(config_only, random_weights=True, seed=3)
    c = weights(config_only, random_weights=True, seed=4)
    saved = weights(tiny_dir)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[name], b[name])
    assert not torch.equal(a[name], c[name]) and not torch.equal(a[name], saved[name])
    with pytest.raises(ValueError, match="cannot load the weights"):
        build_engine(RealEngineArgs(model_dir=config_only))  # no checkpoint without the flag


def test_preset_config_dirs(tmp_path: Path) -> None:
    from backends.engine.tiny_model import preset_config_dir

    path = preset_config_dir("llama-3.1-8b", tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"],
            config["intermediate_size"], config["vocab_size"]) == (4096, 32, 8, 14336, 128256)
    assert config["rope_parameters"]["rope_theta"] == 500000.0
    with pytest.raises(ValueError, match="not a preset"):
        preset_config_dir("llama-9b", tmp_path)
