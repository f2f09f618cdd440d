"""Pre-routing: when no router reads snapshots, completions or token ids, the fleet routes
the whole trace first and each replica runs its share to the end in turn. The records are
those of routing at each arrival with the replicas in lock-step (randomised traces, mixed
pools, routing latency, several routers, prompts only some replicas can hold), and one
replica's are the single engine's on its share exactly, idle gaps included."""

from __future__ import annotations

import dataclasses
import gc
from types import GeneratorType

import numpy as np
import pytest

import workloads
from runtime import CacheConfig, KVCacheBlock, KVCacheManager, SchedulerConfig
from runtime.router import make_policy
from sim import fleet as fleet_module
from sim.api_server import handover_times, server_wakes
from sim.fleet import FleetResult, simulate_fleet
from sim.fleet_replica import PreRoutedReplica
from sim.simulator import SimConfig, simulate
from sim.step_noise import StepNoise
from tests.sim.fleet_support import COST, FIXTURES, Replica
from workloads import ArrivalProcess, MultiTurn, RandomLengths, Trace, TraceRequest


def config(num_blocks: int, fast_forward: bool = True, noise: StepNoise | None = None
           ) -> SimConfig:
    return SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16,
                                  max_model_len=16384),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks), fast_forward=fast_forward,
        step_noise=noise)


def randomised(seed: int) -> Trace:
    """Lengths, rate and burstiness drawn from `seed` (idle gaps and queues both occur)."""
    rate = (20.0, 60.0, 200.0)[seed % 3]
    arrivals = ArrivalProcess(request_rate=rate, burstiness=(0.3, 1.0, 4.0)[seed % 3 - 1],
                              seed=seed)
    if seed % 4 == 3:
        turns = MultiTurn(num_turns=3, turn_gap_s=0.05, lengths=RandomLengths(96, 40, 0.9))
        return workloads.multi_turn_trace(40, turns, arrivals)
    lengths = RandomLengths(160 + 40 * seed, 60, range_ratio=0.9)
    return workloads.random_trace(150, lengths, arrivals)


def run(trace: Trace, policy: str, setups: list[Replica], ahead: bool, routers: int = 1,
        latency_s: float = 0.0, stack: dict[str, float] | None = None) -> FleetResult:
    """`ahead`: routing (and stepping) ahead allowed; `stack`: serving-stack delays."""
    saved = fleet_module._Fleet.routes_ahead
    fleet_module._Fleet.routes_ahead = ahead
    try:
        return simulate_fleet(trace, setups, [make_policy(policy, (), seed=5 + r)
                                              for r in range(routers)],
                              refresh_s=0.02, routing_latency_s=latency_s,
                              stack_delay_s=stack)
    finally:
        fleet_module._Fleet.routes_ahead = saved


def same(a: FleetResult, b: FleetResult) -> None:
    assert [r.to_row() for r in a.requests] == [r.to_row() for r in b.requests]
    assert a.step_columns == b.step_columns


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy", ["round-robin", "random", "session-hash"])
def test_pre_routed_equals_lock_step_on_random_traces(seed: int, policy: str) -> None:
    trace = randomised(seed)
    # a small pool (prompts it cannot hold go to the others) and a large one; step noise
    # (each replica its own seed) on odd seeds
    noise = StepNoise((0.7, 1.0, 1.6), seed=seed) if seed % 2 else None
    small = Replica(config(num_blocks=40 + 10 * seed, noise=noise))
    large = Replica(config(num_blocks=300, noise=noise))
    setups = [small, large, large][: 2 + seed % 2]
    latency = 0.002 * (seed % 3)
    routers = 1 + seed % 2
    lock_step = run(trace, policy, setups, ahead=False, routers=routers, latency_s=latency)
    same(run(trace, policy, setups, ahead=True, routers=routers, latency_s=latency), lock_step)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["round-robin", "random", "session-hash",
                                    "least-outstanding", "prefix-aware"])
def test_fast_paths_equal_lock_step_with_stack_delays(seed: int, policy: str) -> None:
    """With serving-stack delays (exponential, mean 1-50 ms: hand-overs out of routing
    order), pre-routing and stepping ahead keep the lock-step records."""
    trace = randomised(seed)
    rng = np.random.default_rng(seed)
    scale = (0.001, 0.01, 0.05)[seed % 3]
    stack = {r.request_id: float(rng.exponential(scale)) for r in trace}
    small, large = Replica(config(num_blocks=40 + 10 * seed)), Replica(config(num_blocks=300))
    setups = [small, large, large][: 2 + seed % 2]
    routers, latency = 1 + seed % 2, 0.002 * (seed % 3)
    same(run(trace, policy, setups, True, routers, latency, stack),
         run(trace, policy, setups, False, routers, latency, stack))


