"""Per-window view of the replays of an `rt fidelity --endpoint` (or `rt replay --endpoint`)
run directory: is the server steady, or does it stall now and then?

    python docs/measure/endpoint_windows.py RESULT_DIR [--window 10]

For each replay (warmup*, calibration*, real*, or RESULT_DIR itself when it is one replay),
in the order they ran: p50 / p90 TTFT and ITL (ms, client-side), the median TTFT of each
window of `--window` requests in arrival order, the windows whose median TTFT is more than
3x the median of the windows' medians ("stall windows": relative to the replay itself,
so a replay of 1-2 windows, or one that stalls in most of them, shows none), and the
longest in-flight silences: intervals of more than 50 ms in which at least one request was
in flight (sent, not finished) and no stream received a chunk. A server that stalls shows
them; one that is only slow does not.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

STALL_RATIO = 3.0  # a window's median TTFT above this many times the windows' median
SILENCE_S = 0.05  # in-flight intervals without any chunk longer than this are listed


def replays(result: Path) -> list[Path]:
    """The replay directories under `result` in the order they ran (by their records' mtime)."""
    if (result / "requests.parquet").exists():
        return [result]
    found = [p for p in result.iterdir()
             if p.is_dir() and (p / "requests.parquet").exists() and not p.name.startswith("sim")]
    return sorted(found, key=lambda p: (p / "requests.parquet").stat().st_mtime)


def silences(frame: pd.DataFrame) -> list[tuple[float, float]]:
    """(start s, length ms) of each in-flight interval longer than SILENCE_S without a chunk."""
    times = np.sort(np.concatenate([np.asarray(t) for t in frame.token_times_s if t is not None]))
    sent, done = frame.arrival_s.to_numpy(), frame.finish_s.to_numpy()
    out = []
    for lo, hi in zip(times[:-1], times[1:], strict=True):
        if hi - lo > SILENCE_S and np.any((sent < lo) & (done > hi)):
            out.append((float(lo), float((hi - lo) * 1e3)))
    # before the first chunk of the replay: from the first request's send
    if len(times) and times[0] - sent.min() > SILENCE_S:
        out.insert(0, (float(sent.min()), float((times[0] - sent.min()) * 1e3)))
    return out


def describe(path: Path, window: int) -> list[str]:
    """The lines printed for one replay."""
    frame = pd.read_parquet(path / "requests.parquet").sort_values("arrival_s")
    frame = frame[frame.first_token_s.notna()]
    if not any(t is not None and len(t) > 1 for t in frame.token_times_s):
        return [f"{path.name}: {len(frame)} requests with a first token; none with two "
                "chunks: nothing to measure"]
    ttft = (frame.first_token_s - frame.arrival_s).to_numpy() * 1e3
    itl = np.concatenate([np.diff(np.asarray(t)) * 1e3 for t in frame.token_times_s
                          if t is not None and len(t) > 1])
    medians = [float(np.median(ttft[i:i + window])) for i in range(0, len(ttft), window)]
    usual = float(np.median(medians))
    stalls = [i for i, m in enumerate(medians) if m > STALL_RATIO * usual]
    gaps = sorted(silences(frame), key=lambda g: -g[1])[:5]
    return [
        f"{path.name}: {len(frame)} requests, TTFT p50/p90 {np.percentile(ttft, 50):.1f} / "
        f"{np.percentile(ttft, 90):.1f} ms, ITL p50/p90 {np.percentile(itl, 50):.2f} / "
        f"{np.percentile(itl, 90):.2f} ms",
        f"  median TTFT per {window} requests (ms): " + " ".join(f"{m:.0f}" for m in medians),
        f"  stall windows (> {STALL_RATIO:g}x {usual:.1f} ms): {len(stalls)} of {len(medians)}"
        + (f" (windows {', '.join(str(i + 1) for i in stalls)})" if stalls else ""),
        "  longest in-flight silences (start s: ms): "
        + (", ".join(f"{s:.2f}: {ms:.0f}" for s, ms in gaps) if gaps else "none"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("--window", type=int, default=10)
    args = parser.parse_args()
    for path in replays(args.result):
        print("\n".join(describe(path, args.window)))


if __name__ == "__main__":
    main()
