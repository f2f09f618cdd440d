"""P/D disaggregation in the fleet simulator: transfer times by hand, link sharing, the
deciders, a disaggregated request's token times, attribution summing to E2E, and the
decider `never` reproducing the plain fleet run."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import pytest
import simpy

from runtime import BatchFeatures, CacheConfig, SchedulerConfig
from runtime.records import PART_COLUMNS, QUEUE_COLUMNS
from runtime.router import make_policy
from sim.cost.api_server import ApiServerCost
from sim.cost.base import CostModel
from sim.cost.roofline import RooflineCostModel
from sim.fleet import simulate_fleet
from sim.fleet_config import parse_fleet
from sim.fleet_records import PD_REQUEST_COLUMNS, FleetResult, PDRequestRecord
from sim.hardware import resolve_gpu
from sim.kv_transfer import GB, KvTransferConfig, KvTransferLink, transfer_bytes
from sim.model_config import ModelSpec
from sim.model_presets import resolve_model
from sim.pd import PDDecider, simulate_pd
from sim.pd_flags import PDFlags
from sim.simulator import SimConfig
from tests.sim.test_fleet import TRACES, Watched
from workloads import Trace, TraceRequest

MODEL = resolve_model("llama-3.1-8b")
COST = RooflineCostModel(MODEL, resolve_gpu("h200"))
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
NO_API = ApiServerCost(per_request_s=0.0, per_prompt_token_s=0.0)


@dataclass(frozen=True)
class Replica:
    config: SimConfig
    cost_model: CostModel = COST
    model: ModelSpec = MODEL


def config(num_blocks: int = 3000, max_num_seqs: int = 32, budget: int = 1024,
           api: ApiServerCost | None = None, check_invariants: bool = True) -> SimConfig:
    return SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  max_model_len=16384),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        api_server=api if api is not None else ApiServerCost(),
        check_invariants=check_invariants)


def test_kv_bytes_per_token_of_the_model() -> None:
    assert MODEL.kv_bytes_per_token == KV_PER_TOKEN == 131_072


# ---- transfers -------------------------------------------------------------------------------


def test_transfer_bytes_are_the_blocks_the_receiver_lacks() -> None:
    # 100 tokens = 7 blocks of 16 (the last partial); 40 cached tokens = 2 whole blocks
    assert transfer_bytes(100, 40, 16, KV_PER_TOKEN) == 5 * 16 * 131_072
    assert transfer_bytes(100, 0, 16, 10) == 7 * 16 * 10
    assert transfer_bytes(16, 0, 16, 10) == 160


def run_transfers(config: KvTransferConfig,
                  starts: list[tuple[float, float]]) -> list[float]:
    """End times of transfers (start_s, bytes) on one link."""
    env = simpy.Environment()
    link = KvTransferLink(env, config)
    ends = [math.nan] * len(starts)

    def begin(i: int, num_bytes: float) -> None:
        link.start(num_bytes, lambda end_s: ends.__setitem__(i, end_s))

    for i, (start_s, num_bytes) in enumerate(starts):
        env.timeout(start_s).callbacks.append(lambda _, i=i, b=num_bytes: begin(i, b))
    env.run()
    return ends


def test_one_transfer_takes_latency_plus_bytes_over_bandwidth() -> None:
    cfg = KvTransferConfig()  # 25 GB/s, 0.05 ms
    num_bytes = 7 * 16 * KV_PER_TOKEN  # 14,680,064 bytes
    [end] = run_transfers(cfg, [(1.0, num_bytes)])
    assert end == pytest.approx(1.0 + 0.05e-3 + 14_680_064 / 25e9, abs=1e-12)
    assert end - 1.0 == pytest.approx(0.00063720256, abs=1e-12)
    assert run_transfers(cfg, [(0.5, 0)]) == [pytest.approx(0.5 + 0.05e-3, abs=1e-15)]


def test_two_transfers_share_the_link() -> None:
    cfg = KvTransferConfig(bandwidth_Bps=1 * GB, latency_s=0.0)
    # equal, together: each at half the bandwidth
    assert run_transfers(cfg, [(0.0, 1e9), (0.0, 1e9)]) == [pytest.approx(2.0)] * 2
    # A alone for 0.25 s (0.75e9 left), then halves: B's 0.5e9 take 1 s (ends 1.25), A then
    # has 0.25e9 left alone (ends 1.5): work-conserving, 1.5e9 bytes in 1.5 s
    a, b = run_transfers(cfg, [(0.0, 1e9), (0.25, 0.5e9)])
    assert (a, b) == (pytest.approx(1.5, abs=1e-12), pytest.approx(1.25, abs=1e-12))
    # the fixed latency takes no bandwidth: B joins the sharing 0.1 s after it starts
    lat = KvTransferConfig(bandwidth_Bps=1 * GB, latency_s=0.1)
    a, b = run_transfers(lat, [(0.0, 1e9), (0.15, 0.5e9)])
    # A moves alone 0.1..0.25 (0.85e9 left); shared from 0.25: B ends 1.25, A 0.35e9 left
    assert (a, b) == (pytest.approx(1.6, abs=1e-12), pytest.approx(1.25, abs=1e-12))


def test_transfer_config_checks() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        KvTransferConfig(bandwidth_Bps=0)
    with pytest.raises(ValueError, match="latency"):
        KvTransferConfig(latency_s=-1)


# ---- deciders ---------------------------------------------------------------------------------


def test_deciders_by_hand() -> None:
    threshold = PDDecider("prefix-threshold", 16)
    assert threshold.disaggregate(100, 84)  # 16 uncached >= 16
    assert not threshold.disaggregate(100, 85)
    assert not threshold.disaggregate(15, 0)
    assert PDDecider("always").disaggregate(1, 1)
    assert not PDDecider("never").disaggregate(10_000, 0)
    with pytest.raises(ValueError, match="decider"):
        PDDecider("sometimes")
    with pytest.raises(ValueError, match="threshold"):
        PDDecider("prefix-threshold", -1)


def prompt(start: int, length: int) -> tuple[int, ...]:
    return tuple(range(start, start + length))


def test_prefix_threshold_disaggregates_what_the_decode_replica_lacks() -> None:
    shared = prompt(1000, 96)  # 6 blocks
    trace = Trace([
        # nothing cached on the decode replica: disaggregated
        TraceRequest("a", 0.0, 100, 4, prompt_token_ids=shared + prompt(5000, 4)),
        # 96 of 110 cached there after "a" (6 blocks): 14 uncached < 16: decoded in place
        TraceRequest("b", 1.0, 110, 4, prompt_token_ids=shared + prompt(6000, 14)),
        # 96 of 112 cached: 16 uncached: disaggregated, 1 block of 7 to move
        TraceRequest("c", 2.0, 112, 4, prompt_token_ids=shared + prompt(7000, 16)),
    ])
    replicas = [Replica(config()), Replica(config())]
    result = simulate_pd(trace, replicas, ["prefill", "decode"], make_policy("round-robin"),
                         make_policy("round-robin"), PDDecider("prefix-threshold", 16))
    a, b, c = result.requests
    assert isinstance(a, PDRequestRecord)
    assert (a.prefill_replica, a.replica) == (0, 1)
    assert (b.prefill_replica, b.replica, b.kv_transfer_s) == (1, 1, 0.0)
    assert (c.prefill_replica, c.replica) == (0, 1)
    assert a.kv_transfer_bytes == 7 * 16 * KV_PER_TOKEN
    assert c.kv_transfer_bytes == 1 * 16 * KV_PER_TOKEN
    assert b.cached_tokens == 96


def test_never_with_prefill_pools_is_refused() -> None:
    with pytest.raises(ValueError, match="role prefill"):
        simulate_pd(Trace([TraceRequest("a", 0.0, 8, 2)]), [Replica(config())] * 2,
                    ["prefill", "decode"], make_policy("round-robin"))


# ---- a disaggregated request, by hand --------------------------------------------------------


def prefill_features(q: int, c: int) -> BatchFeatures:
    return BatchFeatures(num_prefill_tokens=q, num_seqs=1, num_prefill_seqs=1,
                         prefill_attention_pairs=q * c + q * (q + 1) // 2, prefill_kv_tokens=c + q)


def decode_features(context: int) -> BatchFeatures:
    return BatchFeatures(num_decode_tokens=1, num_seqs=1, decode_kv_tokens=context + 1)


def test_one_disaggregated_request_timeline() -> None:
    prompt_len, output_len = 1000, 5
    trace = Trace([TraceRequest("r", 0.25, prompt_len, output_len)])
    replicas = [Replica(config(api=NO_API, budget=2048)) for _ in range(2)]
    transfer = KvTransferConfig()
    result = simulate_pd(trace, replicas, ["prefill", "decode"], make_policy("round-robin"),
                         make_policy("round-robin"), PDDecider("always"), transfer)
    [r] = result.requests
    assert isinstance(r, PDRequestRecord)
    prefill = COST.step_time(prefill_features(prompt_len, 0))
    num_bytes = math.ceil(prompt_len / 16) * 16 * KV_PER_TOKEN  # 63 blocks
    moved = transfer.latency_s + num_bytes / transfer.bandwidth_Bps
    first = COST.step_time(prefill_features(1, prompt_len - 1))  # the last prompt token
    assert r.kv_transfer_bytes == num_bytes
    assert r.kv_transfer_s == pytest.approx(moved, abs=1e-12)
    assert r.first_token_s - r.arrival_s == pytest.approx(prefill + moved + first, abs=1e-12)
    times = [0.25 + prefill + moved + first]
    for k in range(output_len - 1):  # decodes read the prompt and k + 1 outputs
        times.append(times[-1] + COST.step_time(decode_features(prompt_len + k)))
    assert r.token_times_s == pytest.approx(times, abs=1e-12)
    assert r.finish_s == pytest.approx(times[-1], abs=1e-12)
    assert (r.prefill_s, r.decode_s) == (pytest.approx(prefill + first, abs=1e-12),
                                        pytest.approx(times[-1] - times[0], abs=1e-12))
    assert (r.output_len, r.status, r.prefill_replica, r.replica) == (
        output_len, "FINISHED_LENGTH_CAPPED", 0, 1)
    # the prefill replica ran one step of the whole prompt, the decode replica one step of
    # one token then decodes
    steps = result.step_columns
    mine = [(rep, p, d) for rep, p, d in zip(steps["replica"], steps["num_prefill_tokens"],
                                             steps["num_decode_tokens"], strict=True)]
    assert mine == [(0, prompt_len, 0), (1, 1, 0)] + [(1, 0, 1)] * (output_len - 1)


def test_two_transfers_on_one_link_in_a_fleet() -> None:
    trace = Trace([TraceRequest("a", 0.0, 512, 3), TraceRequest("b", 0.0, 512, 3)])
    replicas = [Replica(config(api=NO_API)) for _ in range(2)]
    transfer = KvTransferConfig()
    result = simulate_pd(trace, replicas, ["prefill", "decode"], make_policy("round-robin"),
                         make_policy("round-robin"), PDDecider("always"), transfer)
    a, b = result.requests
    num_bytes = 512 * KV_PER_TOKEN
    assert a.kv_transfer_bytes == b.kv_transfer_bytes == num_bytes
    shared = transfer.latency_s + 2 * num_bytes / transfer.bandwidth_Bps
    assert a.kv_transfer_s == b.kv_transfer_s == pytest.approx(shared, abs=1e-12)


def test_the_decode_side_orders_requests_as_its_api_server_received_them() -> None:
    # vLLM's decode instance stamps `arrival_time` as its API server takes the request from
    # the proxy: "b", prefilled first, is stamped before "a" and, "c" holding the only
    # sequence, is admitted first under the priority policy (the trace's arrivals, a before
    # b, are no decode server's stamps).
    def cfg(policy: str, seqs: int) -> SimConfig:
        return SimConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=seqs,
                                      max_model_len=16384, policy=policy),  # type: ignore[arg-type]
            cache=CacheConfig(block_size=16, num_blocks=3000), api_server=NO_API,
            check_invariants=True)

    trace = Trace([TraceRequest("c", 0.0, 16, 400), TraceRequest("a", 0.001, 4000, 2),
                   TraceRequest("b", 0.002, 16, 2)])
    replicas = [Replica(cfg("fcfs", 32)), Replica(cfg("fcfs", 32)), Replica(cfg("priority", 1))]
    result = simulate_pd(trace, replicas, ["prefill", "prefill", "decode"],
                         make_policy("round-robin"), make_policy("round-robin"),
                         PDDecider("always"))
    c, a, b = result.requests
    assert [(r.prefill_replica, r.replica) for r in (c, a, b)] == [(0, 2), (1, 2), (0, 2)]
    assert c.finish_s < b.first_token_s < a.first_token_s


# ---- whole runs ---------------------------------------------------------------------------


def check_pd_run(trace: Trace, result, roles: list[str], latency_s: float) -> None:
    assert [r.request_id for r in result.requests] == [r.request_id for r in trace]
    for r in result.requests:
        assert isinstance(r, PDRequestRecord)
        assert r.status.startswith("FINISHED"), r
        assert r.output_len == r.max_tokens and len(r.token_times_s) == r.output_len
        assert roles[r.replica] != "prefill"  # a decode replica may serve a request whole
        if r.prefill_replica != r.replica:
            assert roles[r.prefill_replica] != "decode" and r.kv_transfer_s > 0
        else:
            assert (r.kv_transfer_s, r.decode_queue_s) == (0.0, 0.0)
        parts = math.fsum([r.routing_s, r.kv_transfer_s,
                           *(getattr(r, c) for c in PART_COLUMNS)])
        assert parts == pytest.approx(r.finish_s - r.arrival_s, abs=1e-9)
        assert all(getattr(r, c) >= -1e-9 for c in PART_COLUMNS), r
        queued = math.fsum(getattr(r, c) for c in QUEUE_COLUMNS.values())
        assert r.prefill_queue_s + r.decode_queue_s == pytest.approx(queued, abs=1e-9)
        assert r.routing_s == pytest.approx(latency_s, abs=1e-12)
        assert r.first_token_s == r.token_times_s[0]


@pytest.mark.parametrize(("name", "roles", "decider"), [
    ("prefix", ["prefill", "decode", "both"], PDDecider("prefix-threshold", 48)),
    ("random", ["prefill", "prefill", "decode"], PDDecider("always")),
    ("multi_turn", ["both", "both", "both"], PDDecider("prefix-threshold", 16)),
])
def test_pd_runs_finish_every_request_with_parts_summing_to_e2e(
        name: str, roles: list[str], decider: PDDecider) -> None:
    trace = TRACES[name]
    replicas = [Replica(config(num_blocks=600, max_num_seqs=16)) for _ in roles]
    result = simulate_pd(trace, replicas, roles, make_policy("llm-d", seed=1),
                         make_policy("least-outstanding"), decider, routing_latency_s=0.002)
    check_pd_run(trace, result, roles, 0.002)
    split = sum(r.replica != r.prefill_replica for r in result.requests)
    assert 0 < split <= len(trace)


def test_each_router_hears_of_its_own_phase() -> None:
    trace = TRACES["prefix"]
    roles = ["prefill", "decode", "both"]
    replicas = [Replica(config(num_blocks=600, check_invariants=False)) for _ in roles]
    decode = Watched(make_policy("dynamo-kv", seed=2))
    prefill = Watched(make_policy("power-of-two", seed=2))
    result = simulate_pd(trace, replicas, roles, decode, prefill,
                         PDDecider("prefix-threshold", 48))
    split = {r.request_id for r in result.requests if r.prefill_replica != r.replica}
    assert 0 < len(split) < len(trace)
    # the decode router places (and hears the end of) every request, the prefill router
    # only the disaggregated ones, each to the replica the records name
    assert sorted(decode.finished) == sorted(decode.routed) == sorted(r.request_id for r in trace)
    assert sorted(prefill.finished) == sorted(prefill.routed) == sorted(split)
    for r in result.requests:
        assert decode.routed[r.request_id][0] == r.replica
        if r.request_id in split:
            assert prefill.routed[r.request_id][0] == r.prefill_replica
    assert not any(decode.local.count.values()) and not any(prefill.local.count.values())


def test_clients_see_tokens_through_the_decode_replicas_front_end() -> None:
    """With front-end output costs, token times are the decode replica's deliveries (its
    cost, n = the tokens its step delivered); the prefill replica's cost never reaches the
    client, and the engine side (steps) is unchanged."""
    trace = TRACES["random"]

    def run(prefill_cost: float, decode_cost: float) -> FleetResult:
        replicas = [Replica(config(num_blocks=600, check_invariants=False,
                                   api=ApiServerCost(per_output_token_s=cost)))
                    for cost in (prefill_cost, decode_cost)]
        return simulate_pd(trace, replicas, ["prefill", "decode"], make_policy("round-robin"),
                           make_policy("round-robin"), PDDecider("always"))

    engine, client = run(0.0, 0.0), run(3e-4, 2e-4)
    assert client.step_columns == engine.step_columns
    per_step = Counter(t for r in engine.requests for t in r.token_times_s)  # all on replica 1
    for mine, base in zip(client.requests, engine.requests, strict=True):
        times = [t + 2e-4 * per_step[t] for t in base.token_times_s]
        assert list(mine.token_times_s) == times and mine.first_token_s == times[0]
        assert mine.finish_s == times[-1] and mine.prefill_replica != mine.replica


@pytest.mark.parametrize("name", ["mooncake", "prefix"])
def test_never_is_the_plain_fleet_run(name: str) -> None:
    trace = TRACES[name]
    replicas = [Replica(config(num_blocks=500, check_invariants=False)) for _ in range(3)]
    plain = simulate_fleet(trace, replicas, make_policy("llm-d", seed=3))
    pd = simulate_pd(trace, replicas, ["both"] * 3, make_policy("llm-d", seed=3))
    assert pd.step_columns == plain.step_columns
    for mine, theirs in zip(pd.requests, plain.requests, strict=True):
        row = mine.to_row()
        extra = {column: row.pop(column) for column in PD_REQUEST_COLUMNS}
        assert row == theirs.to_row()
        assert extra["prefill_replica"] == row["replica"]
        assert (extra["kv_transfer_s"], extra["kv_transfer_bytes"], extra["decode_queue_s"]) \
            == (0.0, 0, 0.0)


# ---- flags and fleet files -------------------------------------------------------------------


def test_pool_roles_from_the_fleet_file() -> None:
    spec = parse_fleet("""
        [[pool]]
        name = "p"
        count = 2
        gpu = "h200"
        model = "llama-3.1-8b"
        role = "prefill"
        [[pool]]
        name = "d"
        count = 1
        gpu = "h200"
        model = "llama-3.1-8b"
    """)
    assert spec.roles() == ["prefill", "prefill", "both"]
    with pytest.raises(ValueError, match="pool 'x': role must be one of"):
        parse_fleet('[[pool]]\nname = "x"\ncount = 1\ngpu = "h200"\nmodel = "m"\n'
                    'role = "encode"\n')


def test_pd_flags() -> None:
    flags = PDFlags()
    assert (flags.decider, flags.transfer) == (PDDecider("never", 16), KvTransferConfig())
    assert not flags.is_pd(None) and not flags.is_pd(["both", "both"])
    assert flags.is_pd(["prefill", "decode"])
    assert PDFlags(pd_decider="always").is_pd(None)
    with pytest.raises(ValueError, match="decider"):
        PDFlags(pd_decider="x")
    with pytest.raises(ValueError, match="--pd-transfer-gbps must be a finite number >= 0.001"):
        PDFlags(pd_transfer_gbps=0.0)


@pytest.mark.parametrize(("given", "message"), [
    ({"pd_transfer_gbps": 1e-300},
     "--pd-transfer-gbps must be a finite number >= 0.001 GB/s, got 1e-300"),
    ({"pd_transfer_gbps": math.nan},
     "--pd-transfer-gbps must be a finite number >= 0.001 GB/s, got nan"),
    ({"pd_transfer_latency_ms": 1e308},
     "--pd-transfer-latency-ms must be in [0, 60,000] ms, got 1e+308"),
])
def test_a_transfer_taking_past_hours_is_refused(given: dict[str, float], message: str) -> None:
    """Once a simulation to 1e300 s, then a numpy error in its metrics (NaN: named as the
    bandwidth in bytes/s, not the flag)."""
    with pytest.raises(ValueError) as info:
        PDFlags(**given)  # type: ignore[arg-type]
    assert str(info.value) == message
    assert PDFlags(pd_transfer_gbps=1e-3, pd_transfer_latency_ms=60_000.0).transfer


def test_the_attribution_table_has_the_transfer_part() -> None:
    import pandas as pd

    from analysis.metrics import attribution

    trace = TRACES["random"]
    replicas = [Replica(config(check_invariants=False)) for _ in range(2)]
    result = simulate_pd(trace, replicas, ["prefill", "decode"], make_policy("round-robin"),
                         make_policy("round-robin"), PDDecider("always"))
    table = attribution(pd.DataFrame([r.to_row() for r in result.requests]))
    columns = list(table["column"])
    assert columns.index("kv_transfer_s") == columns.index("prefill_s") + 1
    assert columns[0] == "routing_s"
    assert table["share"].sum() == pytest.approx(1.0, abs=1e-9)


def test_a_pd_fleet_never_sleeps_through_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """P/D routes at each arrival reading replica state (`routes_ahead` off): its replicas
    never sleep through runs, whatever the routers (docs/fleet.md)."""
    from sim.fleet_replica import Replica as FleetReplica

    def never(self: FleetReplica, clock: float) -> object:
        raise AssertionError("a P/D replica slept through a run")

    monkeypatch.setattr(FleetReplica, "sleep_through_run", never)
    trace = Trace([TraceRequest(f"r{i}", 0.05 * i, 120, 30) for i in range(12)])
    result = simulate_pd(trace, [Replica(config()), Replica(config()), Replica(config())],
                         ["prefill", "decode", "decode"], make_policy("least-outstanding"),
                         make_policy("least-outstanding"), PDDecider("always"))
    assert len(result.requests) == 12
