"""rt command line: the only module that touches argv, the environment and logging.

Each command builds frozen configs from its flags, calls one library function, and prints.
User errors (bad flags, bad files) become one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, NoReturn

import typer

import workloads
from workloads.report import clip_notes, load_notes, render_stats

app = typer.Typer(
    name="rt",
    help="LLM-serving runtime twin: one vLLM-V1 scheduler/KV core, simulated or real.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks that write JSON.", no_args_is_help=True)
trace_app = typer.Typer(help="Generate, inspect and convert request traces.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(trace_app, name="trace")


def fail(message: str) -> NoReturn:
    """Print one readable line for a user error and exit with status 2."""
    typer.echo(f"rt: error: {message}", err=True)
    raise typer.Exit(code=2)


def _write_json(data: object, out: Path | None) -> None:
    text = json.dumps(data, indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    sys.stdout.write(text + "\n")


# ---- rt trace ... (workloads) --------------------------------------------------------------
# (trace commands are defined below this line)

_Format = Annotated[str | None, typer.Option(
    "--format", help=f"Input format, one of {', '.join(workloads.FORMATS)} (default: detect).")]
_Model = Annotated[str | None, typer.Option(
    "--model", help="Keep only rows of this model (BurstGPT 'Model', e.g. GPT-4).")]
_HashBlock = Annotated[int | None, typer.Option(
    "--hash-block-size", help="Tokens per hash id (default: Mooncake 512, Bailian 16).")]
_Rate = Annotated[float, typer.Option(
    "--request-rate", help="Requests/s of the vLLM arrival process; inf = all at t = 0.")]
_Burst = Annotated[float, typer.Option(
    "--burstiness", help="Gamma shape of the gaps (1 = Poisson, <1 burstier, inf = constant).")]
_Seed = Annotated[int, typer.Option("--seed", help="Seed of every random draw (as vLLM).")]
_Start = Annotated[float | None, typer.Option(
    "--start", help="Window start, s from the trace start (arrivals re-timed to 0).")]
_Duration = Annotated[float | None, typer.Option("--duration", help="Window length in s.")]
_FirstN = Annotated[int | None, typer.Option("--first-n", help="Keep the first N requests.")]
_TimeScale = Annotated[float | None, typer.Option(
    "--time-scale", help="Multiply arrival times by this factor (2 = half the rate).")]
_TargetRate = Annotated[float | None, typer.Option(
    "--target-rate", help="Rescale arrival times to this mean rate (req/s).")]
_MaxLen = Annotated[int | None, typer.Option(
    "--max-model-len", help="Clip outputs to fit this context (tokens); drop prompts that "
    "do not fit. Counted and reported.")]


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Turn a workloads.TraceError (or an unwritable output) into one line and exit 2."""
    try:
        yield
    except workloads.TraceError as err:
        fail(str(err))
    except OSError as err:
        fail(f"{err.filename}: {err.strerror}")


def _note(lines: list[str]) -> None:
    for line in lines:
        typer.echo(f"rt: note: {line}", err=True)


def _load_transformed(
    file: Path, fmt: str | None, model: str | None, hash_block: int | None,
    arrivals: workloads.ArrivalProcess, spec: workloads.TransformSpec,
) -> tuple[workloads.Trace, str]:
    """Load, report what loading dropped, transform, report clipping; returns the format."""
    result = workloads.load_trace(file, fmt, model=model, arrivals=arrivals,
                                  hash_block_size=hash_block)
    _note(load_notes(result.report, model))
    trace, clip = workloads.apply_transforms(result.trace, spec)
    _note(clip_notes(clip, spec.max_model_len))
    return trace, result.report.format


