"""`rt bench serve`'s pieces that need no server: the command it starts, when it fails."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time

import pytest

from backends.bench.flags import ServeBenchFlags, ServeLoadFlags
from backends.bench.serve_run import SimulatedServer, failed


def test_load_config_starts_rt_serve_simulate_with_the_engine_limits() -> None:
    server = SimulatedServer("py", "llama-3.1-8b", "h200", None, 3, 4096, None)
    config = server.load_config(ServeLoadFlags(concurrency=7, timeout=9.0),
                                ServeBenchFlags(client="lean"), 500)
    assert config.server_command == ("py", "-m", "cli", "serve", "--simulate", "--sim-model",
                                     "llama-3.1-8b", "--gpu", "h200", "--seed", "3",
                                     "--max-model-len", "4096")
    assert (config.concurrency, config.vocab_size, config.seed, config.request_timeout_s,
            config.client) == (7, 500, 3, 9.0, "lean")


def test_soak_with_a_client_it_does_not_use_is_one_line_exit_2() -> None:
    from typer.testing import CliRunner

    import cli

    with pytest.raises(ValueError, match="^--client lean is not used by --soak "):
        ServeBenchFlags(client="lean", soak=5.0)
    assert ServeBenchFlags(client="httpx", soak=5.0).soak == 5.0
    result = CliRunner().invoke(cli.app, ["bench", "serve", "--soak", "5", "--client",
                                          "capture"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "rt: error: --client capture is not used by --soak (its streams are the soak's own): "
        "drop one of them"]


def test_cpu_spent_between_readings_floors_a_threads_sum_at_its_main_thread() -> None:
    """A thread that ended between the readings takes its seconds out of the sum."""
    from backends.bench.serve_load import spent

    before = {"wall": 10.0, "engine": 1.0, "engine_threads": 3.0, "engine_runqueue": 0.5,
              "engine_threads_runqueue": 0.9}
    after = {"wall": 12.0, "engine": 1.5, "engine_threads": 2.0, "engine_runqueue": 0.75,
             "engine_threads_runqueue": 1.2}
    assert spent(before, after) == {"wall": 2.0, "engine": 0.5, "engine_threads": 0.5,
                                    "engine_runqueue": 0.25, "engine_threads_runqueue": 0.3}


def test_failed_on_errors_mismatches_or_kv_left() -> None:
    ok = {"errors": 0, "token_count_mismatches": 0}
    assert not failed(ok) and not failed({**ok, "kv_blocks_in_use_after": 0})
    assert failed({**ok, "errors": 1}) and failed({**ok, "token_count_mismatches": 2})
    assert failed({**ok, "kv_blocks_in_use_after": 3})


def test_cpu_per_token_and_per_chunk_from_the_server_records() -> None:
    from backends.bench.serve_load import cpu_per_output, latency_summary
    from runtime.records import RequestRecord

    records = [RequestRecord(request_id=str(i), arrival_s=0.0, prompt_len=4, max_tokens=4,
                             first_token_s=0.1, finish_s=0.4, status="FINISHED_LENGTH_CAPPED",
                             finish_reason="length", output_len=4,
                             token_times_s=[0.1, 0.3, 0.4][: 2 + i]) for i in range(2)]
    summary = latency_summary(records)
    assert (summary["output_tokens"], summary["chunks"]) == (8, 5)
    assert cpu_per_output({"api_server": 0.0004, "engine": 0.0008, "wall": 9.0}, summary) == {
        "api_server_per_token": 50.0, "api_server_per_chunk": 80.0,
        "engine_per_token": 100.0, "engine_per_chunk": 160.0}
    assert cpu_per_output({"client": 0.0008, "client_parse": 0.0004}, summary) == {
        "client_per_token": 100.0, "client_per_chunk": 160.0,
        "client_parse_per_token": 50.0, "client_parse_per_chunk": 80.0}
    assert cpu_per_output({}, summary) == {} and cpu_per_output({"engine": 1.0}, {}) == {}


def test_added_ttft_per_request_pairs_each_request_with_its_twin() -> None:
    """Server TTFT minus the simulated TTFT of the same request id, over requests completed
    on both sides (an aborted one and one the twin lacks are left out), in ms."""
    from backends.bench.serve_load import added_ttft_per_request
    from runtime.records import RequestRecord

    def record(rid: str, arrival: float, first: float | None,
               status: str = "FINISHED_LENGTH_CAPPED") -> RequestRecord:
        return RequestRecord(request_id=rid, arrival_s=arrival, prompt_len=4, max_tokens=2,
                             first_token_s=first, finish_s=None if first is None else first,
                             status=status, finish_reason="length", output_len=2,
                             token_times_s=[] if first is None else [first])

    server = [record("a", 0.0, 0.012), record("b", 1.0, 1.030), record("c", 2.0, 2.050),
              record("d", 3.0, None, "FINISHED_ABORTED"), record("e", 4.0, 4.5)]
    simulated = [record("a", 0.0, 0.010), record("b", 1.0, 1.010), record("c", 2.0, 2.020),
                 record("d", 3.0, 3.010)]
    added = added_ttft_per_request(server, simulated)  # +2, +20, +30 ms
    assert added["p50"] == 20.0 and added["mean"] == 17.333
    assert math.isnan(added_ttft_per_request(server[3:], simulated[:3])["p50"])  # no pair


def test_engine_nice_is_checked_and_handed_to_the_load() -> None:
    server = SimulatedServer("py", "llama-3.1-8b", "h200", None, 0, 4096, None)
    config = server.load_config(ServeLoadFlags(), ServeBenchFlags(engine_nice=-10), 500)
    assert config.engine_nice == -10
    assert server.load_config(ServeLoadFlags(), ServeBenchFlags(), 500).engine_nice is None
    for bad in (-21, 20):
        with pytest.raises(ValueError, match=rf"^--engine-nice must be in \[-20, 19\], "
                                             rf"got {bad}$"):
            ServeBenchFlags(engine_nice=bad)


class _Served:
    """A stand-in for `ServerProcess`: its own pid as the API server's, `engine` as the
    engine's."""

    def __init__(self, engine: int) -> None:
        self.proc = subprocess.Popen(["true"])  # only its pid is read
        self.proc.wait()
        self.engine = engine

    def engine_pid(self) -> int:
        return self.engine


