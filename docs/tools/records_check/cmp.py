"""Compare two records-check outputs: every parquet file under A must DataFrame.equals B's.

    python docs/tools/records_check/cmp.py A B   -> prints ALL EQUAL, or each difference (exit 1)
"""

import sys
from pathlib import Path

import pandas as pd


def main(a: Path, b: Path) -> int:
    files = sorted(p.relative_to(a) for p in a.rglob("*.parquet"))
    if not files:
        print(f"no parquet files under {a}")
        return 1
    bad = [f for f in files
           if not (b / f).exists() or not pd.read_parquet(a / f).equals(pd.read_parquet(b / f))]
    extra = sorted(p.relative_to(b) for p in b.rglob("*.parquet")
                   if not (a / p.relative_to(b)).exists())
    for f in bad:
        print(f"DIFFERENT: {f}")
    for f in extra:
        print(f"ONLY IN {b}: {f}")
    if bad or extra:
        return 1
    print(f"ALL EQUAL ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
