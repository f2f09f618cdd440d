"""round-robin, random, least-outstanding, vllm-dp, power-of-two: choices on hand-computed
snapshots (the expected replica and the reference formula in each comment)."""

from __future__ import annotations

from runtime.router import make_policy
from runtime.router.rng import SplitMix64
from runtime.router.simple import PowerOfTwo, PowerOfTwoConfig, VllmDP, VllmDPConfig

from .helpers import req, snaps


def route_many(policy, replicas, n):
    return [policy.route(req(prompt_len=16), replicas).replica for _ in range(n)]


# --- round-robin: i-th request -> candidates (id order)[i mod n] ---------------------------

def test_round_robin_cycles_in_id_order() -> None:
    assert route_many(make_policy("round-robin"), snaps(3), 4) == [0, 1, 2, 0]


def test_round_robin_sorts_candidates() -> None:
    replicas = list(reversed(snaps(3)))  # given as 2, 1, 0
    assert route_many(make_policy("round-robin"), replicas, 3) == [0, 1, 2]


def test_round_robin_over_a_subset() -> None:
    candidates = [s for s in snaps(4) if s.replica_id in (1, 3)]
    assert route_many(make_policy("round-robin"), candidates, 3) == [1, 3, 1]


def test_round_robin_ignores_load() -> None:
    # replica 0 has 100 waiting; turn order still starts at 0
    assert route_many(make_policy("round-robin"), snaps(2, waiting=[100, 0]), 2) == [0, 1]


def test_round_robin_single_candidate() -> None:
    assert route_many(make_policy("round-robin"), snaps(1), 3) == [0, 0, 0]


# --- random: uniform from SplitMix64(seed) over the ids in order ---------------------------

def test_splitmix64_known_answer() -> None:
    # SplitMix64's published first output for seed 0
    assert SplitMix64(0).next_u64() == 0xE220A8397B1DCDAF


def test_random_replays_the_seeded_draws() -> None:
    rng = SplitMix64(7)
    expected = [rng.randrange(3) for _ in range(20)]
    assert route_many(make_policy("random", seed=7), snaps(3), 20) == expected


def test_random_candidate_order_does_not_matter() -> None:
    a = route_many(make_policy("random", seed=3), snaps(4), 30)
    b = route_many(make_policy("random", seed=3), list(reversed(snaps(4))), 30)
    assert a == b


def test_random_seeds_differ() -> None:
    a = route_many(make_policy("random", seed=1), snaps(4), 30)
    b = route_many(make_policy("random", seed=2), snaps(4), 30)
    assert a != b


def test_random_is_roughly_uniform() -> None:
    picks = route_many(make_policy("random", seed=11), snaps(3), 3000)
    for r in range(3):
        assert 900 < picks.count(r) < 1100  # 1000 expected, sd ~26


def test_random_single_candidate() -> None:
    assert route_many(make_policy("random", seed=5), snaps(1), 3) == [0, 0, 0]


# --- least-outstanding (Vidur lor): argmin in-flight, ties -> lowest id ---------------------

def test_lor_fresh_tie_goes_to_lowest_id() -> None:
    assert make_policy("least-outstanding").choose(req(prompt_len=8), snaps(3)).replica == 0


def test_lor_spreads_then_wraps() -> None:
    # in flight after each: [1,0,0] -> [1,1,0] -> [1,1,1] -> tie -> 0
    assert route_many(make_policy("least-outstanding"), snaps(3), 4) == [0, 1, 2, 0]


def test_lor_finish_frees_a_slot() -> None:
    policy = make_policy("least-outstanding")
    requests = [req(prompt_len=8) for _ in range(3)]
    for r in requests:
        policy.route(r, snaps(3))  # one each on 0, 1, 2
    policy.on_finished(requests[1].request_id)  # in flight [1, 0, 1]
    assert policy.choose(req(prompt_len=8), snaps(3)).replica == 1


def test_lor_ignores_stale_snapshots() -> None:
    # snapshot says replica 0 has 50 waiting; lor counts only its own in-flight (all 0)
    policy = make_policy("least-outstanding")
    assert policy.choose(req(prompt_len=8), snaps(2, waiting=[50, 0])).replica == 0


def test_lor_over_a_subset() -> None:
    policy = make_policy("least-outstanding")
    policy.route(req(prompt_len=8), snaps(3))  # -> 0
    candidates = [s for s in snaps(3) if s.replica_id != 1]  # {0: 1, 2: 0}
    assert policy.choose(req(prompt_len=8), candidates).replica == 2


# --- vllm-dp, legacy: argmin waiting*4 + running (+client_count per dispatch until the next
# scrape), the scan always from start_index -------------------------------------------------

def legacy(**kwargs) -> VllmDP:
    return VllmDP(VllmDPConfig(formula="legacy", **kwargs))


