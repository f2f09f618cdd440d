"""A pre-routed fleet's replicas in worker processes (`simulate_fleet(workers=N)`,
`--sim-workers`): the records are those of one process exactly, whatever the number of
workers; a fleet whose routers read the replicas runs in one process; a worker's error
reaches the caller as itself, a killed worker as one line, and no worker outlives the call."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import select
import signal
import time
from collections.abc import Callable
from typing import Any

import pandas as pd
import pytest

import workloads
from runtime.records import RequestRecord, StepTimes
from runtime.router import make_policy
from sim import fleet as fleet_module
from sim import fleet_workers
from sim.cost.api_server import ApiServerCost
from sim.fleet import FleetResult, simulate_fleet
from sim.fleet_records import ReplicaOutcome
from sim.fleet_workers import run_forked, worker_ranges
from sim.record_columns import RecordColumns
from sim.step_noise import StepNoise
from tests.sim.fleet_support import FIXTURES, Replica
from tests.sim.test_fleet_prerouted import config, randomised
from workloads import Trace


def fleet(trace: Trace, policy: str, setups: list[Replica], workers: int,
          routers: int = 1, progress: Callable[[int, int], None] | None = None
          ) -> FleetResult:
    return simulate_fleet(trace, setups, [make_policy(policy, (), seed=5 + r)
                                          for r in range(routers)],
                          refresh_s=0.02, routing_latency_s=0.001, progress=progress,
                          workers=workers)


def equal(a: FleetResult, b: FleetResult) -> None:
    """Request and step frames, summaries and per-replica totals: exactly equal."""
    assert pd.DataFrame([r.to_row() for r in a.requests]).equals(
        pd.DataFrame([r.to_row() for r in b.requests]))
    assert pd.DataFrame(dict(a.step_columns)).equals(pd.DataFrame(dict(b.step_columns)))
    assert dataclasses.replace(a.summary(), wall_s=0) == dataclasses.replace(b.summary(),
                                                                              wall_s=0)
    assert a.replicas == b.replicas


def uneven(seed: int) -> list[Replica]:
    """Four replicas of two sizes (prompts the small ones cannot hold go to the large: the
    shares are uneven), an output cost on one (client times shifted per replica); step
    noise (each replica its own seed) on seed 3."""
    noise = StepNoise((0.7, 1.0, 1.6), seed=seed) if seed == 3 else None
    small = Replica(config(num_blocks=40 + 10 * seed, noise=noise))
    large = Replica(config(num_blocks=300, noise=noise))
    slow_out = Replica(dataclasses.replace(
        config(num_blocks=300, noise=noise), api_server=ApiServerCost(per_output_token_s=2e-5)))
    return [small, large, small, slow_out]


def test_worker_ranges_balance_requests() -> None:
    assert worker_ranges([10] * 16, 2) == [range(0, 8), range(8, 16)]
    assert worker_ranges([1, 1, 1, 10], 2) == [range(0, 3), range(3, 4)]
    assert worker_ranges([6, 1, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 7)]
    # a tie between two cuts goes to the earlier one
    assert worker_ranges([4, 4, 4, 4, 4, 4], 4) == [range(0, 1), range(1, 3), range(3, 4),
                                                    range(4, 6)]
    assert worker_ranges([5, 5, 5], 8) == [range(0, 1), range(1, 2), range(2, 3)]
    assert worker_ranges([0, 0, 0, 0], 2) == [range(0, 2), range(2, 4)]
    assert worker_ranges([3, 9], 1) == [range(0, 2)]
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        worker_ranges([1], 0)


@pytest.mark.parametrize("policy", ["round-robin", "random", "session-hash"])
@pytest.mark.parametrize("seed", [1, 3])
def test_workers_give_the_records_of_one_process(policy: str, seed: int) -> None:
    trace = randomised(seed)  # seed 3: multi-turn sessions
    setups = uneven(seed)
    one = fleet(trace, policy, setups, workers=1, routers=1 + seed // 2)
    assert len({r.replica for r in one.requests}) == 4
    for workers in (2, 3, 9):  # 9: more workers than replicas
        equal(fleet(trace, policy, setups, workers, routers=1 + seed // 2), one)
    assert not multiprocessing.active_children()


def test_workers_on_hash_id_prompts_keep_prefix_hits() -> None:
    """Block identities (`sim.block_ids`) are numbered in each worker's own order: the
    records, prefix hits included, are those of one process."""
    trace = Trace(workloads.load_trace(
        FIXTURES / "mooncake_conversation_first300.jsonl").trace.requests[:120])
    setups = [Replica(config(num_blocks=400))] * 4
    one = fleet(trace, "session-hash", setups, workers=1)
    assert one.prefix_cache_hits > 0
    equal(fleet(trace, "session-hash", setups, workers=2), one)


def test_progress_is_reported_as_workers_end() -> None:
    trace = randomised(1)
    seen: list[tuple[int, int]] = []
    fleet(trace, "round-robin", uneven(1), 2, progress=lambda done, n: seen.append((done, n)))
    assert len(seen) == 2 and seen[-1] == (len(trace), len(trace))
    assert 0 < seen[0][0] < len(trace)


@pytest.mark.parametrize("policy", ["llm-d", "vllm-dp"])  # snapshots (llm-d: KV use too)
def test_routers_reading_replicas_run_in_one_process(policy: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Routers reading snapshots run in one process (those reading only completions run in
    lockstep: tests/sim/test_fleet_lockstep.py)."""
    def no_fork(*args: object, **kwargs: object) -> None:
        raise AssertionError("forked a fleet that reads snapshots")

    trace, setups = randomised(1), uneven(1)
    one = fleet(trace, policy, setups, workers=1)
    monkeypatch.setattr(fleet_module, "run_forked", no_fork)
    monkeypatch.setattr(fleet_module, "run_lockstep", no_fork)
    equal(fleet(trace, policy, setups, workers=2), one)


