"""Block identities of hash-id prompts from trace coordinates (`sim.block_ids`): equal exactly
when the engine's SHA-256 chain is (so the prefix cache sees the same hits, registrations and
evictions), the SHA-256 tail chaining on from them, and records identical with them on and
off (single engine, KV-event routers, P/D)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from runtime import Request, SamplingParams
from runtime.block_hash import make_block_hasher
from runtime.kv_events import prompt_block_hashes
from runtime.router import make_policy
from sim.block_ids import TraceBlockIds, own_streams_only
from sim.fleet import simulate_fleet
from sim.fleet_replica import Replica as ReplicaProcess
from sim.pd import PDDecider, simulate_pd
from sim.simulator import simulate
from tests.sim.fleet_support import COST, Replica
from tests.sim.test_fleet import config
from tests.sim.test_pd import Replica as PDReplica
from workloads import (
    ArrivalProcess,
    MultiTurn,
    RandomLengths,
    Trace,
    TraceRequest,
    multi_turn_trace,
    random_trace,
)
from workloads.tokens import output_token_array, prompt_token_array

VOCAB, SEED = 32_000, 0


def hash_id_trace(seed: int, n: int, hash_block: int, rate: float = 40.0) -> Trace:
    """Requests whose hash ids extend earlier requests' (conversations, shared system
    prompts), with partial last pieces, unhashed tails and a few cache salts."""
    rng = random.Random(seed)
    chains: list[tuple[int, ...]] = [()]
    next_id = 0
    requests = []
    for i in range(n):
        base = rng.choice(chains)[: rng.randint(0, 6)]
        grown = tuple(range(next_id, next_id + rng.randint(0, 3)))
        next_id += len(grown)
        ids = base + grown or (next_id,)
        next_id += ids == (next_id,)
        chains.append(ids)
        covered = len(ids) * hash_block
        prompt_len = max(1, covered - rng.choice([0, 0, 5, hash_block // 2, hash_block - 1]))
        if rng.random() < 0.3:  # fewer ids than the prompt needs: a tail of its own tokens
            prompt_len = covered + rng.randint(1, 2 * hash_block)
        salt = "s" if rng.random() < 0.15 else None
        requests.append(TraceRequest(f"r{i}", i / rate, prompt_len, rng.randint(1, 40),
                                     hash_ids=ids, hash_block_size=hash_block,
                                     cache_salt=salt))
    return Trace(tuple(requests))


def engine_hashes(req: TraceRequest, block_size: int, known: list[bytes],
                  key: bytes | None) -> list[bytes]:
    """The block hashes of the request's prompt and outputs as an engine keeps them."""
    request = Request(req.request_id, prompt_token_array(req, VOCAB, SEED),
                      SamplingParams(max_tokens=req.output_len, ignore_eos=True),
                      cache_salt=req.cache_salt, block_hashes=known, block_key=key)
    request.set_block_hasher(make_block_hasher(block_size), block_size)
    request.extend_output_tokens(output_token_array(req, VOCAB, SEED))
    return request.block_hashes


@pytest.mark.parametrize("own_blocks", [False, True])
@pytest.mark.parametrize(("hash_block", "block_size"), [(32, 16), (64, 16), (32, 32), (16, 16),
                                                        (48, 32)])
def test_identities_are_equal_exactly_when_the_sha_hashes_are(hash_block: int, block_size: int,
                                                               own_blocks: bool) -> None:
    names = TraceBlockIds(own_blocks)
    identity_of: dict[bytes, bytes] = {}  # SHA-256 -> identity (prompt and outputs)
    sha_of: dict[bytes, bytes] = {}
    num_named = 0
    trace = hash_id_trace(1, 300, hash_block)
    assert own_streams_only(trace)
    for req in trace:
        tokens = prompt_token_array(req, VOCAB, SEED)
        sha = engine_hashes(req, block_size, [], None)
        known = names.prompt_ids(req, block_size, VOCAB, SEED)
        pieces = names.piece_ids(req, block_size, VOCAB, SEED)
        assert known[:len(pieces)] == pieces
        assert TraceBlockIds.num_piece_ids(req, block_size) == len(pieces)
        if hash_block % block_size:  # pieces are not whole blocks: nothing named
            assert known == []
        elif not own_blocks:
            assert len(known) == expected_named(req, block_size)
        else:  # every full prompt block
            assert len(known) == req.prompt_len // block_size
        routed = prompt_block_hashes(tokens, block_size, req.cache_salt, known)
        engine = engine_hashes(req, block_size, known,
                               names.own_key(req, block_size, VOCAB, SEED))
        assert routed[: len(known)] == tuple(known) and engine[: len(routed)] == list(routed)
        assert len(engine) == len(sha)
        for a, b in zip(sha, engine, strict=True):
            assert identity_of.setdefault(a, b) == b  # equal SHA -> equal identity
            assert sha_of.setdefault(b, a) == a  # equal identity -> equal SHA
        num_named += len(known)
    if hash_block % block_size:
        assert num_named == 0
    else:
        assert num_named > 500 and len(identity_of) < num_named  # many blocks, shared ones


