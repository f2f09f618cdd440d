"""One markdown row per `rt fidelity --fleet` run of docs/measure/fleet_fidelity.sh.

    python docs/measure/fleet_fidelity_rows.py OUT

Reads OUT/<router>-<side>-<round.run>/fleet_fidelity.json, its sim/run.json and the
<dir>.load file the script wrote (load average before, after, and the end time), and prints
the runs by router then time: shares, hit rates, p50/p90 TTFT real / sim, the fitted stack,
the noise floor, the calibration windows' real - twin p50 and, when both windows replayed
the same requests, their paired real TTFT after minus before (runs without: "-"),
then a count of the runs that met each TTFT goal per router and side. Standard library only.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

HEADER = ("| router | checkout | run | end (UTC) | load before/after | share max (sorted) / hit "
          "rate real=sim | p50 TTFT real / sim (ms) | p90 TTFT real / sim (ms) | stack fitted "
          "(ms + us/token) | noise floor p50 / p90 | windows' real - twin p50 before / after "
          "(ms) | same requests after - before: median ms, slower |")


def _latency(c: dict, key: str) -> str:
    row = c["latency"][key]
    return f"{row['real']:.2f} / {row['sim']:.2f} ({row['error']:+.1%})"


def _floor(stack: dict) -> tuple[str, str, str]:
    floor = stack.get("noise_floor") or {}
    if not floor.get("measured"):
        return "-", "-", "-"
    gaps = " / ".join(f"{w['gap_p50_ms']:.2f}" for w in floor["windows"])
    same = floor.get("same_requests")  # since fid15d: both windows the same requests
    paired = (f"{same['after_minus_before_p50_ms']:+.2f}, {same['slower_after']} of "
              f"{same['requests']}" if same else "-")
    return f"{floor['p50_ttft']:.1%} / {floor['p90_ttft']:.1%}", gaps, paired


def row(run: Path) -> tuple[str, str, str, dict[str, bool]]:
    """(router, end time, the markdown row, the goals) of one run directory."""
    router, side, tag = run.name.rsplit("-", 2)
    c = json.loads((run / "fleet_fidelity.json").read_text())
    stack = json.loads((run / "sim" / "run.json").read_text())["fleet"]["serving_stack"]
    before, after, end = (Path(f"{run}.load").read_text().split() + ["?"] * 3)[:3]
    hits = c["prefix_hit_rate"]
    fitted = (f"{stack['per_request_ms']:.2f} + {stack['per_prompt_token_us']:.2f}"
              if stack.get("fitted") else "-")
    floor, gaps, paired = _floor(stack)
    cells = [router, side, tag, end, f"{before}/{after}",
             f"{c['share']['sorted_max_points']:.1f} / {hits['real']:.1%}="
             f"{hits['sim']:.1%}", _latency(c, "p50_ttft_ms"), _latency(c, "p90_ttft_ms"),
             fitted, floor, gaps, paired]
    return router, end, "| " + " | ".join(cells) + " |", c["goals"]


def main(out: Path) -> None:
    runs = sorted((row(d) for d in out.iterdir() if (d / "fleet_fidelity.json").is_file()),
                  key=lambda r: (r[0], r[1]))
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    met: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for router, _, text, goals in runs:
        print(text)
        side = text.split(" | ")[1]
        met[router, side][0] += all(goals.values())
        met[router, side][1] += 1
    for (router, side), (n, total) in sorted(met.items()):
        print(f"{router} {side}: every goal met in {n} of {total} runs")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
