"""`rt fidelity --endpoint`'s library (`sim.endpoint_config`, `sim.endpoint_fidelity`) with a
deterministic stand-in for the endpoint: the simulator with known costs, written as the
client-timed run directory `rt replay --endpoint` writes (no server, no wall clock)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.fidelity import replay_order, write_fidelity
from analysis.rundir import load_run, save_result
from runtime.config import EngineFlags
from sim.client_steps import ClientRun
from sim.cost.api_server import ApiServerCost
from sim.cost.profile_model import ProfileCoefficients, ProfileCostModel
from sim.endpoint_config import METRICS, MODELS, ExportedConfig, endpoint_configs
from sim.endpoint_fidelity import (
    EndpointFidelityPlan,
    check_endpoint_flags,
    endpoint_fidelity,
    read_client_run,
)
from sim.endpoint_warmup import run_warmup
from sim.simulator import SimConfig, simulate
from workloads import ArrivalProcess, Trace, TraceRequest, trace_info
from workloads.synthetic import RandomLengths, random_trace

TRUE = ProfileCoefficients(constant_s=4e-3, per_prefill_token_s=20e-6,
                           per_decode_token_s=150e-6, per_seq_s=0.0,
                           per_prefill_attention_pair_s=0.0, per_decode_kv_token_s=0.5e-6)
FRONT = ApiServerCost(per_request_s=1e-3, per_prompt_token_s=2e-6, per_output_token_s=30e-6)
ENGINE = EngineFlags(max_num_batched_tokens=512, max_num_seqs=64)
EXPORTED = {"max_model_len": 4096,
            "cache_config": {"block_size": 16, "num_gpu_blocks": 4000,
                             "enable_prefix_caching": True}}


def _runs() -> list[ClientRun]:
    trace = Trace((TraceRequest("a", 0.0, 100, 10), TraceRequest("b", 0.1, 250, 5)))
    return [ClientRun("r", trace, {"a": (0.1,), "b": (0.2,)}, {})]


def test_exported_values_and_flags_are_taken_in_order_and_their_source_recorded() -> None:
    exported = ExportedConfig.from_run_infos([{"endpoint": {"max_model_len": None}},
                                              {"endpoint": EXPORTED}])
    assert exported == ExportedConfig(4096, 16, 4000, True)
    sched, cache, sources = endpoint_configs(EngineFlags(max_num_seqs=8, block_size=32),
                                             _runs(), ExportedConfig(2048, 128, 900, False))
    assert (sched.max_model_len, sched.max_num_seqs, sched.max_num_batched_tokens) == \
        (2048, 8, 2048)
    assert (cache.block_size, cache.num_blocks, cache.enable_prefix_caching) == \
        (128, 900, False)
    assert sources["max_model_len"] == MODELS and sources["max_num_seqs"] == "flag"
    assert sources["block_size"] == sources["num_blocks"] == METRICS
    assert "not exported" in sources["max_num_batched_tokens"]
    # flags the user set win over the export; nothing exported: defaults that never bind
    sched, cache, sources = endpoint_configs(
        EngineFlags(max_model_len=1024, num_gpu_blocks_override=77), _runs(),
        ExportedConfig(2048, None, 900, None))
    assert (sched.max_model_len, cache.num_blocks, cache.block_size) == (1024, 77, 16)
    assert sources["num_blocks"] == sources["max_model_len"] == "flag"
    _, cache, sources = endpoint_configs(EngineFlags(), _runs())
    assert cache.num_blocks == 1 + 7 + 16  # ceil(110 / 16) + ceil(255 / 16) blocks
    assert sources["max_model_len"] == "the longest request"


def test_flags_an_endpoint_cannot_honour_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="--calibrate-on grid with --endpoint"):
        check_endpoint_flags("grid", False)
    with pytest.raises(ValueError, match="--step-drift with --endpoint"):
        check_endpoint_flags("replay", True)
    with pytest.raises(ValueError, match="no profile and no calibration replay"):
        EndpointFidelityPlan((("real", 0),), 0, "llama-3.1-8b")


SERVER_SCHED, SERVER_CACHE, _ = endpoint_configs(ENGINE, _runs(),
                                                 ExportedConfig(4096, 16, 4000, True))


class FakeEndpoint:
    """`rt replay --endpoint` against a server that is the simulator with TRUE and FRONT:
    writes the run directory (client columns, no steps, the endpoint's exports in run.json)
    and remembers what it was asked to replay."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (directory name, requests, token seed)

    def __call__(self, trace: Trace, path: Path, token_seed: int) -> None:
        self.calls.append((path.name, len(trace), token_seed))
        config = SimConfig(SERVER_SCHED, SERVER_CACHE, api_server=FRONT, seed=token_seed)
        result = simulate(trace, config, ProfileCostModel(TRUE))
        result.step_columns = {}  # a client sees no steps
        save_result(path, "endpoint", trace_info(trace), result,
                    {}, timing="client", endpoint=EXPORTED, model={"name": "served"})


def test_the_loop_replays_in_abba_order_fits_and_simulates_the_twin(tmp_path: Path) -> None:
    trace = random_trace(60, RandomLengths(300, 32, 0.8), ArrivalProcess(12.0, 1.0, 3))
    endpoint = FakeEndpoint()
    saved: list[tuple[str, dict[str, str]]] = []
    plan = EndpointFidelityPlan(tuple(replay_order(2, True)), 7, "llama-3.1-8b",
                                token_seed=7, step_noise=False, sim_runs=1, warmup_requests=8,
                                rt_version="0.0.0+plan")
    out = endpoint_fidelity(trace, ENGINE, plan, tmp_path, endpoint,
                            lambda path, kind, info, result, describe, **extra: saved.append(
                                (path.name, extra["server_config_from"])) or save_result(
                                path, kind, info, result, describe))
    # warm-up (8 requests: one window), then C R R C, each replay with its own token ids
    assert endpoint.calls == [("warmup", 8, 7), ("calibration", 60, 8), ("real", 60, 9),
                              ("real-2", 60, 10), ("calibration-2", 60, 11)]
    assert out.warmup.requests == 8 and out.warmup.drift is None
    assert out.lines[0].startswith("warm-up: 8 requests in 1 windows")
    assert out.reals == [tmp_path / "real", tmp_path / "real-2"]
    assert out.calibrations == [tmp_path / "calibration", tmp_path / "calibration-2"]
    assert [name for name, _ in saved] == ["sim"] and out.sims == [tmp_path / "sim"]
    assert saved[0][1]["num_blocks"] == METRICS
    profile = json.loads(out.profile.read_text())
    assert profile["versions"]["rt"] == "0.0.0+plan"  # the plan's (cli.py's), not looked up
    assert profile["fit"]["sources"] == [str(tmp_path / "calibration"),
                                         str(tmp_path / "calibration-2")]
    assert profile["fit"]["server_config"]["cache"]["num_blocks"] == 4000
    c = profile["coefficients"]
    assert c["constant_s"] == pytest.approx(TRUE.constant_s, rel=0.05)
    assert c["per_prefill_token_s"] == pytest.approx(TRUE.per_prefill_token_s, rel=0.1)
    reals = [load_run(p) for p in out.reals]
    text, violations, _ = write_fidelity(reals, [load_run(p) for p in out.sims], [],
                                         tmp_path, False, 0.05,
                                         [load_run(p) for p in out.calibrations],
                                         {"warmup": out.warmup.to_json_dict()})
    assert "per-step time prediction: none (client-side timing" in text
    assert violations == [], text  # out of sample, noise-free: within 5%
    report = json.loads((tmp_path / "fidelity.json").read_text())
    assert report["steps"] is None and report["real_runs"] == 2
    assert report["metrics"]["p50_itl_ms"]["noise"] == pytest.approx(0.0, abs=1e-9)
    assert report["calibration_runs"] == 2 and report["warmup"]["requests"] == 8
    # the simulated server runs every trace at the same speed: no drift beyond what the
    # resampled traces' own lengths and arrivals make
    drift = {k: report["metrics"][k]["drift"] for k in ("p50_ttft_ms", "p50_itl_ms")}
    assert drift == pytest.approx({"p50_ttft_ms": -0.0195, "p50_itl_ms": -0.0051}, abs=1e-3)
    assert report["drift_warnings"] == [] and "machine drift" not in text


def test_the_warm_up_against_a_steady_server_stops_early(tmp_path: Path) -> None:
    """The simulated server runs at one speed from its first request; the windows' client
    ITL medians (read back from their run directories) still differ by their traces (20
    requests: 4.79 / 4.58 ms here, -4.5%), so it stops after the second, well before its
    100-request bound."""
    trace = random_trace(60, RandomLengths(300, 32, 0.8), ArrivalProcess(12.0, 1.0, 3))
    endpoint = FakeEndpoint()
    warmup, next_seed = run_warmup(trace, 100, 11, 3, tmp_path, endpoint,
                                   lambda path, source: read_client_run(path, source)[0])
    assert endpoint.calls == [("warmup", 20, 3), ("warmup-2", 20, 4)]
    assert next_seed == 5 and warmup.requests == 40
    assert warmup.stable and abs(warmup.drift or 1.0) <= 0.05
    assert [w.itl_median_ms for w in warmup.windows] == pytest.approx([4.7935, 4.5775])
    assert warmup.windows[1].path == tmp_path / "warmup-2"


def test_a_measured_engines_block_size_is_kept_whatever_it_is() -> None:
    """`--block-size` takes vLLM's CUDA sizes (multiples of 16), but a twin reproduces the
    engine it measured: a server that exported block_size 8 is simulated with 8."""
    from runtime import CacheConfig, SchedulerConfig
    from sim.engine_args import args_from_configs, build_setup

    args = args_from_configs(SchedulerConfig(), CacheConfig(block_size=8, num_blocks=40))
    setup = build_setup(args, "llama-3.1-8b", "h200")
    assert (args.block_size, setup.config.cache.block_size, setup.config.cache.num_blocks) == (
        8, 8, 40)
