"""Every trace loader against random byte mutations of the fixture traces: each mutated file
loads or raises one `TraceError` (a ValueError) of one line, which the CLI prints as
`rt: error: ...` with exit 2; never another exception (a traceback)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from workloads import TraceError, load_trace

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = sorted(p for p in (ROOT / "tests" / "fixtures" / "traces").iterdir()
                  if p.suffix in (".csv", ".jsonl"))
MUTATIONS = int(os.environ.get("RT_LOADER_FUZZ_CASES", "30"))  # per fixture file


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to four edits: flip, insert or delete bytes, cut the file, or splice lines."""
    data = bytearray(data[:20000])  # the head is enough (the header and the first rows)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(data) + 1)
        kind = rng.choice(("flip", "insert", "delete", "cut", "junk", "dup"))
        if kind == "flip" and at < len(data):
            data[at] ^= 1 << rng.randrange(8)
        elif kind == "insert":
            data[at:at] = bytes([rng.choice(b',"\n\r{}[]:-.0123456789e\x00\xff ')])
        elif kind == "delete":
            del data[at:at + rng.randint(1, 16)]
        elif kind == "cut":
            del data[at:]
        elif kind == "junk":
            data[at:at] = rng.randbytes(rng.randint(1, 32))
        elif kind == "dup":
            data[at:at] = data[max(0, at - 200):at]
    return bytes(data)


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_mutated_traces_load_or_fail_in_one_line(fixture: Path, tmp_path: Path) -> None:
    rng = random.Random(fixture.name)
    original = fixture.read_bytes()
    failures = 0
    for case in range(MUTATIONS):
        path = tmp_path / f"m{case}{fixture.suffix}"
        path.write_bytes(mutate(original, rng))
        try:
            load_trace(path)
        except TraceError as err:
            failures += 1
            assert "\n" not in str(err), str(err)
        except Exception as err:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{fixture.name} mutation {case}: {type(err).__name__}: {err}")
    assert failures > 0  # the mutations do reach the validation


def test_a_mutated_trace_is_one_line_and_exit_2_on_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,"
                     b"\xff\xfe,7\n")
    done = subprocess.run([sys.executable, "-m", "cli", "simulate", "--trace", str(path),
                           "--result-dir", str(tmp_path / "run")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and done.stderr.startswith("rt: error:")