def test_vllm_dp_legacy_formula() -> None:
    # scores: 1*4+0 = 4, 0*4+3 = 3, 0*4+2 = 2 -> 2
    d = legacy().choose(req(prompt_len=8), snaps(3, [1, 0, 0], [0, 3, 2]))
    assert d.replica == 2 and dict(d.scores) == {0: 4.0, 1: 3.0, 2: 2.0}


def test_vllm_dp_legacy_waiting_weighs_four() -> None:
    # 1*4+0 = 4 vs 0*4+3 = 3 -> 1; with running 4: 4 vs 4, tie -> first scanned, 0
    assert legacy().choose(req(prompt_len=8), snaps(2, [1, 0], [0, 3])).replica == 1
    assert legacy().choose(req(prompt_len=8), snaps(2, [1, 0], [0, 4])).replica == 0


def test_vllm_dp_legacy_ties_follow_start_index() -> None:
    replicas = snaps(3, running=[2, 2, 2])
    assert legacy(start_index=0).choose(req(prompt_len=8), replicas).replica == 0
    assert legacy(start_index=1).choose(req(prompt_len=8), replicas).replica == 1
    assert legacy(start_index=5).choose(req(prompt_len=8), replicas).replica == 2


def test_vllm_dp_legacy_speculative_counts_on_a_stale_snapshot() -> None:
    # same (stale) snapshot: 0,0,0 -> 0; then 4,0,0 -> 1; 4,4,0 -> 2; 4,4,4 -> 0
    assert route_many(legacy(), snaps(3), 4) == [0, 1, 2, 0]


def test_vllm_dp_legacy_fresh_scrape_resets_speculation() -> None:
    policy = legacy()
    policy.route(req(prompt_len=8), snaps(2, taken_at_s=0.0))  # -> 0, extra waiting 1 on 0
    assert policy.choose(req(prompt_len=8), snaps(2, taken_at_s=0.0)).replica == 1
    assert policy.choose(req(prompt_len=8), snaps(2, taken_at_s=0.1)).replica == 0


def test_vllm_dp_legacy_client_count() -> None:
    # running [0, 5]: 0 vs 5 -> 0; then 0+2*4 = 8 vs 5 -> 1; then 8 vs 5+8 = 13 -> 0
    assert route_many(legacy(client_count=2), snaps(2, running=[0, 5]), 3) == [0, 1, 0]


def test_vllm_dp_legacy_ignores_completions_and_kv() -> None:
    policy = legacy()
    assert policy.completion_blind
    # kv 0.99 with 1 waiting: still 4 vs 3 -> 1
    d = policy.choose(req(prompt_len=8), snaps(2, [1, 0], [0, 3], kv=[0.99, 0.0]))
    assert d.replica == 1 and dict(d.scores) == {0: 4.0, 1: 3.0}


# --- vllm-dp (current, vLLM since July 2026): argmin max(client_count * in flight,
# waiting + running) + waiting * 6 * max(0, kv - 0.5); the scan start moves on by one per
# dispatch ------------------------------------------------------------------------------------

def test_vllm_dp_current_is_the_default() -> None:
    policy = make_policy("vllm-dp")
    assert policy.config.formula == "current" and not policy.completion_blind


def test_vllm_dp_waiting_and_running_weigh_alike_below_half_kv() -> None:
    # kv <= 0.5: no penalty. max(0, 1+0) = 1, max(0, 0+3) = 3, max(0, 0+2) = 2 -> 0
    d = make_policy("vllm-dp").choose(req(prompt_len=8), snaps(3, [1, 0, 0], [0, 3, 2],
                                                                kv=[0.5, 0.9, 0.0]))
    assert d.replica == 0 and dict(d.scores) == {0: 1.0, 1: 3.0, 2: 2.0}


def test_vllm_dp_kv_pressure_penalises_waiting() -> None:
    # waiting [1, 0], running [0, 3]. kv 0.75: 1 + 1*6*0.25 = 2.5 vs 3 -> 0;
    # kv 0.9: 1 + 1*6*0.4 = 3.4 vs 3 -> 1 (replica 1's kv 1.0 costs nothing: none waits)
    d = make_policy("vllm-dp").choose(req(prompt_len=8), snaps(2, [1, 0], [0, 3], kv=[0.75, 1.0]))
    assert d.replica == 0 and dict(d.scores) == {0: 2.5, 1: 3.0}
    d = make_policy("vllm-dp").choose(req(prompt_len=8), snaps(2, [1, 0], [0, 3], kv=[0.9, 1.0]))
    assert d.replica == 1 and dict(d.scores) == {0: 1 + 6 * (0.9 - 0.5), 1: 3.0}