def test_own_blocks_only_where_no_stream_is_quoted() -> None:
    assert own_streams_only(random_trace(5, RandomLengths(64, 8), ArrivalProcess(5.0)))
    quoting = multi_turn_trace(4, MultiTurn(num_turns=2, turn_gap_s=0.1,
                                            lengths=RandomLengths(64, 8)), ArrivalProcess(5.0))
    assert not own_streams_only(quoting)
    explicit = TraceRequest("a", 0.0, 3, 1, prompt_token_ids=(11, 12, 13))
    assert not own_streams_only([explicit])
    req = TraceRequest("b", 0.0, 40, 2)
    assert TraceBlockIds(False).own_key(req, 16, VOCAB, SEED) is None
    assert TraceBlockIds(False).prompt_ids(req, 16, VOCAB, SEED) == []
    key = TraceBlockIds(True).own_key(req, 16, VOCAB, SEED)
    assert key is not None and TraceBlockIds(True).prompt_ids(req, 16, VOCAB, SEED) == [
        (0).to_bytes(8, "little") + key, (1).to_bytes(8, "little") + key]


def expected_named(req: TraceRequest, block_size: int) -> int:
    """The blocks wholly inside the hash-id pieces, counted directly."""
    assert req.hash_ids is not None and req.hash_block_size is not None
    covered = min(len(req.hash_ids) * req.hash_block_size, req.prompt_len)
    if covered < req.prompt_len or covered % req.hash_block_size == 0:
        return covered // block_size
    full_pieces = covered // req.hash_block_size
    last = covered - full_pieces * req.hash_block_size
    return (full_pieces * req.hash_block_size + last - last % block_size) // block_size


def test_only_hash_id_prompts_with_aligned_blocks_are_named() -> None:
    names = TraceBlockIds()
    plain = TraceRequest("a", 0.0, 64, 2)
    assert names.prompt_ids(plain, 16, VOCAB, SEED) == []
    misaligned = TraceRequest("b", 0.0, 96, 2, hash_ids=(1, 2), hash_block_size=48)
    assert names.prompt_ids(misaligned, 32, VOCAB, SEED) == []
    assert len(names.prompt_ids(misaligned, 16, VOCAB, SEED)) == 6
    # another vocabulary, seed or block size names other tokens: other identities
    same = names.prompt_ids(misaligned, 16, VOCAB, SEED)
    assert not set(same) & set(names.prompt_ids(misaligned, 16, VOCAB + 1, SEED))
    assert not set(same) & set(names.prompt_ids(misaligned, 16, VOCAB, SEED + 1))
    assert not set(same) & set(names.prompt_ids(misaligned, 8, VOCAB, SEED))


def both_ways(run, cfg):  # type: ignore[no-untyped-def]
    """`run(cfg)` with trace block ids on and off: the rows of each."""
    on = run(cfg)
    off = run(dataclasses.replace(cfg, trace_block_ids=False))
    return [r.to_row() for r in on.requests], [r.to_row() for r in off.requests], on, off


def mixed_traces(seed: int) -> Trace:
    """Hash-id, plain and multi-turn requests (the last keep SHA-256 past named blocks)."""
    if seed % 3 == 1:
        return random_trace(120, RandomLengths(150, 60, range_ratio=0.9),
                            ArrivalProcess(request_rate=200.0, seed=seed))
    if seed % 3 == 2:
        return multi_turn_trace(40, MultiTurn(num_turns=3, turn_gap_s=0.05,
                                              lengths=RandomLengths(64, 24)),
                                ArrivalProcess(request_rate=200.0, seed=seed))
    return hash_id_trace(seed, 160, 32, rate=200.0)


@pytest.mark.parametrize(("seed", "num_blocks", "fast_forward"),
                         [(3, 90, True), (6, 60, True), (9, 400, True), (12, 60, False),
                          (4, 60, True), (7, 60, False), (5, 60, True), (8, 400, False)])
def test_a_single_engine_gives_the_same_records(seed: int, num_blocks: int,
                                                fast_forward: bool) -> None:
    trace = mixed_traces(seed)
    cfg = config(num_blocks=num_blocks, max_num_seqs=12, budget=96, fast_forward=fast_forward)
    on, off, a, b = both_ways(lambda c: simulate(trace, c, COST), cfg)
    assert on == off
    assert dict(a.step_columns) == dict(b.step_columns)
    assert (a.prefix_cache_queries, a.prefix_cache_hits) == (b.prefix_cache_queries,
                                                             b.prefix_cache_hits)
    assert a.prefix_cache_hits > 0 or seed % 3 == 1
    assert sum(r["num_preemptions"] for r in on) > 0 or num_blocks > 100


