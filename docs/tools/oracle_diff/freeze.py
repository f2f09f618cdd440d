"""Freeze vLLM's answers for tests: run random cases through the oracle, keep a small covering
set, and write them with the oracle's records to tests/fixtures/oracle/ (the tests replay
them through rt without vLLM: tests/runtime/test_oracle_random.py, tests/sim/test_oracle_sim.py).

    PYTHONPATH=. python docs/tools/oracle_diff/freeze.py

Scheduler cases: from `--pool` random cases, the smallest case of each distinct set of
features (policy, chunking, caps, watermark, min_tokens, prefix hits, preemption,
resumption, aborts, finish reasons); at most `--scheduler-cases`, the richest sets first.
Edge cases the same way from `--pool` cases of `edge_cases.py` (their shape and the
adaptive threshold count as features), at most `--edge-cases` plus the smallest case of
each shape those leave out.
Simulator cases: the first `--sim-cases` seeds whose simulation takes at most
`--max-sim-steps` steps, at least a third of them preempting.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from cases import random_case  # noqa: E402
from diff import run_oracle  # noqa: E402
from edge_cases import edge_case  # noqa: E402

from tests.runtime.oracle_replay import as_received  # noqa: E402
from tests.sim.oracle_sim import inputs_digest, random_sim_case, sim_case  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "oracle"


def features(case: dict[str, Any], records: list[dict[str, Any]]) -> frozenset[str]:
    cfg = case["config"]
    found = {cfg["policy"], "shape-" + case.get("shape", "random")}
    found |= {name for name, on in (
        ("no-chunking", not cfg["enable_chunked_prefill"]),
        ("no-prefix-caching", not cfg["enable_prefix_caching"]),
        ("threshold", cfg["long_prefill_token_threshold"] > 0),
        ("first-chunk-gate", not cfg["scheduler_reserve_full_isl"]),
        ("watermark", cfg.get("watermark", 0.0) > 0),
        ("adaptive", cfg.get("long_prefill_token_threshold_adaptive", False)),
        ("min-tokens", any(ev.get("min_tokens") for ev in case["events"]))) if on}
    for rec in records:
        if rec.get("preempted"):
            found.add("preempted")
        if rec.get("resumed"):
            found.add("resumed")
        if rec.get("aborted"):
            found.add("aborted")
        for done in rec.get("finished", []):
            found.add("finished-" + done["reason"])
        if rec.get("prefix_cache_cumulative", {}).get("hits"):
            found.add("prefix-hit")
        found |= {"kv-" + kind for kind, _ in rec.get("kv_events", [])}
    return frozenset(found)


def freeze_scheduler_cases(seed: int, pool: int, limit: int, venv: Path,
                           make: Callable[[int], dict[str, Any]] = random_case,
                           name: str = "random_cases.json.gz") -> int:
    cases = [make(seed + k) for k in range(pool)]
    answers = run_oracle([dict(case, events=as_received(case["events"])) for case in cases],
                         venv)
    smallest: dict[frozenset[str], tuple[int, dict[str, Any]]] = {}
    for case, answer in zip(cases, answers, strict=True):
        steps = answer["steps"]
        key = features(case, steps)
        if key not in smallest or len(steps) < smallest[key][0]:
            smallest[key] = (len(steps), {**case, "vllm": steps})
    # The richest feature sets first, the smaller case first among equals.
    ranked = sorted(smallest.items(), key=lambda item: (-len(item[0]), item[1][0]))
    chosen = [case for _, (_, case) in ranked[:limit]]
    # and the smallest case of each shape the richest sets left out
    shapes = {case.get("shape") for case in chosen}
    for _, (_, case) in sorted(smallest.items(), key=lambda item: item[1][0]):
        if case.get("shape") not in shapes:
            shapes.add(case.get("shape"))
            chosen.append(case)
    kept = sorted(chosen, key=lambda case: case["seed"])
    write(FIXTURES / name, kept)
    return len(kept)


def freeze_sim_cases(seed: int, count: int, max_steps: int, venv: Path) -> int:
    kept: list[dict[str, Any]] = []
    preempting = 0
    k = seed
    while len(kept) < count:
        case = sim_case(*random_sim_case(k))
        steps = case["rt"]["steps"]
        preempts = any(s["preempted"] for s in steps)
        room = count - len(kept) > count // 3 - preempting
        if len(steps) <= max_steps and (preempts or room):
            kept.append({"seed": k, "config": case["config"], "adds": case["adds"]})
            preempting += preempts
        k += 1
    answers = run_oracle([{"config": c["config"], "adds": c["adds"]} for c in kept], venv)
    frozen = [{"seed": c["seed"], "inputs_sha256": inputs_digest(c), "vllm": a}
              for c, a in zip(kept, answers, strict=True)]
    write(FIXTURES / "sim_cases.json.gz", frozen)
    return len(frozen)


def write(path: Path, cases: list[dict[str, Any]]) -> None:
    with gzip.open(path, "wt", compresslevel=9) as out:
        json.dump(cases, out, separators=(",", ":"))
    print(f"{path}: {len(cases)} cases, {path.stat().st_size:,} bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=int, default=2000)
    ap.add_argument("--scheduler-cases", type=int, default=80)
    ap.add_argument("--edge-cases", type=int, default=40)
    ap.add_argument("--sim-cases", type=int, default=12)
    ap.add_argument("--max-sim-steps", type=int, default=400)
    ap.add_argument("--venv", type=Path, default=Path("/work/vllm-venv"))
    args = ap.parse_args()
    freeze_scheduler_cases(args.seed, args.pool, args.scheduler_cases, args.venv)
    freeze_scheduler_cases(args.seed, args.pool, args.edge_cases, args.venv, edge_case,
                           "edge_cases.json.gz")
    freeze_sim_cases(args.seed, args.sim_cases, args.max_sim_steps, args.venv)


if __name__ == "__main__":
    main()
