"""`rt trace inspect` and `rt trace convert`'s own flags: how statistics are taken, which
format a trace is written in."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workloads.csv_formats import write_vidur_csv
from workloads.errors import TraceError
from workloads.flags import WorkloadFlags, all_rows_stats, load_workload
from workloads.rtformat import write_rt_jsonl
from workloads.stats import TraceStats, trace_stats
from workloads.timed_trace import write_timed_trace
from workloads.trace import Trace

WRITERS = ("rt", "vidur", "timed_trace")
# The WorkloadFlags fields a command on a trace file offers, and those of `rt trace gen`.
FILE_FLAGS = ("fmt", "trace_model", "hash_block_size", "request_rate", "burstiness", "seed",
              "start_s", "duration_s", "first_n", "time_scale", "target_rate", "max_model_len")
SYNTHETIC_FLAGS = ("fmt", "dataset_name", "dataset_path", "num_prompts", "input_len",
                   "output_len", "range_ratio", "prefix_len", "rep_prefix_len",
                   "rep_suffix_len", "rep_num_prefixes", "rep_output_len", "turns",
                   "turn_gap_s", "request_rate", "burstiness", "seed", "max_model_len")


def flag(default: Any, option: str, help: str) -> Any:  # runtime.flags.flag's metadata
    return field(default=default, metadata={"flag": option, "help": help, "panel": None})


@dataclass(frozen=True, slots=True)
class InspectFlags:
    json: bool = flag(False, "--json", "Print JSON instead of a table.")
    keep_failed: bool = flag(False, "--keep-failed", "Statistics over every row, failed rows "
                             "included.")
    block_size: int = flag(16, "--block-size", "Prefix-cache block (tokens) for prompts "
                           "without hash ids.")

    def stats(self, workload: WorkloadFlags, path: Path
              ) -> tuple[TraceStats, str, tuple[str, ...]]:
        """The statistics, the file's format and the loader's notes; TraceError on bad
        input."""
        if self.keep_failed:
            stats, kind = all_rows_stats(workload, path)
            return stats, kind, ()
        loaded = load_workload(workload, path)
        return trace_stats(loaded.trace, self.block_size), loaded.format, loaded.notes

    def report(self, workload: WorkloadFlags, path: Path) -> tuple[str, tuple[str, ...]]:
        """What `rt trace inspect` prints (the statistics as JSON with --json, else the
        table `workloads.report.render_stats`) and the loader's notes."""
        from workloads.report import render_stats

        stats, kind, notes = self.stats(workload, path)
        if self.json:
            data = {"file": str(path), "format": kind, **stats.to_dict()}
            return json.dumps(data, indent=2), notes
        return "\n".join(render_stats(stats, f"{path} ({kind})")), notes


@dataclass(frozen=True, slots=True)
class ConvertFlags:
    to: str = flag("rt", "--to", "Output format: rt (rt JSONL, lossless), vidur (CSV, times "
                   "and lengths only) or timed_trace (vLLM bench's JSONL, 16-token hash ids).")

    def __post_init__(self) -> None:
        if self.to not in WRITERS:
            raise TraceError("must be rt, vidur or timed_trace", column="--to", value=self.to)

    def write(self, trace: Trace, path: Path) -> None:
        writer = {"rt": write_rt_jsonl, "vidur": write_vidur_csv,
                  "timed_trace": write_timed_trace}[self.to]
        writer(trace, path)
