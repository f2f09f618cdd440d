"""Router block keys from the trace (`sim.router_keys`): equal exactly when llm-d's chained
blake2b hashes of the token ids are (`prompt_block_hashes`), the partial tail block (tails
that agree by chance too) and the `max_blocks` cap included; given for a whole run or none
(segments, explicit ids, a router block size not dividing H, several H, too few token ids
for the block size); and a fleet behind llm-d decides alike with keys and with hashes."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.router import (
    PrefixKeys,
    PromptBlocking,
    ReplicaSnapshot,
    RouterPolicy,
    RoutingDecision,
    RoutingRequest,
    make_policy,
)
from runtime.router.llmd import Llmd, LlmdConfig
from runtime.router.policy import parse_config
from runtime.router.prefix_index import prompt_block_hashes
from sim.fleet import simulate_fleet
from sim.router_keys import RouterKeys, router_keys_for
from tests.sim.fleet_support import FIXTURES, Replica
from tests.sim.test_fleet import config
from workloads import (
    ArrivalProcess,
    MultiTurn,
    RandomLengths,
    Trace,
    TraceRequest,
    load_trace,
    multi_turn_trace,
    random_trace,
)
from workloads.tokens import prompt_token_array

CONFIG = config()
VOCAB, SEED = CONFIG.vocab_size, CONFIG.seed


def shared_trace(seed: int, n: int, hash_block: int, rate: float = 300.0) -> Trace:
    """Hash-id prompts extending earlier ones (shared prefixes), exact repeats of earlier
    ones (same ids, same length: a shared partial tail), earlier ids with another length,
    partial last pieces, tails of the request's own tokens, and plain prompts."""
    rng = random.Random(seed)
    made: list[tuple[tuple[int, ...], int]] = []
    next_id = 0
    requests = []
    for i in range(n):
        roll = rng.random()
        if made and roll < 0.25:  # a repeat: the same ids and length
            ids, prompt_len = rng.choice(made)
        elif made and roll < 0.35:  # the same ids, another length: another tail
            ids = rng.choice(made)[0]
            prompt_len = (len(ids) - 1) * hash_block + rng.randint(1, hash_block)
        elif roll < 0.45:  # a plain prompt
            ids, prompt_len = (), rng.randint(1, 5 * hash_block)
        else:
            base = rng.choice(made)[0] if made else ()
            grown = tuple(range(next_id, next_id + rng.randint(1, 3)))
            next_id += len(grown)
            ids = base[:rng.randint(0, len(base))] + grown
            covered = len(ids) * hash_block
            prompt_len = max(1, covered - rng.choice([0, 3, hash_block // 2, hash_block - 1]))
            if rng.random() < 0.3:  # fewer ids than the prompt needs
                prompt_len = covered + rng.randint(1, 2 * hash_block)
        if ids:
            made.append((ids, prompt_len))
        requests.append(TraceRequest(f"r{i}", i / rate, prompt_len, rng.randint(1, 30),
                                     hash_ids=ids or None,
                                     hash_block_size=hash_block if ids else None))
    return Trace(tuple(requests))


def assert_same_equality(trace: Sequence[TraceRequest], keys: RouterKeys) -> int:
    """Keys and blake2b hashes of every request's blocks are in one-to-one correspondence
    (equal keys <-> equal hashes), as many keys as hashes; returns the blocks compared."""
    blocking = keys.blocking
    hash_of: dict[int, int] = {}
    key_of: dict[int, int] = {}
    blocks = 0
    for req in trace:
        tokens = prompt_token_array(req, keys.vocab_size, keys.seed)
        hashes = prompt_block_hashes(tokens, blocking.block_size, blocking.max_blocks)
        given = keys.keys(req)
        assert given.blocking == blocking
        assert len(given.keys) == len(hashes), req.request_id
        for key, h in zip(given.keys, hashes, strict=True):
            assert hash_of.setdefault(key, h) == h, req.request_id  # equal key -> equal hash
            assert key_of.setdefault(h, key) == key, req.request_id  # equal hash -> equal key
        blocks += len(hashes)
    return blocks


def hashed(request_id: str, prompt_len: int, *ids: int) -> TraceRequest:
    return TraceRequest(request_id, 0.0, prompt_len, 1, hash_ids=ids, hash_block_size=32)


def test_keys_by_hand() -> None:
    """H = 32, B = 16: 2 blocks a piece, S = 2 + 32 = 34; own stride 257. Kinds by the key
    mod 3: 0 hash-id blocks (3 * (run * S + j)), 1 own blocks, 2 fresh tails (interned)."""
    keys = RouterKeys(PromptBlocking(16, 256), 32, VOCAB, SEED)
    # run 0 = (7): blocks 0, 3; the 8-token tail starts piece 1: a fresh tail, number 0
    assert keys.keys(hashed("a", 40, 7, 8)).keys == [0, 3, 2]
    assert keys.keys(hashed("b", 40, 7, 8)).keys == [0, 3, 2]  # a repeat shares it
    # runs 1 = (7, 8), 2 = (7, 9): 3 * 2 * 34 = 204
    assert keys.keys(hashed("c", 64, 7, 9)).keys == [0, 3, 204, 207]
    # a tail inside piece 1 (tokens 48-56): 3 * (1 * 34 + 2 + 24) = 180
    assert keys.keys(hashed("d", 56, 7, 8)).keys == [0, 3, 102, 180]
    assert keys.keys(hashed("e", 56, 7, 8)).keys == [0, 3, 102, 180]
    # plain prompts: own numbers 0, 1 (base 1, 3 * 257 + 1 = 772), their tails own
    assert keys.keys(TraceRequest("f", 0.0, 20, 1)).keys == [1, 4]
    assert keys.keys(TraceRequest("g", 0.0, 47, 1)).keys == [772, 775, 778]
    assert keys.keys(TraceRequest("h", 0.0, 15, 1)).keys == []  # under one block
    # 8 tokens of its own past the pieces: a fresh tail after block 105, number 1
    assert keys.keys(hashed("i", 72, 7, 8)).keys == [0, 3, 102, 105, 5]
    # 36 tokens of its own past the pieces: own blocks 4, 5 (own number 2: base 1543), tail
    assert keys.keys(hashed("j", 100, 7, 8)).keys == [0, 3, 102, 105, 1555, 1558, 1561]
    capped = RouterKeys(PromptBlocking(16, 3), 32, VOCAB, SEED)  # 48 tokens at most
    assert capped.keys(hashed("k", 64, 7, 8)).keys == [0, 3, 102]
    assert capped.keys(hashed("l", 40, 7, 8)).keys == [0, 3, 2]  # under the cap: its tail


def test_a_fresh_tail_keeps_its_parent() -> None:
    """a and b end with the same 3 tokens of h:5 (the start of their second piece), after
    different first pieces: their hashes differ, so must their keys (a tail keyed by its
    tokens alone would be equal)."""
    keys = RouterKeys(PromptBlocking(16, 256), 32, VOCAB, SEED)
    pair = [hashed("a", 35, 0, 5), hashed("b", 35, 1, 5)]
    assert assert_same_equality(pair, keys) == 6
    assert keys.keys(pair[0]).keys[2] != keys.keys(pair[1]).keys[2]


def test_asking_again_gives_the_same_keys() -> None:
    """A request's own blocks are numbered by its id: asked twice, its keys are equal (a
    number drawn per call would part them from their hashes)."""
    keys = RouterKeys(PromptBlocking(16, 256), 32, VOCAB, SEED)
    plain, hashed_own = TraceRequest("p", 0.0, 47, 1), hashed("q", 100, 7, 8)
    first = [keys.keys(plain).keys, keys.keys(hashed_own).keys]
    assert [keys.keys(plain).keys, keys.keys(hashed_own).keys] == first
    assert first[0] == [1, 4, 7]


def test_llmd_refuses_keys_not_one_per_block() -> None:
    """A 4,000-token prompt has 250 blocks of 16 under llm-d's cap of 256: 1 key is an
    error, not a silently wrong prefix score."""
    policy = Llmd(LlmdConfig())
    snaps = [ReplicaSnapshot(replica_id=0, taken_at_s=0.0)]
    bad = RoutingRequest(request_id="r", now_s=0.0, prompt_len=4000,
                         prefix_keys=PrefixKeys(PromptBlocking(16, 256), [1]))
    with pytest.raises(ValueError, match="1 prefix keys for a 4000-token prompt, expected 250"):
        policy.route(bad, snaps)


def test_fresh_tails_follow_their_tokens() -> None:
    """With 2 token ids (vocabulary 12), tails of 1-3 tokens starting a stream often hold
    the same tokens under different ids: their keys are equal exactly when the hashes are
    (the prefix before them, h:1's 32 tokens, is shared)."""
    keys = RouterKeys(PromptBlocking(16, 256), 32, 12, SEED)
    trace = [hashed(f"r{k}-{t}", 32 + t, 1, k) for k in range(2, 14) for t in (1, 2, 3)]
    trace += [hashed(f"own{t}-{n}", 32 + t, 1) for t in (1, 2, 3) for n in range(4)]
    assert assert_same_equality(trace, keys) == 3 * len(trace)
    tails = {tuple(keys.keys(req).keys[-1:]) for req in trace}
    assert len(tails) <= 2 + 4 + 8 < len(trace)  # 1-3 tokens of 2 ids: at most 14 tails


@pytest.mark.parametrize(("hash_block", "block_size", "max_blocks"),
                         [(32, 16, 256), (64, 16, 256), (32, 32, 256), (16, 16, 256),
                          (64, 16, 3), (32, 8, 5), (512, 16, 256)])
def test_keys_are_equal_exactly_when_the_hashes_are(hash_block: int, block_size: int,
                                                    max_blocks: int) -> None:
    trace = shared_trace(1, 400, hash_block)
    keys = router_keys_for(trace, [make_policy("llm-d", (f"block_size={block_size}",
                                                         f"max_prefix_blocks={max_blocks}"))],
                           CONFIG)
    assert keys is not None
    assert assert_same_equality(trace, keys) > 400
    assert len(set(keys.keys(req).keys[0] for req in trace if req.prompt_len >= block_size)
               ) < len(trace)  # shared first blocks: the check compared equal keys too


def test_keys_on_the_mooncake_excerpt() -> None:
    trace = load_trace(FIXTURES / "mooncake_conversation_first300.jsonl").trace
    keys = router_keys_for(trace, [make_policy("llm-d")], CONFIG)
    assert keys is not None
    assert assert_same_equality(trace, keys) > 10_000


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_keys_against_hashes_of_generated_prompts(data: st.DataObject) -> None:
    """Hand-made prompts from a few hash ids (repeats, shared prefixes, every length
    around piece and block ends) and plain ones: keys and hashes agree."""
    hash_block = data.draw(st.sampled_from([12, 16, 24, 48]), label="H")
    block_size = data.draw(st.sampled_from([b for b in (6, 8, 12) if  # (32k - 10)^B >= 2^64
                                            hash_block % b == 0]), label="B")
    max_blocks = data.draw(st.integers(1, 12), label="max_blocks")
    prompts = data.draw(st.lists(st.tuples(
        st.lists(st.integers(0, 3), max_size=4),
        st.integers(1, 5 * hash_block)), min_size=1, max_size=25), label="prompts")
    requests = []
    for i, (ids, length) in enumerate(prompts):
        if ids:  # the prompt covers its ids' pieces but the last at least in part
            length = min(max(length, (len(ids) - 1) * hash_block + 1), 6 * hash_block)
        requests.append(TraceRequest(f"r{i}", 0.0, length, 1, hash_ids=tuple(ids) or None,
                                     hash_block_size=hash_block if ids else None))
    keys = RouterKeys(PromptBlocking(block_size, max_blocks), hash_block, VOCAB, SEED)
    assert_same_equality(requests, keys)


def test_keys_only_where_the_trace_allows_them() -> None:
    llmd = make_policy("llm-d")
    trace_h = shared_trace(2, 50, 32)
    assert router_keys_for(trace_h, [llmd], CONFIG) is not None
    off = dataclasses.replace(CONFIG, trace_block_ids=False)
    assert router_keys_for(trace_h, [llmd], off) is None  # trace block ids off
    assert router_keys_for(trace_h, [make_policy("round-robin")], CONFIG) is None  # no reader
    assert router_keys_for(trace_h, [llmd, make_policy("llm-d", ("block_size=32",))],
                           CONFIG) is None  # two blockings
    assert router_keys_for(trace_h, [make_policy("llm-d", ("block_size=64",))], CONFIG) is None
    assert router_keys_for(trace_h, [make_policy("llm-d", ("block_size=32",))],
                           CONFIG) is not None
    # a block's tokens must not repeat by chance likelier than a 64-bit hash: 32k ids
    # need 5 tokens a block, 2 ids 64
    assert router_keys_for(trace_h, [make_policy("llm-d", ("block_size=4",))], CONFIG) is None
    assert router_keys_for(trace_h, [make_policy("llm-d", ("block_size=8",))],
                           CONFIG) is not None
    assert router_keys_for(trace_h, [llmd], dataclasses.replace(CONFIG, vocab_size=12)) is None
    other_h = Trace((*trace_h, TraceRequest("x", 1.0, 64, 1, hash_ids=(1,),
                                           hash_block_size=64)))
    assert router_keys_for(other_h, [llmd], CONFIG) is None  # two hash block sizes
    plain = random_trace(20, RandomLengths(100, 20), ArrivalProcess(request_rate=10.0, seed=1))
    assert router_keys_for(plain, [llmd], CONFIG) is not None
    assert router_keys_for(multi_turn_trace(5, MultiTurn(num_turns=2, turn_gap_s=0.1),
                                            ArrivalProcess(request_rate=10.0, seed=1)),
                           [llmd], CONFIG) is None  # segments
    explicit = Trace((TraceRequest("t", 0.0, 3, 1, prompt_token_ids=(11, 12, 13)),))
    assert router_keys_for(explicit, [llmd], CONFIG) is None


def test_llmd_rejects_keys_of_another_blocking_or_key_space() -> None:
    request = RoutingRequest(request_id="a", now_s=0.0, prompt_len=32,
                             prefix_keys=PrefixKeys(PromptBlocking(32, 256), [1]))
    with pytest.raises(ValueError, match="prefix keys of .*block_size=32"):
        Llmd().choose(request, [ReplicaSnapshot(replica_id=0, taken_at_s=0.0)])
    keyed, hashed = Llmd(), Llmd()  # one key space per index
    snapshots = [ReplicaSnapshot(replica_id=0, taken_at_s=0.0)]
    keys = PrefixKeys(PromptBlocking(16, 256), [1, 3])
    keyed.route(RoutingRequest(request_id="k", now_s=0.0, prompt_len=32, prefix_keys=keys),
                snapshots)
    hashed.route(RoutingRequest(request_id="h", now_s=0.0, prompt_len=32,
                                token_ids=list(range(32))), snapshots)
    with pytest.raises(ValueError, match="no prefix keys after keyed requests"):
        keyed.choose(RoutingRequest(request_id="a", now_s=0.0, prompt_len=32,
                                    token_ids=list(range(32))), snapshots)
    with pytest.raises(ValueError, match="prefix keys after hashing token ids"):
        hashed.choose(RoutingRequest(request_id="a", now_s=0.0, prompt_len=32,
                                     prefix_keys=keys), snapshots)
    with pytest.raises(ValueError, match="3 keys exceed max_blocks 2"):
        PrefixKeys(PromptBlocking(16, 2), [1, 2, 3])


_Log = list[tuple[str, bool, bool, int, dict[int, float], int]]


class _Recording(Llmd):
    """llm-d noting, per request: whether keys came, whether its token ids were
    placeholders, the scores and the most blocks any replica matched."""

    def __init__(self, config: LlmdConfig, hashes_tokens: bool) -> None:
        super().__init__(config, seed=5)
        self.hashes_tokens = hashes_tokens
        self.log: _Log = []

    @property
    def prompt_blocking(self) -> PromptBlocking | None:  # None: the fleet gives no keys
        return None if self.hashes_tokens else super().prompt_blocking

    def choose(self, request: RoutingRequest,
               replicas: Sequence[ReplicaSnapshot]) -> RoutingDecision:
        decision = super().choose(request, replicas)
        matched = self.index.match(self._pending[request.request_id].hashes)
        tokens = request.token_ids
        zeros = tokens is not None and not any(tokens)
        self.log.append((request.request_id, request.prefix_keys is not None, zeros,
                         decision.replica, dict(decision.scores),
                         max(matched.values(), default=0)))
        return decision


def fleet_log(trace: Trace, args: Sequence[str], hashes_tokens: bool, num_blocks: int = 300,
              beside: RouterPolicy | None = None) -> tuple[_Log, list[dict[str, object]]]:
    """The llm-d router's log and the fleet's request rows (3 replicas of `num_blocks`
    blocks); `beside`: a second router replica."""
    policy = _Recording(parse_config("llm-d", LlmdConfig, args), hashes_tokens)
    policies: list[RouterPolicy] = [policy] if beside is None else [policy, beside]
    result = simulate_fleet(trace, [Replica(config(num_blocks=num_blocks, max_num_seqs=8,
                                                   budget=256))] * 3,
                            policies, refresh_s=0.01)
    return policy.log, [r.to_row() for r in result.requests]


def segment_trace() -> Trace:
    return multi_turn_trace(40, MultiTurn(num_turns=3, turn_gap_s=0.05,
                                          lengths=RandomLengths(64, 24)),
                            ArrivalProcess(request_rate=200.0, seed=3))


def plain_trace() -> Trace:
    return random_trace(150, RandomLengths(150, 60, range_ratio=0.9),
                        ArrivalProcess(request_rate=200.0, seed=4))


def mooncake_excerpt() -> Trace:
    return Trace(tuple(load_trace(FIXTURES / "mooncake_conversation_first300.jsonl").trace)[:120])


_SMALL_LRU = ("auto_tune=false", "lru_capacity_per_server=40")


@pytest.mark.parametrize(("name", "trace", "args", "num_blocks", "keyed"), [
    ("hash ids, repeats", shared_trace(3, 240, 32), _SMALL_LRU, 300, True),
    ("hash ids, 32-token router blocks", shared_trace(4, 200, 64), ("block_size=32",), 300,
     True),
    ("Mooncake, evicting", mooncake_excerpt(), ("auto_tune=false",
                                                "lru_capacity_per_server=2000"), 2000, True),
    ("plain prompts", plain_trace(), _SMALL_LRU, 300, True),
    ("segments: hashes", segment_trace(), (), 300, False),
    ("router block not dividing H: hashes", shared_trace(5, 200, 32), ("block_size=24",), 300,
     False),
])
def test_llmd_decides_alike_with_keys_and_with_hashes(name: str, trace: Trace,
                                                      args: tuple[str, ...], num_blocks: int,
                                                      keyed: bool) -> None:
    """Per request: the same replica and scores, and the same blocks matched, whether the
    fleet gives llm-d keys or llm-d hashes the token ids; with keys, the token ids llm-d
    gets are placeholders (the replicas name every block: nobody reads them)."""
    with_keys, rows_keys = fleet_log(trace, args, False, num_blocks)
    hashed, rows_hashed = fleet_log(trace, args, True, num_blocks)
    assert [entry[3:] for entry in with_keys] == [entry[3:] for entry in hashed]
    assert rows_keys == rows_hashed
    assert {entry[1] for entry in with_keys} == {keyed}  # every request or none
    assert {entry[2] for entry in with_keys} == {keyed}  # placeholders iff keys
    assert not any(entry[1] or entry[2] for entry in hashed)
    if name != "plain prompts":  # prefixes were shared and matched
        assert sum(entry[5] > 0 for entry in hashed) > len(trace) // 10
    assert len({entry[3] for entry in hashed}) == 3


def test_keys_beside_a_router_reading_tokens_leave_the_tokens() -> None:
    """llm-d and production-stack's prefix-aware (a trie over the token ids) as two router
    replicas: llm-d gets keys, and both the real token ids."""
    trace = shared_trace(6, 160, 32)
    with_keys, rows_keys = fleet_log(trace, _SMALL_LRU, False,
                                     beside=make_policy("prefix-aware"))
    hashed, rows_hashed = fleet_log(trace, _SMALL_LRU, True, beside=make_policy("prefix-aware"))
    assert rows_keys == rows_hashed
    assert [entry[3:] for entry in with_keys] == [entry[3:] for entry in hashed]
    assert all(entry[1] and not entry[2] for entry in with_keys)
