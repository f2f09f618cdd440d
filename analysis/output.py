"""What commands write besides run directories: a JSON report (`--out`, and stdout), PNG
figures, and the default result directory (results/KIND-<local time>)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis.rundir import check_output_file


def default_dir(kind: str) -> Path:
    """results/KIND-YYYYmmdd-HHMMSS (local time): where a command writes without a path."""
    return Path("results") / f"{kind}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def checked_dir(result_dir: Path | None, kind: str, check: Callable[[Path], None]) -> Path:
    """--result-dir (default: results/KIND-<time>), checked before any work: a file or a
    directory of other things is never replaced (`analysis.rundir.check_run_path`, or
    `check_runs_root` for a sweep's or plan's root)."""
    path = result_dir or default_dir(kind)
    check(path)
    return path


def save_figures(figures: Mapping[str, Any], directory: Path,
                 log: Callable[[str], None]) -> None:
    """Each matplotlib figure as directory/STEM.png (90 dpi), then one `log` line naming
    them; nothing (no directory either) when there are none."""
    if not figures:
        return
    directory.mkdir(parents=True, exist_ok=True)
    for stem, figure in figures.items():
        figure.savefig(directory / f"{stem}.png", dpi=90)
    log(f"wrote {', '.join(f'{s}.png' for s in figures)} to {directory}")


@dataclass(frozen=True, slots=True)
class JsonOut:
    """--out/-o of the commands that print a JSON report: also write it to that file."""

    out: Path | None = field(default=None, metadata={
        "flag": "--out", "short": "-o", "help": "Also write the JSON here.", "panel": None})

    def __post_init__(self) -> None:
        check_output_file(self.out, "--out")  # before the benchmark runs

    def write(self, data: object) -> str:
        """The report as indented JSON, written to --out (its directory made) when given;
        returns the text for stdout."""
        text = json.dumps(data, indent=2)
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(text + "\n")
        return text
