"""`rt simulate`'s engine against vLLM's scheduler on random small traces (sim_side.py).

    PYTHONPATH=. python docs/tools/oracle_diff/sim_diff.py --cases 100 --seed 0

Needs the oracle's virtual environment at $VLLM_VENV (default /work/vllm-venv) and the
shared traces (Mooncake's head). A development tool: rt's tests never run vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from diff import common_args, run_oracle  # noqa: E402
from sim_side import case_for, edge_case_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, cases=50)
    ap.add_argument("--edge", action="store_true",
                    help="edge-shaped configs (sim_side.edge_case_for)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/oracle_sim_diff"))
    args = ap.parse_args()
    make = edge_case_for if args.edge else case_for
    cases = [make(args.seed + k) for k in range(args.cases)]
    theirs = run_oracle([{"config": c["config"], "adds": c["adds"]} for c in cases], args.venv)
    args.out.mkdir(parents=True, exist_ok=True)
    differ = steps = requests = 0
    for case, oracle in zip(cases, theirs, strict=True):
        ours = case["rt"]
        steps += len(ours["steps"])
        requests += case["num_requests"]
        if "error" in oracle:
            print(f"seed {case['seed']}: the oracle failed: {oracle['error']}")
            differ += 1
            continue
        bad_step = next((k for k, (a, b) in enumerate(zip(ours["steps"], oracle["steps"],
                                                          strict=True)) if a != b), None)
        bad_reqs = sorted(r for r in ours["requests"]
                          if ours["requests"][r] != oracle["requests"].get(r))
        if bad_step is None and not bad_reqs:
            continue
        differ += 1
        print(f"seed {case['seed']} ({case['kind']}, {case['num_requests']} requests): "
              f"first differing step {bad_step}, requests {bad_reqs[:5]}")
        Path(args.out, f"sim{case['seed']}.json").write_text(json.dumps(
            {"case": case, "vllm": oracle}, indent=1))
    print(f"{args.cases} traces, {requests} requests, {steps} steps: {differ} differ")


if __name__ == "__main__":
    main()