def _raise_in_worker(error: BaseException) -> Callable[..., object]:
    def outcome(self: object, replicas: object) -> object:
        raise error
    return outcome


class _Unpicklable(Exception):
    def __init__(self, message: str, extra: object) -> None:
        super().__init__(message)
        self.extra = extra

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("cannot pickle this")


@pytest.mark.parametrize(("error", "kind", "message"), [
    (ValueError("stack_delay_s['7'] must be >= 0, got -1"), ValueError,
     "stack_delay_s['7'] must be >= 0, got -1"),
    (AssertionError("3 requests never finished"), AssertionError, "3 requests never finished"),
    (_Unpicklable("odd one", extra=lambda: 0), RuntimeError, "_Unpicklable: odd one"),
])
def test_a_worker_error_reaches_the_caller(error: BaseException, kind: type[BaseException],
                                           message: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_module._Fleet, "outcome", _raise_in_worker(error))
    with pytest.raises(kind) as raised:
        fleet(randomised(1), "round-robin", uneven(1), workers=2)
    assert str(raised.value) == message  # what the CLI prints of a ValueError: one line
    assert any("in a simulation worker" in note for note in raised.value.__notes__)
    assert not multiprocessing.active_children()


def killed_when(method: Callable[..., Any], when: Callable[..., bool]) -> Callable[..., Any]:
    """`method`, its process SIGKILLed first when `when(self, *args)`: a worker dying mid-run
    without a word (no result, no error)."""
    def call(self: object, *args: object) -> Any:
        if when(self, *args):
            os.kill(os.getpid(), signal.SIGKILL)
        return method(self, *args)
    return call


def test_a_killed_worker_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_module._Fleet, "run_range", killed_when(
        fleet_module._Fleet.run_range, lambda _, replicas: replicas.start == 0))
    with pytest.raises(ChildProcessError) as raised:
        fleet(randomised(1), "round-robin", uneven(1), workers=2)
    assert str(raised.value) == ("simulation worker 0 (replicas 0-1) was killed by SIGKILL "
                                 "before sending its records")
    assert not multiprocessing.active_children()