@trace_app.command("inspect")
def trace_inspect(
    file: Path,
    fmt: _Format = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    keep_failed: Annotated[bool, typer.Option(
        "--keep-failed", help="Statistics over every row, failed rows included.")] = False,
    block_size: Annotated[int, typer.Option(
        "--block-size", help="Prefix-cache block (tokens) for prompts without hash ids.")] = 16,
    model: _Model = None, hash_block_size: _HashBlock = None,
    request_rate: _Rate = math.inf, burstiness: _Burst = 1.0, seed: _Seed = 0,
    start: _Start = None, duration: _Duration = None, first_n: _FirstN = None,
    time_scale: _TimeScale = None, target_rate: _TargetRate = None, max_model_len: _MaxLen = None,
) -> None:
    """Print a trace's statistics: rows, span, rates, burstiness, lengths, prefix reuse."""
    with _user_errors():
        spec = workloads.TransformSpec(start, duration, first_n, time_scale, target_rate,
                                       max_model_len)
        if keep_failed:
            stats, kind = _all_rows_stats(file, fmt, hash_block_size, model, spec)
        else:
            arrivals = workloads.ArrivalProcess(request_rate, burstiness, seed)
            trace, kind = _load_transformed(file, fmt, model, hash_block_size, arrivals, spec)
            stats = workloads.trace_stats(trace, block_size)
    if as_json:
        sys.stdout.write(json.dumps({"file": str(file), "format": kind, **stats.to_dict()},
                                    indent=2) + "\n")
    else:
        typer.echo("\n".join(render_stats(stats, f"{file} ({kind})")))


def _all_rows_stats(
    file: Path, fmt: str | None, hash_block: int | None, model: str | None,
    spec: workloads.TransformSpec,
) -> tuple[workloads.TraceStats, str]:
    if model is not None or spec != workloads.TransformSpec():
        raise workloads.TraceError("--keep-failed reads the file as is: it takes no --model "
                                   "and no transforms", column="--keep-failed", value=True)
    rows = workloads.read_rows(file, fmt, hash_block_size=hash_block)
    return workloads.rows_stats(rows), f"{rows.format}, all rows"


@trace_app.command("convert")
def trace_convert(
    src: Path, dst: Path,
    fmt: _Format = None,
    to: Annotated[str, typer.Option(
        "--to", help="Output format: rt (rt JSONL, lossless) or vidur (CSV, times and "
        "lengths only).")] = "rt",
    model: _Model = None, hash_block_size: _HashBlock = None,
    request_rate: _Rate = math.inf, burstiness: _Burst = 1.0, seed: _Seed = 0,
    start: _Start = None, duration: _Duration = None, first_n: _FirstN = None,
    time_scale: _TimeScale = None, target_rate: _TargetRate = None, max_model_len: _MaxLen = None,
) -> None:
    """Convert a trace file (any supported format) to rt JSONL or Vidur CSV."""
    with _user_errors():
        if to not in ("rt", "vidur"):
            raise workloads.TraceError("must be rt or vidur", column="--to", value=to)
        spec = workloads.TransformSpec(start, duration, first_n, time_scale, target_rate,
                                       max_model_len)
        arrivals = workloads.ArrivalProcess(request_rate, burstiness, seed)
        trace, _ = _load_transformed(src, fmt, model, hash_block_size, arrivals, spec)
        writer = workloads.write_rt_jsonl if to == "rt" else workloads.write_vidur_csv
        writer(trace, dst)
    typer.echo(f"wrote {len(trace)} requests to {dst} ({to})")


_DATASETS = ("random", "prefix_repetition", "multi_turn", "resample")


