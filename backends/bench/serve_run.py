"""`rt bench serve`'s run: the load test of `rt serve --simulate` (`serve_load`) or its soak,
as the JSON report the command prints. The simulation of the same arrivals is injected (it
lives in sim/, which backends/ does not import): `simulate(trace) -> RunResult`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backends.bench.flags import ServeBenchFlags, ServeLoadFlags
from backends.bench.serve_load import (
    LoadConfig,
    compare,
    run_load,
    run_soak_load,
    sent_arrivals,
    simulated_server,
)
from runtime.records import RunResult
from workloads import Trace
from workloads.flags import WorkloadFlags, load_workload

Simulate = Callable[[Trace], RunResult]  # arrivals -> the simulator's run


@dataclass(frozen=True, slots=True)
class SimulatedServer:
    """The `rt serve --simulate` the load test starts: python interpreter, cost model, seed
    and the engine limits it is given."""

    python: str
    model: str
    gpu: str
    profile: str | None
    seed: int
    max_model_len: int | None
    max_num_seqs: int | None

    def load_config(self, load: ServeLoadFlags, bench: ServeBenchFlags, vocab_size: int
                    ) -> LoadConfig:
        command = simulated_server(self.python, self.model, self.gpu, self.profile, self.seed,
                                   self.max_model_len, self.max_num_seqs)
        return LoadConfig(command, load.concurrency, vocab_size, self.seed,
                          request_timeout_s=load.timeout, client=bench.client,
                          engine_nice=bench.engine_nice)


def serve_bench(trace: Trace, work: WorkloadFlags, server: SimulatedServer,
                load: ServeLoadFlags, bench: ServeBenchFlags, vocab_size: int,
                simulate: Simulate) -> dict[str, Any]:
    """Replay `trace` (drawn from `work`) through the server, simulate the arrivals as sent,
    compare. RuntimeError when the server does not start."""
    result = run_load(trace, server.load_config(load, bench, vocab_size))
    simulated = simulate(sent_arrivals(trace, result.endpoint.requests)).requests
    rate = work.request_rate
    return {"command": "rt bench serve", "concurrency": load.concurrency,
            "random_input_len": work.input_len, "random_output_len": work.output_len,
            "request_rate": rate if math.isfinite(rate) else "inf", "model": server.model,
            "gpu": server.gpu, "engine_nice": bench.engine_nice,
            **compare(trace, result, simulated)}


def soak_bench(work: WorkloadFlags, server: SimulatedServer, load: ServeLoadFlags,
               bench: ServeBenchFlags, vocab_size: int) -> dict[str, Any]:
    """`--soak`: hold --concurrency streams for `bench.soak` seconds. RuntimeError when the
    server does not start."""
    assert bench.soak is not None
    report = run_soak_load(server.load_config(load, bench, vocab_size), bench.soak,
                           work.input_len, work.output_len)
    return {"command": "rt bench serve --soak", "engine_nice": bench.engine_nice, **report}


def run_serve_bench(work: WorkloadFlags, server: SimulatedServer, load: ServeLoadFlags,
                    bench: ServeBenchFlags, twin: Callable[[], tuple[int, Simulate]]
                    ) -> dict[str, Any]:
    """`rt bench serve`: the random requests of `work` (--num-prompts, default
    --concurrency), then the load test or with --soak the soak. `twin()`: the simulator's
    vocabulary size and simulation. RuntimeError when the server does not start."""
    work = dataclasses.replace(work, dataset_name="random",
                               num_prompts=load.num_prompts or load.concurrency)
    trace = load_workload(work).trace
    vocab, simulate = twin()
    if bench.soak is not None:
        return soak_bench(work, server, load, bench, vocab)
    return serve_bench(trace, work, server, load, bench, vocab, simulate)


def failed(report: dict[str, Any]) -> bool:
    """Exit 1: an error, a token-count mismatch, or (after a soak) KV blocks left in use."""
    return bool(report["errors"] or report["token_count_mismatches"]
                or report.get("kv_blocks_in_use_after"))