@pytest.mark.parametrize(("policy", "seed"), [("dynamo-kv", 6), ("kv-aware", 6), ("llm-d", 6),
                                              ("round-robin", 7), ("round-robin", 6),
                                              ("least-outstanding", 8)])
def test_a_fleet_with_kv_event_routers_gives_the_same_records(policy: str, seed: int) -> None:
    """With token-blind routers (all but llm-d here) and named blocks, replicas get
    placeholder token ids: records equal the trace's tokens and SHA-256's."""
    trace = mixed_traces(seed) if seed != 6 else hash_id_trace(6, 160, 32, rate=300.0)
    args = ("precise_prefix_cache=3",) if policy == "llm-d" else ()

    def run(cfg):  # type: ignore[no-untyped-def]
        return simulate_fleet(trace, [Replica(cfg)] * 3, make_policy(policy, args, seed=1),
                              refresh_s=0.01)

    on, off, a, b = both_ways(run, config(num_blocks=120, max_num_seqs=8, budget=128))
    assert on == off
    assert dict(a.step_columns) == dict(b.step_columns)


def test_pd_with_prefix_threshold_gives_the_same_records() -> None:
    trace = hash_id_trace(7, 120, 32, rate=300.0)

    def run(cfg):  # type: ignore[no-untyped-def]
        return simulate_pd(trace, [PDReplica(cfg)] * 3, ["prefill", "decode", "decode"],
                           make_policy("dynamo-kv"), make_policy("round-robin"),
                           PDDecider("prefix-threshold", 32))

    on, off, _, _ = both_ways(run, config(num_blocks=200, max_num_seqs=8, budget=128))
    assert on == off


@pytest.mark.parametrize("seed", [3, 4])
def test_a_fleet_reading_prompts_only_hands_each_replica_its_outputs(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind llm-d (it reads prompts) a replica that reads no token gets placeholder
    outputs; one that does read them (trace block ids off) gets the trace's: records equal
    a fleet of replicas that all read the trace's tokens."""
    trace = hash_id_trace(seed, 160, 32, rate=300.0)  # every block named
    cfg = config(num_blocks=60, max_num_seqs=8, budget=128)
    reading = dataclasses.replace(cfg, trace_block_ids=False)
    handed: dict[str, tuple[int, list[int]]] = {}
    hand_over = ReplicaProcess.hand_over

    def spy(self, req, prompt, output, *args, **kwargs):  # type: ignore[no-untyped-def]
        handed[req.request_id] = (self.index, list(output))
        hand_over(self, req, prompt, output, *args, **kwargs)

    def run(configs):  # type: ignore[no-untyped-def]
        return simulate_fleet(trace, [Replica(c) for c in configs],
                              make_policy("llm-d", (), seed=1), refresh_s=0.01)

    monkeypatch.setattr(ReplicaProcess, "hand_over", spy)
    mixed = run([cfg, reading, cfg])
    for req in trace:
        replica, output = handed[req.request_id]
        trace_output = list(output_token_array(req, cfg.vocab_size, cfg.seed))
        assert output == (trace_output if replica == 1 else [0] * req.output_len)
    assert {replica for replica, _ in handed.values()} == {0, 1, 2}
    plain = run([reading] * 3)
    assert [r.to_row() for r in mixed.requests] == [r.to_row() for r in plain.requests]
    assert dict(mixed.step_columns) == dict(plain.step_columns)


def test_a_trace_mixing_hash_block_sizes_names_nothing() -> None:
    """b's first piece (id 7, H = 32) holds the first 32 tokens of a's (id 7, H = 64):
    SHA-256 finds them (2 blocks of 16), names rooted at H would not; so a trace mixing
    H names nothing, and records equal SHA-256's. Mixed with other traces' requests, the
    single engine's records stay equal too."""
    mixed = [TraceRequest("a", 0.0, 64, 2, hash_ids=(7,), hash_block_size=64),
             TraceRequest("b", 5.0, 64, 2, hash_ids=(7, 9), hash_block_size=32)]
    names = TraceBlockIds.of(mixed)
    assert names.block_pieces(mixed[0], 16, VOCAB, SEED) is None
    assert names.own_key(mixed[0], 16, VOCAB, SEED) is None
    one = TraceBlockIds.of(mixed[:1])
    assert one.block_pieces(mixed[0], 16, VOCAB, SEED) is not None
    on, off, a, b = both_ways(lambda c: simulate(Trace(mixed), c, COST), config(num_blocks=60))
    assert on == off
    assert [r["cached_tokens"] for r in on] == [0, 32]
    other = [dataclasses.replace(r, request_id="h32-" + r.request_id)
             for r in hash_id_trace(3, 60, 32, rate=200.0)]
    longer = Trace(sorted([*hash_id_trace(2, 60, 64, rate=200.0), *other],
                          key=lambda r: r.arrival_s))
    on, off, a, b = both_ways(lambda c: simulate(longer, c, COST), config(num_blocks=400))
    assert on == off and a.prefix_cache_hits == b.prefix_cache_hits > 0