def test_an_interrupt_ends_every_worker() -> None:
    """Ctrl-C in the parent while a worker runs (here: raised as the first result arrives):
    the other worker is ended, not waited for (it would sleep a minute)."""
    def interrupt(i: int, result: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_forked([lambda: 1, lambda: time.sleep(60)], interrupt)
    assert not multiprocessing.active_children()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_an_interrupt_leaves_no_descriptor_open() -> None:
    """Not even while the caller holds the error, whose traceback holds `run_forked`'s frame
    (each child's `Process` kept 2 pipe ends open until collected)."""
    def interrupt(i: int, result: object) -> None:
        raise KeyboardInterrupt

    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(KeyboardInterrupt) as raised:
        run_forked([lambda: 1, lambda: time.sleep(60), lambda: time.sleep(60)], interrupt)
    assert sorted(os.listdir("/proc/self/fd")) == before
    assert raised.value.__traceback__ is not None


def test_results_come_back_in_task_order() -> None:
    arrived: list[int] = []
    results = run_forked([lambda: (time.sleep(0.2), "slow")[1], lambda: "fast"],
                         lambda i, _: arrived.append(i))
    assert results == ["slow", "fast"]
    assert sorted(arrived) == [0, 1]


def test_results_are_taken_as_they_arrive() -> None:
    """Worker 0 cannot finish before worker 1's result has been taken (`on_result(1)`
    releases it through a pipe), so only a parent that takes results in arrival order (it
    waits on every result pipe's descriptor at once) sees it released; one that read the
    pipes in task order would wait on worker 0 until its minute ran out."""
    release, releaser = os.pipe()

    def first() -> str:
        ready, _, _ = select.select([release], [], [], 60.0)
        return "released" if ready else "never released"

    arrived: list[int] = []

    def on_result(i: int, _: object) -> None:
        arrived.append(i)
        if i == 1:
            os.write(releaser, b"x")

    try:
        results = run_forked([first, lambda: "second"], on_result)
    finally:
        os.close(release)
        os.close(releaser)
    assert results == ["released", "second"]
    assert arrived == [1, 0]


def test_without_fork_the_fleet_runs_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    trace, setups = randomised(1), uneven(1)
    one = fleet(trace, "round-robin", setups, workers=1)
    monkeypatch.setattr(fleet_module, "can_fork", lambda: False)
    monkeypatch.setattr(fleet_module, "run_forked", None)
    equal(fleet(trace, "round-robin", setups, workers=2), one)
    assert fleet_workers.can_fork()  # Linux, where these tests run


def test_zero_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="^workers must be >= 1, got 0$"):
        fleet(randomised(1), "round-robin", uneven(1), workers=0)


def test_outcomes_cross_a_pipe_as_columns_and_come_back_equal() -> None:
    """`ReplicaOutcome` pickles its records as columns (`sim.record_columns`): the same
    classes and values back, token times over the step columns that travel with them."""
    result = fleet(randomised(1), "round-robin", uneven(1), workers=1)
    plain = [r for r in result.requests if r.replica == 1]  # StepTimes token times
    shifted = [r for r in result.requests if r.replica == 3]  # arrays: an output cost
    assert isinstance(plain[0].token_times_s, StepTimes)
    assert not isinstance(shifted[0].token_times_s, StepTimes)
    for records in (plain, shifted, [*plain, RequestRecord("x", 0.0, 1, 1)]):
        outcome = ReplicaOutcome(1, records, 7, 3, 2)
        columns = RecordColumns.of(records)
        assert (columns is None) is (len({type(r) for r in records}) > 1)
        back, steps = pickle.loads(pickle.dumps((outcome, result.step_columns)))
        assert back == outcome and [type(r) for r in back.records] == [type(r) for r in records]
        assert [r.to_row() for r in back.records] == [r.to_row() for r in records]
        if records is plain:
            assert columns is not None and columns.times is not None
            assert all(r.token_times_s.ends is steps["end_s"] for r in back.records)


def test_a_result_that_does_not_pickle_is_one_line() -> None:
    """A bug, not a user's error: the worker exits with its traceback on stderr, the
    caller gets one line naming it (the result streams as it is pickled, so nothing else
    can be sent once part of it is written)."""
    with pytest.raises(ChildProcessError) as raised:
        run_forked([lambda: 1, lambda: (1, lambda: 2)], names=["a", "b"])
    assert str(raised.value) == "simulation b exited with status 1 before sending its records"
    assert not multiprocessing.active_children()


_ORPHANS = """
import os, sys, time
from sim.fleet_workers import run_forked
def report():
    os.write(1, f"{os.getpid()}\\n".encode())  # one write: the two workers' lines never mix
    time.sleep(60)
run_forked([report, report])
"""


@pytest.mark.parametrize("kill", [signal.SIGTERM, signal.SIGKILL])
def test_no_worker_outlives_its_parent(kill: signal.Signals) -> None:
    """A parent ended by a signal it does not catch (a supervisor's SIGTERM, SIGKILL) once
    left its workers blocked on a pipe nobody read, forever."""
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", _ORPHANS], stdout=subprocess.PIPE,
                              text=True, cwd=os.getcwd(),
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert parent.stdout is not None
    # a blank line was read here twice under load (with print(): its text and newline
    # can leave as two writes): each pid is one write now, and blank lines are skipped
    lines = (line for line in iter(parent.stdout.readline, "") if line.strip())
    workers = [int(next(lines)) for _ in range(2)]
    parent.send_signal(kill)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    alive = workers
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if _running(pid)]
    for pid in alive:  # a failing run leaves none behind either
        os.kill(pid, signal.SIGKILL)
    assert alive == [], f"workers {alive} outlived their parent"


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not a zombie awaiting its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