@trace_app.command("gen")
def trace_gen(
    output: Annotated[Path, typer.Option("-o", "--output", help="rt JSONL file to write.")],
    dataset_name: Annotated[str, typer.Option(
        "--dataset-name", help=f"One of {', '.join(_DATASETS)}.")] = "random",
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="Requests.")] = 1000,
    request_rate: _Rate = math.inf, burstiness: _Burst = 1.0, seed: _Seed = 0,
    input_len: Annotated[int, typer.Option("--random-input-len")] = 1024,
    output_len: Annotated[int, typer.Option("--random-output-len")] = 128,
    range_ratio: Annotated[float, typer.Option(
        "--random-range-ratio", help="Lengths uniform in [L(1-r), L(1+r)], 0 <= r < 1.")] = 0.0,
    prefix_len: Annotated[int, typer.Option(
        "--random-prefix-len", help="Shared prefix tokens before every prompt.")] = 0,
    rep_prefix: Annotated[int, typer.Option("--prefix-repetition-prefix-len")] = 256,
    rep_suffix: Annotated[int, typer.Option("--prefix-repetition-suffix-len")] = 256,
    rep_num: Annotated[int, typer.Option("--prefix-repetition-num-prefixes")] = 10,
    rep_output: Annotated[int, typer.Option("--prefix-repetition-output-len")] = 128,
    turns: Annotated[int, typer.Option("--multi-turn-num-turns")] = 4,
    turn_gap: Annotated[float, typer.Option(
        "--multi-turn-gap-s", help="Seconds between a conversation's turns.")] = 10.0,
    dataset_path: Annotated[Path | None, typer.Option(
        "--dataset-path", help="Trace whose lengths 'resample' draws from.")] = None,
    fmt: _Format = None, max_model_len: _MaxLen = None,
) -> None:
    """Generate a synthetic trace with `vllm bench serve` flags (same seed, same arrivals)."""
    with _user_errors():
        arrivals = workloads.ArrivalProcess(request_rate, burstiness, seed)
        lengths = workloads.RandomLengths(input_len, output_len, range_ratio, prefix_len)
        if dataset_name == "random":
            trace = workloads.random_trace(num_prompts, lengths, arrivals)
        elif dataset_name == "prefix_repetition":
            spec = workloads.PrefixRepetition(rep_prefix, rep_suffix, rep_num, rep_output)
            trace = workloads.prefix_repetition_trace(num_prompts, spec, arrivals)
        elif dataset_name == "multi_turn":
            conv = workloads.MultiTurn(turns, turn_gap, lengths)
            trace = workloads.multi_turn_trace(num_prompts, conv, arrivals)
        elif dataset_name == "resample":
            trace = workloads.resample_trace(_resample_source(dataset_path, fmt), num_prompts,
                                             arrivals)
        else:
            raise workloads.TraceError(f"must be one of {', '.join(_DATASETS)}",
                                       column="--dataset-name", value=dataset_name)
        trace, clip = workloads.apply_transforms(
            trace, workloads.TransformSpec(max_model_len=max_model_len))
        _note(clip_notes(clip, max_model_len))
        workloads.write_rt_jsonl(trace, output)
    typer.echo(f"wrote {len(trace)} requests to {output} ({dataset_name})")


def _resample_source(path: Path | None, fmt: str | None) -> workloads.Trace:
    if path is None:
        raise workloads.TraceError("resample needs a trace to draw lengths from",
                                   column="--dataset-path")
    result = workloads.load_trace(path, fmt)
    _note(load_notes(result.report, None))
    return result.trace


# ---- rt simulate -----------------------------------------------------------------------------


@app.command()
def simulate() -> None:
    """Run the engine core on its built-in scenario and print each step's decisions."""
    from rich.console import Console
    from rich.table import Table

    from sim.core_demo import run_seed_example

    table = Table(title="rt core: seed example (budget 6 tokens, block size 4)")
    for column in ("step", "scheduled tokens", "finished", "free blocks", "waiting", "why"):
        table.add_column(column)
    for row in run_seed_example():
        tokens = ", ".join(f"{r}:{n}" for r, n in row.num_scheduled_tokens.items())
        table.add_row(str(row.step), tokens, ",".join(row.finished), str(row.free_blocks),
                      str(row.waiting), row.wait_reason or "")
    Console().print(table)


# ---- rt bench ... ---------------------------------------------------------------------------


@bench_app.command("scheduler")
def bench_scheduler(
    seed: Annotated[int, typer.Option(help="Seed of the synthetic prompts.")] = 0,
    quick: Annotated[bool, typer.Option(help="Fewer steps (a smoke run).")] = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Also write the JSON here.")]
    = None,
) -> None:
    """Microseconds per step of schedule() + update_from_output(): 64/256/1024 running
    decodes with prefix caching, and a mixed chunked-prefill workload."""
    from sim.benchmarks import bench_scheduler as run

    _write_json(run(seed=seed, quick=quick), out)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
