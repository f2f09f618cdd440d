"""rt's scheduler against vLLM's own, on random cases: every step's decisions, block ids,
free-block queue, queues and request counters must be equal.

    PYTHONPATH=. python docs/tools/oracle_diff/diff.py --cases 200 --seed 0 [--out DIR]

Needs the oracle's virtual environment (shared/tools/vllm_oracle/README.md, section 1) at
$VLLM_VENV (default /work/vllm-venv). A development tool: rt's tests never run vLLM. Each case
that differs is written to DIR (default /tmp/oracle_diff) with both sides' records, and its
first differing step is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from cases import random_case  # noqa: E402
from edge_cases import edge_case  # noqa: E402

from tests.runtime.oracle_replay import (  # noqa: E402
    as_received,
    differing_fields,
    run_events,
    trim_idle,
)

HERE = Path(__file__).parent


def run_oracle(cases: list[Any], venv: Path, script: str = "oracle_batch.py") -> list[Any]:
    """`script`'s answers to `cases`, run under the oracle's venv (a JSON list in, one out)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "cases.json"), Path(tmp, "out.json")
        src.write_text(json.dumps(cases))
        subprocess.run([str(venv / "bin" / "python"), str(HERE / script), str(src),
                        str(dst)], check=True, stderr=subprocess.DEVNULL)
        return json.loads(dst.read_text())


def common_args(ap: argparse.ArgumentParser, cases: int) -> None:
    """The options every oracle_diff driver takes: how many cases, the first seed, the venv."""
    ap.add_argument("--cases", type=int, default=cases)
    ap.add_argument("--seed", type=int, default=0, help="first case's seed (then seed+1, ...)")
    ap.add_argument("--venv", type=Path, default=Path(os.environ.get("VLLM_VENV",
                                                                    "/work/vllm-venv")))


def first_difference(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]
                     ) -> tuple[int, list[str]] | None:
    """The first record that differs and its differing fields, or None."""
    for i in range(max(len(ours), len(theirs))):
        fields = differing_fields(ours[i] if i < len(ours) else {},
                                  theirs[i] if i < len(theirs) else {})
        if fields:
            return i, fields
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, cases=100)
    ap.add_argument("--large", action="store_true",
                    help="up to 40 requests a case, sequences up to 256 tokens")
    ap.add_argument("--edge", action="store_true",
                    help="edge-shaped cases (edge_cases.py) instead of random ones")
    ap.add_argument("--out", type=Path, default=Path("/tmp/oracle_diff"))
    args = ap.parse_args()
    cases = [edge_case(args.seed + k) if args.edge else random_case(args.seed + k, args.large)
             for k in range(args.cases)]
    theirs = run_oracle([dict(case, events=as_received(case["events"])) for case in cases],
                        args.venv)
    args.out.mkdir(parents=True, exist_ok=True)
    differ = 0
    steps = 0
    for case, oracle in zip(cases, theirs, strict=True):
        if "error" in oracle:
            print(f"seed {case['seed']}: the oracle failed: {oracle['error']}")
            differ += 1
            continue
        try:
            ours = trim_idle(run_events(case["config"], case["events"]))
        except Exception as exc:  # noqa: BLE001 - reported per case
            print(f"seed {case['seed']}: rt failed: {type(exc).__name__}: {exc}")
            differ += 1
            continue
        steps += len(ours)
        found = first_difference(ours, oracle["steps"])
        if found is None:
            continue
        i, fields = found
        rec = oracle["steps"][i] if i < len(oracle["steps"]) else {}
        differ += 1
        print(f"seed {case['seed']} {case.get('shape', '')}: record {i} "
              f"({rec.get('event')} {rec.get('step')}) "
              f"differs in {', '.join(fields)}")
        Path(args.out, f"case{case['seed']}.json").write_text(json.dumps(
            {"case": case, "rt": ours, "vllm": oracle["steps"], "first": i}, indent=1))
    print(f"{args.cases} cases, {steps} records from rt: {differ} differ")


if __name__ == "__main__":
    main()
