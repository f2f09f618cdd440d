"""One markdown row per `rt fidelity --endpoint` result directory (docs/calibration.md's tables):
p50 / p90 TTFT and ITL, error (sim vs real), noise (real vs real) and drift (calibration vs
real replays), in percent; and the real replays' values in ms.

    python docs/measure/endpoint_fidelity_rows.py RESULT_DIR...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

METRICS = ("p50_ttft_ms", "p90_ttft_ms", "p50_itl_ms", "p90_itl_ms")


def row(result: Path) -> str:
    """The markdown row of one result directory."""
    metrics = json.loads((result / "fidelity.json").read_text())["metrics"]

    def cells(key: str, sign: bool) -> str:
        return " / ".join(f"{100 * metrics[m][key]:{'+' if sign else ''}.1f}" for m in METRICS)

    real = " / ".join(f"{metrics[m]['real']:.2f}" for m in METRICS)
    return (f"| {result.name} | {real} | {cells('error', True)}% | {cells('noise', False)}% "
            f"| {cells('drift', True)}% |")


def main() -> None:
    print("| run | real p50 / p90 TTFT, p50 / p90 ITL (ms) | error | noise | drift |")
    print("|---|---|---|---|---|")
    for arg in sys.argv[1:]:
        print(row(Path(arg)))


if __name__ == "__main__":
    main()