def test_vllm_dp_ties_rotate_the_scan_start() -> None:
    # every request finishes before the next, every snapshot fresh and empty: all score 0,
    # and the first scanned wins, from 0, then 1, 2, 0 (legacy: always 0)
    for policy, expected in ((make_policy("vllm-dp"), [0, 1, 2, 0]), (legacy(), [0, 0, 0, 0])):
        chosen = []
        for k in range(4):
            r = req(prompt_len=8)
            chosen.append(policy.route(r, snaps(3, taken_at_s=float(k))).replica)
            policy.on_finished(r.request_id)
        assert chosen == expected


def test_vllm_dp_in_flight_floor_outlasts_a_fresh_snapshot() -> None:
    # Fresh, empty snapshots each time (no speculative waiting), nothing finishes:
    # 1st: 0, 0 -> 0; 2nd: max(1, 0) = 1 vs 0 -> 1; 3rd (scan from 0): 1 vs 1 -> 0.
    # With client_count 2: 2nd: 2 vs 0 -> 1; 3rd: 2 vs 2 -> 0; 4th (from 1): 4 vs 2 -> 1.
    for policy, expected in ((make_policy("vllm-dp"), [0, 1, 0]),
                             (VllmDP(VllmDPConfig(client_count=2)), [0, 1, 0, 1])):
        chosen = [policy.route(req(prompt_len=8), snaps(2, taken_at_s=float(k))).replica
                  for k in range(len(expected))]
        assert chosen == expected


def test_vllm_dp_speculative_waiting_on_a_stale_snapshot() -> None:
    # one stale snapshot, running [0, 2]: 1st: 0 vs 2 -> 0 (waiting 0 += 1, in flight 1);
    # 2nd (from 1): max(1, 1) = 1 vs 2 -> 0; 3rd (from 0): max(2, 2) = 2 vs 2 -> 0 (first);
    # 4th (from 1): 3 vs 2 -> 1
    assert route_many(make_policy("vllm-dp"), snaps(2, running=[0, 2]), 4) == [0, 0, 0, 1]


# --- power-of-two: two distinct draws, the lower load wins, first drawn on a tie ----------

def test_p2_single_candidate() -> None:
    assert make_policy("power-of-two").choose(req(prompt_len=8), snaps(1)).replica == 0


def test_p2_two_candidates_lower_load_wins() -> None:
    policy = make_policy("power-of-two", seed=4)
    for _ in range(3):
        policy.on_routed(req(prompt_len=8), 0)  # in flight {0: 3, 1: 0}
    assert all(policy.choose(req(prompt_len=8), snaps(2)).replica == 1 for _ in range(10))


def test_p2_tie_goes_to_first_drawn() -> None:
    expected = SplitMix64(9).sample_two([0, 1])[0]
    policy = make_policy("power-of-two", seed=9)
    assert policy.choose(req(prompt_len=8), snaps(2)).replica == expected


def test_p2_replays_the_pair_draws() -> None:
    # in flight {0: 0, 1: 0, 2: 5}: the pair's lower load, first drawn on a 0-0 tie
    policy = make_policy("power-of-two", seed=21)
    for _ in range(5):
        policy.on_routed(req(prompt_len=8), 2)
    rng = SplitMix64(21)
    for _ in range(30):
        a, b = rng.sample_two([0, 1, 2])
        load = {0: 0, 1: 0, 2: 5}
        expected = a if load[a] <= load[b] else b
        assert policy.choose(req(prompt_len=8), snaps(3)).replica == expected != 2


def test_p2_snapshot_load_is_kv_usage() -> None:
    # SMG's load monitor compares the engines' KV token usage: 0.2 vs 0.7 -> 0, although 0
    # has running + waiting 4 + 6 = 10 against 1's 2 + 0 = 2; the order of the pair does not
    # matter (the lower usage wins either way)
    for seed in range(4):
        policy = PowerOfTwo(PowerOfTwoConfig(load="snapshot"), seed=seed)
        d = policy.choose(req(prompt_len=8), snaps(2, [6, 0], [4, 2], kv=[0.2, 0.7]))
        assert d.replica == 0 and dict(d.scores) == {0: 0.2, 1: 0.7}


def test_blind_policies_sort_one_fixed_tuple_of_candidates_once() -> None:
    """A driver passing the same tuple each time (the fleet's blind snapshots) gets the ids
    sorted once; a list, or another tuple, is read afresh."""
    policy = make_policy("round-robin", (), seed=0)
    three = snaps(3)
    fixed = (three[2], three[0])
    ids = policy.candidate_ids(fixed)
    assert ids == [0, 2] and policy.candidate_ids(fixed) is ids
    assert policy.candidate_ids(list(fixed)) == [0, 2]
    assert policy.candidate_ids(fixed[:1]) == [2]
    assert [policy.route(req(prompt_len=4), fixed).replica for _ in range(3)] == [0, 2, 0]
