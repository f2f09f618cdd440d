"""rt's `vllm-dp` router policy against vLLM's own DP load balancer on random event
sequences (stats broadcasts, dispatches, finishes): every choice must be the same.

    PYTHONPATH=. python docs/tools/oracle_diff/dp_diff.py --cases 2000 --seed 0

Needs the oracle's virtual environment at $VLLM_VENV (default /work/vllm-venv)."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from diff import common_args, run_oracle  # noqa: E402

from runtime.router import ReplicaSnapshot, RoutingRequest  # noqa: E402
from runtime.router.simple import VllmDP, VllmDPConfig  # noqa: E402


def random_case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    n, count = rng.randint(2, 8), rng.choice((1, 1, 2, 3))
    events: list[dict[str, Any]] = []
    live: list[str] = []
    for k in range(rng.randint(5, 120)):
        roll = rng.random()
        if roll < 0.15:
            events.append({"op": "stats", "counts": [
                [rng.choice((0, 0, 1, 2, 5)), rng.choice((0, 1, 3, 8)),
                 rng.choice((0.0, 0.3, 0.5, 0.6, 0.75, 0.9, 1.0))] for _ in range(n)]})
        elif live and roll < 0.45:
            events.append({"op": "finish", "id": live.pop(rng.randrange(len(live)))})
        else:
            live.append(f"r{k}")
            events.append({"op": "route", "id": f"r{k}"})
    return {"seed": seed, "engines": n, "client_count": count,
            "client_index": rng.randrange(count), "events": events}


def rt_choices(case: dict[str, Any], formula: str = "current") -> list[int]:
    n, count = case["engines"], case["client_count"]
    policy = VllmDP(VllmDPConfig(start_index=(n * case["client_index"]) // count,
                                 client_count=count, formula=formula))
    snaps = [ReplicaSnapshot(replica_id=i, taken_at_s=0.0) for i in range(n)]
    chosen = []
    for k, ev in enumerate(case["events"]):
        if ev["op"] == "stats":
            snaps = [ReplicaSnapshot(replica_id=i, taken_at_s=float(k), num_waiting=w,
                                     num_running=r, kv_usage=kv)
                     for i, (w, r, kv) in enumerate(ev["counts"])]
        elif ev["op"] == "route":
            request = RoutingRequest(request_id=ev["id"], prompt_len=8, now_s=float(k))
            chosen.append(policy.route(request, snaps).replica)
        else:
            policy.on_finished(ev["id"])
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    common_args(ap, cases=1000)
    ap.add_argument("--formula", default="current",
                    help="rt's formula to compare (legacy: how far the old one is off)")
    args = ap.parse_args()
    cases = [random_case(args.seed + k) for k in range(args.cases)]
    theirs = run_oracle(cases, args.venv, "dp_oracle.py")
    differ = routes = 0
    for case, vllm in zip(cases, theirs, strict=True):
        ours = rt_choices(case, args.formula)
        routes += len(ours)
        if ours != vllm:
            differ += 1
            k = next(i for i, (a, b) in enumerate(zip(ours, vllm, strict=True)) if a != b)
            print(f"seed {case['seed']}: dispatch {k}: rt {ours[k]}, vLLM {vllm[k]}")
    print(f"{args.cases} cases, {routes} dispatches: {differ} differ")


if __name__ == "__main__":
    main()