def test_server_pids_sets_the_nice_value_of_every_engine_thread() -> None:
    from backends.bench.serve_load import LoadConfig, server_pids

    child = subprocess.Popen([sys.executable, "-c", "import threading, time; threading.Thread("
                              "target=time.sleep, args=(30,)).start(); time.sleep(30)"])
    try:
        task_dir = f"/proc/{child.pid}/task"
        deadline = time.monotonic() + 10
        while len(os.listdir(task_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the second thread, running before the renice as ZeroMQ's is
        threads = [int(tid) for tid in os.listdir(task_dir)]
        assert len(threads) == 2
        served = _Served(child.pid)
        config = LoadConfig(("py",), engine_nice=min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7))
        pids = server_pids(served, config)  # type: ignore[arg-type]
        assert pids == {"api_server": served.proc.pid, "engine": child.pid}
        assert [os.getpriority(os.PRIO_PROCESS, tid) for tid in threads] == [config.engine_nice] * 2
        untouched = os.getpriority(os.PRIO_PROCESS, 0)
        server_pids(served, LoadConfig(("py",)))  # type: ignore[arg-type]
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == config.engine_nice
        assert os.getpriority(os.PRIO_PROCESS, 0) == untouched
    finally:
        child.kill()
        child.wait(10)
    with open("/proc/sys/kernel/pid_max") as f:
        gone = _Served(int(f.read()) + 1)  # above pid_max: never a live process
    with pytest.raises(RuntimeError, match=r"^--engine-nice 5: No such process \(a value "
                                           r"below 0 needs root or CAP_SYS_NICE\)$"):
        server_pids(gone, LoadConfig(("py",), engine_nice=5))  # type: ignore[arg-type]


def test_the_load_client_runs_on_uvloop_when_it_imports() -> None:
    from backends.bench.sse_client import run_client

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    try:
        import uvloop  # noqa: F401
    except ImportError:
        assert run_client(loop_module()).startswith("asyncio")
    else:
        assert run_client(loop_module()).startswith("uvloop")


def test_cpu_seconds_of_the_main_thread_and_of_all_threads() -> None:
    """A child whose second thread spins for 0.3 CPU s, then sleeps: the threads' CPU is
    the main thread's and at least that."""
    from backends.bench.serve_load import cpu_seconds

    child = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                              "def spin():\n    end = time.thread_time() + 0.3\n"
                              "    while time.thread_time() < end: pass\n"
                              "    time.sleep(30)\n"
                              "threading.Thread(target=spin).start(); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        stats = cpu_seconds({"engine": child.pid})
        while stats["engine_threads"] - stats["engine"] < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = cpu_seconds({"engine": child.pid})
        names = {"wall", "engine", "engine_runqueue", "engine_threads",
                 "engine_threads_runqueue", "client", "client_runqueue", "client_threads",
                 "client_threads_runqueue"}
        assert set(stats) == names
        assert stats["engine_threads"] - stats["engine"] >= 0.3
    finally:
        child.kill()
        child.wait(10)
    assert cpu_seconds({"engine": child.pid}) == {}  # gone: nothing to read