def test_pre_routed_equals_stepping_one_by_one() -> None:
    trace = workloads.load_trace(FIXTURES / "mooncake_conversation_first300.jsonl").trace
    trace = Trace(trace.requests[:120])
    stepped = [Replica(config(num_blocks=300, fast_forward=False))] * 3
    lock_step = run(trace, "round-robin", stepped, ahead=False, latency_s=0.001)
    fast = [dataclasses.replace(s, config=config(num_blocks=300)) for s in stepped]
    same(run(trace, "round-robin", fast, ahead=True, latency_s=0.001), lock_step)


@pytest.mark.parametrize(("policy", "expected"), [
    ("round-robin", True), ("session-hash", True), ("prefix-aware", False),
    ("llm-d", False), ("least-outstanding", False),
])
def test_only_blind_routers_pre_route(policy: str, expected: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Pre-routed replicas run one after another: each replica's steps are contiguous."""
    order: list[int] = []
    one_step = PreRoutedReplica.one_step

    def logged(self: PreRoutedReplica, clock: float) -> tuple[float, dict[str, list[int]]]:
        order.append(self.index)
        return one_step(self, clock)

    monkeypatch.setattr(PreRoutedReplica, "one_step", logged)
    result = run(randomised(1), policy, [Replica(config(num_blocks=300))] * 3, ahead=True)
    assert len(result.requests) == 150
    assert bool(order) is expected
    if expected:
        assert order == sorted(order) and set(order) == {0, 1, 2}


def idle_gap(cfg: SimConfig) -> Trace:
    """Two requests, the second handed over after an idle gap at an h where a server process
    sleeping since the first hand-over h0 wakes at h0 + (h - h0) != h (the reviewer's case)."""
    first = TraceRequest(request_id="0", arrival_s=0.0094916295266587, prompt_len=100,
                         output_len=4)
    cost = cfg.api_server.time(100)
    h0 = first.arrival_s + cost
    arrival = next(b - cost for b in (0.05 + k * 1e-6 for k in range(10**7))
                   if h0 + (b - h0) != b and (b - cost) + cost == b)
    trace = Trace((first, TraceRequest(request_id="1", arrival_s=arrival, prompt_len=100,
                                       output_len=4)))
    handovers = handover_times(trace, cfg.api_server)
    assert server_wakes(handovers) != handovers  # the case: w != h at request 1
    return trace


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["round-robin", "random", "session-hash"])
def test_pre_routed_replica_is_one_engine_on_its_share(seed: int, policy: str) -> None:
    """A pre-routed replica is the single-engine simulator on its share, arrivals shifted
    by the routing latency (the fleet times rows from the trace arrival)."""
    cfg = config(num_blocks=60 + 40 * seed)
    one_engine_per_share(randomised(seed), cfg, policy, 3, latency_s=0.002 * (seed % 2))


@pytest.mark.parametrize("policy", ["round-robin", "random", "session-hash"])
def test_pre_routed_replica_is_one_engine_after_an_idle_gap(policy: str) -> None:
    """Exactly, also where the single engine takes a request in at a sleeping server's wake
    that is not the hand-over time."""
    cfg = config(num_blocks=300)
    one_engine_per_share(idle_gap(cfg), cfg, policy, 1, latency_s=0.0)


def one_engine_per_share(trace: Trace, cfg: SimConfig, policy: str, replicas: int,
                         latency_s: float) -> None:
    """Each of `replicas` pre-routed replicas' rows are `simulate`'s on its share."""
    result = run(trace, policy, [Replica(cfg)] * replicas, ahead=True, latency_s=latency_s)
    for index in range(replicas):
        share = Trace(tuple(dataclasses.replace(req, arrival_s=req.arrival_s + latency_s)
                            for req in trace
                            if result.requests[trace.requests.index(req)].replica == index))
        alone = simulate(share, cfg, COST)
        rows = [r.to_row() for r in result.requests if r.replica == index]
        for row, expected in zip(rows, alone.requests, strict=True):
            assert row.pop("replica") == index
            assert row.pop("routing_s") == (row["arrival_s"] + latency_s) - row["arrival_s"]
            row["arrival_s"] += latency_s
            assert row == expected.to_row()


def test_pre_routed_replicas_hand_their_blocks_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each replica releases its pool when its share is done, and the next one makes its
    never-used blocks of those: the fleet makes only as many block objects as its largest
    share needs (the records are lock-step's: the tests above)."""
    released: list[tuple[int, list[int]]] = []  # (blocks made, their objects' ids) per call
    release = KVCacheManager.release_blocks

    def logged(self: KVCacheManager) -> list[KVCacheBlock]:
        blocks = release(self)
        released.append((len(blocks), [id(b) for b in blocks]))
        return blocks

    monkeypatch.setattr(KVCacheManager, "release_blocks", logged)
    result = run(randomised(1), "round-robin", [Replica(config(num_blocks=300))] * 3,
                 ahead=True)
    assert len(result.requests) == 150 and len(released) == 3
    made = [count for count, _ in released]
    assert min(made) > 0 and len({i for _, objects in released for i in objects}) == max(made)


@pytest.mark.parametrize("policy", ["round-robin", "random", "session-hash"])
def test_pre_routed_policy_hears_every_first_token_and_finish(policy: str) -> None:
    heard: list[tuple[str, str]] = []
    router = make_policy(policy, (), seed=5)
    router.on_prefill_done = lambda rid: heard.append(("first", rid))  # type: ignore[method-assign]
    finished = router.on_finished
    router.on_finished = lambda rid: (heard.append(("done", rid)), finished(rid))  # type: ignore[method-assign]
    trace = randomised(2)
    result = simulate_fleet(trace, [Replica(config(num_blocks=300))] * 3, router)
    ids = [r.request_id for r in result.requests]
    assert sorted(rid for kind, rid in heard if kind == "first") == sorted(ids)
    done = [rid for kind, rid in heard if kind == "done"]
    assert sorted(done) == sorted(ids)
    for rid in ids:  # its first token before its finish
        assert heard.index(("first", rid)) < heard.index(("done", rid))
    assert not router.local.in_flight


def test_pre_routed_replicas_append_to_one_set_of_step_columns() -> None:
    """The replicas run one after another, each recording its steps after the rows of
    those before it in the fleet's one set of step columns, which the result takes as it
    is (no join); each replica's rows are the single engine's steps on its share."""
    trace, cfg = randomised(1), config(num_blocks=300)
    fleet = fleet_module._Fleet(trace, [Replica(cfg)] * 3, make_policy("round-robin", (), 5),
                                0.02, 0.0, None)
    fleet.run()
    result = fleet.result(0.0)
    recorders = [replica.core.recorder for replica in fleet.replicas]
    counts = [recorder.num_steps for recorder in recorders]
    assert [recorder.first_row for recorder in recorders] == [0, counts[0], sum(counts[:2])]
    assert all(recorder.step_columns is fleet.step_columns for recorder in recorders)
    columns = result.step_columns
    assert all(columns[name] is fleet.step_columns[name] for name in fleet.step_columns)
    assert list(columns["replica"]) == [0] * counts[0] + [1] * counts[1] + [2] * counts[2]
    starts = [0, counts[0], counts[0] + counts[1]]
    assert [columns["step"][row] for row in starts] == [0, 0, 0]
    for index, recorder in enumerate(recorders):
        share = Trace(tuple(req for req, record in zip(trace, result.requests, strict=True)
                            if record.replica == index))
        assert recorder.steps == simulate(share, cfg, COST).steps


def test_a_done_replica_keeps_no_released_blocks() -> None:
    """A replica whose share is done waits to the end in `wait_for_work`, its frame
    suspended: the blocks it released are the fleet's spares only, not a local of that
    frame too (young collections walked a ~25k-block list per replica at 64 replicas)."""
    fleet = fleet_module._Fleet(randomised(1), [Replica(config(num_blocks=300))] * 3,
                                make_policy("round-robin", (), 5), 0.02, 0.0, None)
    fleet.run()
    frames = [g.gi_frame for replica in fleet.replicas for g in gc.get_referrers(replica)
              if isinstance(g, GeneratorType)]
    assert sorted(frame.f_code.co_name for frame in frames) == [  # 2 of each a replica:
        "engine"] * 6 + ["wait_for_work"] * 6  # its own and EngineProcess's
    held = [value for frame in frames for value in frame.f_locals.values()
            if isinstance(value, list) and value and isinstance(value[0], KVCacheBlock)]
    assert held == [] and len(fleet.spare_blocks) > 0


def test_one_pre_routed_replica_holds_the_spares_at_a_time() -> None:
    """A released spare and a block in use both have one reference: a second pool making
    blocks of the spares while another holds them would share blocks unnoticed, so a
    replica takes them in `engine()` only once the one before has handed its blocks on."""
    fleet = fleet_module._Fleet(randomised(1), [Replica(config(num_blocks=300))] * 2,
                                make_policy("round-robin", (), 5), 0.02, 0.0, None)
    first, second = fleet.replicas
    assert isinstance(first, PreRoutedReplica) and isinstance(second, PreRoutedReplica)
    next(first.engine())  # nothing routed: its share is done at once, the spares go back
    assert fleet.spare_holder is None
    fleet.spare_holder = 0  # as while replica 0 runs its share
    with pytest.raises(AssertionError, match="replica 1 started while replica 0 still holds"):
        next(second.engine())


def test_pre_routed_fleet_gives_the_spares_back() -> None:
    fleet = fleet_module._Fleet(randomised(2), [Replica(config(num_blocks=300))] * 3,
                                make_policy("round-robin", (), 5), 0.02, 0.0, None)
    fleet.run()
    assert fleet.spare_holder is None and len(fleet.spare_blocks) == 299
