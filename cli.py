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
from typing import TYPE_CHECKING, Annotated, NoReturn

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
_StepNoise = Annotated[bool, typer.Option(
    "--step-noise", help="Scatter each step's predicted time as the profile's calibration "
    "steps scattered around the fit (needs a profile fitted on replay steps; seeded; "
    "raises the tails of TTFT, which waits for the step in progress; with the profile's "
    "drift table, also per the profile's drift window).")]
_StepDrift = Annotated[bool, typer.Option(
    "--step-drift", help="Fit the step-time scatter as a per-step factor times a slow drift "
    "per 0.25 s window (the machine's slow and fast periods) instead of i.i.d. per step. "
    "Off by default: on this project's CPU VM it did not beat i.i.d. scatter (README).",
    rich_help_panel="Calibration")]


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Bad input (a ValueError from the libraries, workloads.TraceError included: they name
    the field and value) or an unreadable/unwritable file: one line, exit 2."""
    try:
        yield
    except ValueError as err:
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
        "--to", help="Output format: rt (rt JSONL, lossless), vidur (CSV, times and "
        "lengths only) or timed_trace (vLLM bench's JSONL, 16-token hash ids).")] = "rt",
    model: _Model = None, hash_block_size: _HashBlock = None,
    request_rate: _Rate = math.inf, burstiness: _Burst = 1.0, seed: _Seed = 0,
    start: _Start = None, duration: _Duration = None, first_n: _FirstN = None,
    time_scale: _TimeScale = None, target_rate: _TargetRate = None, max_model_len: _MaxLen = None,
) -> None:
    """Convert a trace file (any supported format) to rt JSONL or Vidur CSV."""
    with _user_errors():
        if to not in ("rt", "vidur", "timed_trace"):
            raise workloads.TraceError("must be rt, vidur or timed_trace", column="--to",
                                       value=to)
        spec = workloads.TransformSpec(start, duration, first_n, time_scale, target_rate,
                                       max_model_len)
        arrivals = workloads.ArrivalProcess(request_rate, burstiness, seed)
        trace, _ = _load_transformed(src, fmt, model, hash_block_size, arrivals, spec)
        writer = {"rt": workloads.write_rt_jsonl, "vidur": workloads.write_vidur_csv,
                  "timed_trace": workloads.write_timed_trace}[to]
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
        trace = _synthetic_trace(
            dataset_name, num_prompts, arrivals, lengths,
            workloads.PrefixRepetition(rep_prefix, rep_suffix, rep_num, rep_output),
            workloads.MultiTurn(turns, turn_gap, lengths), dataset_path, fmt)
        trace, clip = workloads.apply_transforms(
            trace, workloads.TransformSpec(max_model_len=max_model_len))
        _note(clip_notes(clip, max_model_len))
        workloads.write_rt_jsonl(trace, output)
    typer.echo(f"wrote {len(trace)} requests to {output} ({dataset_name})")


def _synthetic_trace(
    dataset_name: str, num_prompts: int, arrivals: workloads.ArrivalProcess,
    lengths: workloads.RandomLengths, repetition: workloads.PrefixRepetition,
    conversation: workloads.MultiTurn, dataset_path: Path | None, fmt: str | None,
) -> workloads.Trace:
    if dataset_name == "random":
        return workloads.random_trace(num_prompts, lengths, arrivals)
    if dataset_name == "prefix_repetition":
        return workloads.prefix_repetition_trace(num_prompts, repetition, arrivals)
    if dataset_name == "multi_turn":
        return workloads.multi_turn_trace(num_prompts, conversation, arrivals)
    if dataset_name == "resample":
        return workloads.resample_trace(_resample_source(dataset_path, fmt), num_prompts,
                                        arrivals)
    raise workloads.TraceError(f"must be one of {', '.join(_DATASETS)}",
                               column="--dataset-name", value=dataset_name)


def _resample_source(path: Path | None, fmt: str | None) -> workloads.Trace:
    if path is None:
        raise workloads.TraceError("resample needs a trace to draw lengths from",
                                   column="--dataset-path")
    result = workloads.load_trace(path, fmt)
    _note(load_notes(result.report, None))
    return result.trace


# ---- rt simulate -----------------------------------------------------------------------------


_Engine = "Engine (vLLM flags)"
_Work = "Workload"
# Engine flags shared by `rt simulate` and `rt replay`, by their vLLM names.
_MaxBatched = Annotated[int | None, typer.Option(
    "--max-num-batched-tokens", help="Token budget per step (default: vLLM's for the device).",
    rich_help_panel=_Engine)]
_MaxSeqs = Annotated[int | None, typer.Option(
    "--max-num-seqs", help="Running requests at most (default: vLLM's for the device).",
    rich_help_panel=_Engine)]
_EngineMaxLen = Annotated[int | None, typer.Option(
    "--max-model-len", help="Default: the model's max_position_embeddings.",
    rich_help_panel=_Engine)]
_BlockSize = Annotated[int, typer.Option("--block-size", rich_help_panel=_Engine)]
_PrefixCaching = Annotated[bool, typer.Option(
    "--enable-prefix-caching/--no-enable-prefix-caching", rich_help_panel=_Engine)]
_ChunkedPrefill = Annotated[bool, typer.Option(
    "--enable-chunked-prefill/--no-enable-chunked-prefill", rich_help_panel=_Engine)]
_LongPrefill = Annotated[int, typer.Option(
    "--long-prefill-token-threshold", rich_help_panel=_Engine)]
_Policy = Annotated[str, typer.Option("--policy", help="fcfs or priority.",
                                      rich_help_panel=_Engine)]
_NumBlocks = Annotated[int | None, typer.Option(
    "--num-gpu-blocks-override", help="KV blocks (overrides every other sizing).",
    rich_help_panel=_Engine)]
_Percentiles = Annotated[str, typer.Option(
    "--metric-percentiles", help="Comma-separated percentiles, e.g. 50,90,99.")]
_CheckInvariants = Annotated[bool, typer.Option(
    "--check-invariants", help="Check the KV pool after every step (slow).")]


@app.command()
def simulate(
    trace_file: Annotated[Path | None, typer.Option(
        "--trace", help="Trace file (any `rt trace` format). Default: the embedded excerpt "
        "of the Azure conversation trace (first 10 min), unless --dataset-name is given.",
        rich_help_panel=_Work)] = None,
    fmt: _Format = None,
    dataset_name: Annotated[str | None, typer.Option(
        "--dataset-name", help=f"Synthetic workload instead of a trace: {', '.join(_DATASETS)}.",
        rich_help_panel=_Work)] = None,
    dataset_path: Annotated[Path | None, typer.Option(
        "--dataset-path", help="Trace whose lengths 'resample' draws from.",
        rich_help_panel=_Work)] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", rich_help_panel=_Work)] = 1000,
    request_rate: _Rate = math.inf, burstiness: _Burst = 1.0,
    input_len: Annotated[int, typer.Option("--random-input-len", rich_help_panel=_Work)] = 1024,
    output_len: Annotated[int, typer.Option("--random-output-len", rich_help_panel=_Work)] = 128,
    range_ratio: Annotated[float, typer.Option("--random-range-ratio",
                                               rich_help_panel=_Work)] = 0.0,
    prefix_len: Annotated[int, typer.Option("--random-prefix-len", rich_help_panel=_Work)] = 0,
    start: _Start = None, duration: _Duration = None, first_n: _FirstN = None,
    time_scale: _TimeScale = None, target_rate: _TargetRate = None,
    max_num_batched_tokens: _MaxBatched = None, max_num_seqs: _MaxSeqs = None,
    max_model_len: _EngineMaxLen = None, block_size: _BlockSize = 16,
    prefix_caching: _PrefixCaching = True, chunked_prefill: _ChunkedPrefill = True,
    long_prefill: _LongPrefill = 0,
    policy: _Policy = "fcfs",
    num_gpu_blocks: _NumBlocks = None,
    memory_utilization: Annotated[float, typer.Option(
        "--gpu-memory-utilization", rich_help_panel=_Engine)] = 0.92,
    tensor_parallel: Annotated[int, typer.Option(
        "--tensor-parallel-size", "-tp", rich_help_panel=_Engine)] = 1,
    model: Annotated[str, typer.Option(
        "--model", help="Preset (llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, mistral-7b, ...) or "
        "a local HF model directory / config.json.")] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option(
        "--gpu", help="a100-80gb, h100-sxm, h200, b200 or l40s.")] = "h200",
    profile: Annotated[str | None, typer.Option(
        "--profile", help="Calibrated cost-model profile (JSON); default: the roofline.")]
    = None,
    step_noise: _StepNoise = False,
    seed: _Seed = 0,
    result_dir: Annotated[Path | None, typer.Option(
        "--result-dir", help="Run directory to write (default: results/simulate-<time>).")]
    = None,
    metric_percentiles: _Percentiles = "99",
    check_invariants: _CheckInvariants = False,
) -> None:
    """Simulate a trace through the vLLM-V1 core on a simulated clock (no GPU).

    Prints vLLM's start-up lines and "Serving Benchmark Result" block, then where the time
    went. TPOT = (E2EL - TTFT) / (output tokens - 1), vLLM's definition (guidellm calls
    this ITL); ITL = every gap between consecutive tokens.
    """
    from sim.engine_args import EngineArgs, build_setup

    with _user_errors():
        percentiles = _parse_percentiles(metric_percentiles)
        if trace_file is not None and dataset_name is not None:
            fail("give either --trace or --dataset-name, not both")
        arrivals = workloads.ArrivalProcess(request_rate, burstiness, seed)
        if dataset_name is None:  # a trace file; its arrival flags serve length-only files
            result = workloads.load_trace(trace_file or workloads.DEFAULT_TRACE_PATH, fmt,
                                          arrivals=arrivals)
            _note(load_notes(result.report, None))
            trace = result.trace
        else:
            lengths = workloads.RandomLengths(input_len, output_len, range_ratio, prefix_len)
            trace = _synthetic_trace(
                dataset_name, num_prompts, arrivals, lengths, workloads.PrefixRepetition(),
                workloads.MultiTurn(lengths=lengths), dataset_path, fmt)
        trace, _ = workloads.apply_transforms(trace, workloads.TransformSpec(
            start_s=start, duration_s=duration, first_n=first_n, time_scale=time_scale,
            target_rate=target_rate))
        if len(trace) == 0:
            fail(f"the workload has no requests to simulate ({trace.name or 'trace'})")
        args = EngineArgs(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, block_size=block_size,
            enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked_prefill,
            long_prefill_token_threshold=long_prefill, policy=policy,
            num_gpu_blocks_override=num_gpu_blocks, gpu_memory_utilization=memory_utilization,
            tensor_parallel_size=tensor_parallel)
        setup = build_setup(args, model, gpu, profile, seed, check_invariants, step_noise)
        configured_rate = request_rate if dataset_name is not None else None
        _run_simulation(trace, setup, result_dir, percentiles, configured_rate)


def _parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        fail(f"--metric-percentiles: not a comma-separated list of numbers: {text!r}")
    if not values or any(not 0 < p < 100 for p in values):
        fail(f"--metric-percentiles: each must be in (0, 100), got {text!r}")
    return values


def _run_simulation(trace: workloads.Trace, setup: object, result_dir: Path | None,
                    percentiles: list[float], request_rate: float | None) -> None:
    import datetime

    from analysis.console import benchmark_block, rt_block
    from analysis.metrics import benchmark_metrics
    from analysis.rundir import load_run, write_run
    from sim.engine_args import SimSetup
    from sim.simulator import simulate

    assert isinstance(setup, SimSetup)
    for line in setup.startup_lines:
        typer.echo(line, err=True)
    with _progress(len(trace)) as progress:
        result = simulate(trace, setup.config, setup.cost_model, progress)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = result_dir or Path("results") / f"simulate-{stamp}"
    info = {
        "kind": "simulate", "rt_version": _version(), "name": path.name,
        "trace": {"name": trace.name, "requests": len(trace),
                  "digest": workloads.trace_digest(trace)},
        "wall_s": round(result.wall_s, 3),
        "prefix_cache": {"queries": result.prefix_cache_queries,
                         "hits": result.prefix_cache_hits},
        **setup.describe(),
    }
    write_run(path, [r.to_row() for r in result.requests], result.step_columns, info)
    run = load_run(path)
    hit_rate = result.prefix_cache_hits / max(result.prefix_cache_queries, 1)
    typer.echo(benchmark_block(benchmark_metrics(run.requests, percentiles),
                               percentiles=percentiles, request_rate=request_rate))
    typer.echo(rt_block(run.requests, run.steps, hit_rate))
    typer.echo(f"rt: wrote {path} ({len(trace)} requests, {result.num_steps} steps, "
               f"{result.wall_s:.2f} s wall)", err=True)


@contextlib.contextmanager
def _progress(total: int) -> Iterator[object]:
    """A rich progress bar on stderr, shown only once a run has taken a second."""
    import time

    from rich.console import Console
    from rich.progress import Progress

    started = time.perf_counter()
    bar: Progress | None = None
    task = 0

    def update(done: int, _total: int) -> None:
        nonlocal bar, task
        if bar is None:
            if time.perf_counter() - started < 1.0:
                return
            bar = Progress(console=Console(stderr=True), transient=True)
            bar.start()
            task = bar.add_task("simulating", total=total)
        bar.update(task, completed=done)

    try:
        yield update
    finally:
        if bar is not None:
            bar.stop()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rt")
    except PackageNotFoundError:
        return "unknown"


# ---- rt report / compare / sweep (analysis) ---------------------------------------------------
# (analysis commands are defined below this line)

_PctMetrics = Annotated[str, typer.Option(
    "--percentile-metrics", help="Metrics to report percentiles of: ttft,tpot,itl,e2el "
    "(vLLM's; e2el keys appear in the JSON only when selected).")]
_MetricPcts = Annotated[str, typer.Option(
    "--metric-percentiles", help="Comma-separated percentiles, e.g. 50,90,99,99.9.")]
_Goodput = Annotated[list[str] | None, typer.Option(
    "--goodput", help="SLOs in ms, KEY:MS with KEY ttft, tpot or e2el (repeat, or comma-"
    "separate): a request is good if it meets every one. Adds request_goodput.")]


def _report_options(percentile_metrics: str, metric_percentiles: str,
                    goodput: list[str] | None) -> object:
    from analysis.metrics import parse_goodput, parse_metric_percentiles, parse_percentile_metrics
    from analysis.report import ReportOptions

    return ReportOptions(parse_percentile_metrics(percentile_metrics),
                         parse_metric_percentiles(metric_percentiles),
                         parse_goodput(goodput or []))


def _load_checked(path: Path) -> object:
    from analysis.report import check_run
    from analysis.rundir import load_run

    run = load_run(path)
    check_run(run)
    return run


def _save_figures(figures: dict[str, object], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for stem, figure in figures.items():
        figure.savefig(directory / f"{stem}.png", dpi=90)  # type: ignore[attr-defined]
    typer.echo(f"rt: wrote {', '.join(f'{s}.png' for s in figures)} to {directory}", err=True)


@app.command("report")
def report(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (rt simulate / rt replay).")],
    save_result: Annotated[bool, typer.Option(
        "--save-result", help="Write the result JSON (vLLM's keys) to RUN/result.json or "
        "--result-filename.")] = False,
    result_filename: Annotated[Path | None, typer.Option(
        "--result-filename", help="JSON file to write (implies --save-result).")] = None,
    save_detailed: Annotated[bool, typer.Option(
        "--save-detailed", help="Add vLLM's per-request arrays to the JSON and write the "
        "per-request attribution next to it (.attribution.csv).")] = False,
    percentile_metrics: _PctMetrics = "ttft,tpot,itl",
    metric_percentiles: _MetricPcts = "99",
    goodput: _Goodput = None,
    plot_dir: Annotated[Path | None, typer.Option(
        "--plot-dir", help="Where the PNGs go (default: RUN/plots).")] = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Draw the PNGs.")] = True,
) -> None:
    """Report one run with vLLM's metrics, where the time went (all requests and the slowest
    1%/10% by TTFT and E2E), and plots: percentile curves, CDFs, attribution, timeline.

    TPOT = (E2EL - TTFT) / (output tokens - 1), vLLM's (guidellm calls it ITL); ITL = every
    gap between consecutive tokens, pooled.
    """
    from analysis.attribution import (
        attribution_buckets,
        attribution_summary,
        render_summary,
        request_attribution,
    )
    from analysis.console import benchmark_block, is_client_timed, rt_block
    from analysis.metrics import benchmark_metrics, prefix_cache_hit_rate
    from analysis.plots import report_figures
    from analysis.report import ReportOptions, detailed, result_dict

    with _user_errors():
        options = _report_options(percentile_metrics, metric_percentiles, goodput)
        assert isinstance(options, ReportOptions)
        run = _load_checked(run_dir)
        home = run_dir if run_dir.is_dir() else run_dir.with_suffix("")  # a vLLM bench JSON
        result = result_dict(run, options)  # type: ignore[arg-type]
        reqs, steps = run.requests, run.steps  # type: ignore[attr-defined]
        typer.echo(benchmark_block(
            benchmark_metrics(reqs, options.percentiles), options.percentile_metrics,
            options.percentiles, goodput=result["request_goodput"]))
        client = is_client_timed(run.info)  # type: ignore[attr-defined]
        typer.echo(rt_block(reqs, steps, prefix_cache_hit_rate(reqs, run.info),  # type: ignore[attr-defined]
                            client_timing=client))
        if not client:
            typer.echo(render_summary(attribution_summary(reqs)))
        if save_result or result_filename is not None:
            out = result_filename or home / "result.json"
            if save_detailed:
                result.update(detailed(run))  # type: ignore[arg-type]
                request_attribution(reqs).to_csv(out.with_suffix(".attribution.csv"),
                                                 index=False)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
            typer.echo(f"rt: wrote {out}", err=True)
        if plots:
            _save_figures(report_figures(reqs, steps, run.name,  # type: ignore[attr-defined]
                                         attribution_buckets(reqs, "ttft"),
                                         attribution_buckets(reqs, "e2el")),
                          plot_dir or home / "plots")


@app.command("compare")
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories (two or more).")],
    percentile_metrics: _PctMetrics = "ttft,tpot,itl,e2el",
    metric_percentiles: _MetricPcts = "50,90,99",
    goodput: _Goodput = None,
    csv: Annotated[Path | None, typer.Option("--csv", help="Also write the table here.")]
    = None,
    plot_dir: Annotated[Path | None, typer.Option(
        "--plot-dir", help="Where the overlaid curves go (default: results/compare-<time>).")]
    = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots")] = True,
) -> None:
    """Compare runs of one workload side by side: rows = metrics, columns = runs, and a
    ratio column against the first run; overlaid percentile curves and CDFs whose legend
    names what differs (budget, model, sim vs real...)."""
    import datetime

    from analysis.compare import check_compatible, compare_table, render_table, run_labels
    from analysis.plots import cdfs, latency_values, percentile_curves
    from analysis.report import result_dict

    with _user_errors():
        if len(run_dirs) < 2:
            raise ValueError("compare needs two or more run directories")
        options = _report_options(percentile_metrics, metric_percentiles, goodput)
        runs = [_load_checked(path) for path in run_dirs]
        check_compatible(runs)  # type: ignore[arg-type]
        labels = run_labels(runs)  # type: ignore[arg-type]
        table = compare_table([result_dict(r, options) for r in runs], labels)  # type: ignore[arg-type]
        typer.echo(render_table(table))
        if csv is not None:
            table.to_csv(csv)
        if plots:
            series = {label: latency_values(r.requests)  # type: ignore[attr-defined]
                      for label, r in zip(labels, runs, strict=True)}
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            _save_figures({"percentiles": percentile_curves(series), "cdf": cdfs(series)},
                          plot_dir or Path("results") / f"compare-{stamp}")



_Grid = "Sweep grid (comma-separated values)"
_Search = "SLO search"
_ENGINE_LISTS = {  # option -> EngineArgs field
    "max_num_batched_tokens": int, "max_num_seqs": int, "long_prefill_token_threshold": int,
    "num_gpu_blocks_override": int, "block_size": int,
}


def _int_list(option: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option}: not a comma-separated list of integers: {text!r}") from None


def _float_list(option: str, text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option}: not a comma-separated list of numbers: {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"{option}: each value must be > 0, got {text!r}")
    return values


def _sweep_worker(job: tuple[object, object, str]) -> dict[str, object]:
    """One sweep run (in a pool process or a Ray task): simulate, write the run directory,
    report it from the files."""
    from analysis.report import result_dict
    from analysis.rundir import load_run, write_run
    from sim.sweep import SweepPoint, simulate_point

    point, options, run_dir = job
    assert isinstance(point, SweepPoint)
    result, setup = simulate_point(point)
    path = Path(run_dir)
    info = {
        "kind": "simulate", "rt_version": _version(), "name": path.name,
        "sweep": dict(point.labels),
        "trace": {"name": point.trace.name, "requests": len(point.trace),
                  "digest": workloads.trace_digest(point.trace)},
        "wall_s": round(result.wall_s, 3),
        "prefix_cache": {"queries": result.prefix_cache_queries,
                         "hits": result.prefix_cache_hits},
        **setup.describe(),
    }
    if "request_rate" in point.labels:
        info["request_rate"] = point.labels["request_rate"]
    write_run(path, [r.to_row() for r in result.requests], result.step_columns, info)
    record = result_dict(load_run(path), options)  # type: ignore[arg-type]
    return {**point.labels, **record, "run_dir": str(path)}


def _sweep_traces(trace_file: Path | None, fmt: str | None, synthetic: dict[str, object] | None,
                  window: workloads.TransformSpec, rates: list[float] | None,
                  scales: list[float] | None) -> object:
    """A function rate-axis value -> (labels, trace), and the axis values."""
    base = None
    if synthetic is None:
        result = workloads.load_trace(trace_file or workloads.DEFAULT_TRACE_PATH, fmt)
        _note(load_notes(result.report, None))
        base, _ = workloads.apply_transforms(result.trace, window)

    def make(key: str | None, value: float | None) -> tuple[dict[str, object], object]:
        if synthetic is not None:
            rate = value if key == "request_rate" else math.inf
            arrivals = workloads.ArrivalProcess(rate, synthetic["burstiness"],  # type: ignore[arg-type]
                                                synthetic["seed"])  # type: ignore[arg-type]
            trace = workloads.random_trace(synthetic["num_prompts"], synthetic["lengths"],  # type: ignore[arg-type]
                                           arrivals)
        elif key is None:
            trace = base
        else:
            spec = (workloads.TransformSpec(target_rate=value) if key == "request_rate"
                    else workloads.TransformSpec(time_scale=value))
            trace, _ = workloads.apply_transforms(base, spec)  # type: ignore[arg-type]
        return ({} if key is None else {key: value}), trace

    return make, base


@app.command("sweep")
def sweep(
    trace_file: Annotated[Path | None, typer.Option(
        "--trace", help="Trace file; default: the embedded Azure conversation excerpt.")] = None,
    fmt: _Format = None,
    dataset_name: Annotated[str | None, typer.Option(
        "--dataset-name", help="'random' for vLLM's synthetic workload instead of a trace.")]
    = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts")] = 1000,
    input_len: Annotated[int, typer.Option("--random-input-len")] = 1024,
    output_len: Annotated[int, typer.Option("--random-output-len")] = 128,
    range_ratio: Annotated[float, typer.Option("--random-range-ratio")] = 0.0,
    burstiness: _Burst = 1.0, seed: _Seed = 0,
    start: _Start = None, duration: _Duration = None, first_n: _FirstN = None,
    request_rate: Annotated[str | None, typer.Option(
        "--request-rate", help="Rates (req/s): vLLM's arrival rate for --dataset-name, the "
        "trace rescaled to this mean rate for a trace.", rich_help_panel=_Grid)] = None,
    time_scale: Annotated[str | None, typer.Option(
        "--time-scale", help="Trace arrival-time factors (0.5 = twice the rate).",
        rich_help_panel=_Grid)] = None,
    max_num_batched_tokens: Annotated[str | None, typer.Option(
        "--max-num-batched-tokens", rich_help_panel=_Grid)] = None,
    max_num_seqs: Annotated[str | None, typer.Option("--max-num-seqs",
                                                     rich_help_panel=_Grid)] = None,
    long_prefill: Annotated[str | None, typer.Option(
        "--long-prefill-token-threshold", rich_help_panel=_Grid)] = None,
    num_gpu_blocks: Annotated[str | None, typer.Option(
        "--num-gpu-blocks-override", rich_help_panel=_Grid)] = None,
    block_size: Annotated[str | None, typer.Option("--block-size", rich_help_panel=_Grid)]
    = None,
    model: Annotated[str, typer.Option("--model", rich_help_panel=_Grid)] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option("--gpu", rich_help_panel=_Grid)] = "h200",
    profile: Annotated[str | None, typer.Option("--profile")] = None,
    percentile_metrics: _PctMetrics = "ttft,tpot,itl,e2el",
    metric_percentiles: _MetricPcts = "50,90,99",
    goodput: _Goodput = None,
    slo: Annotated[str | None, typer.Option(
        "--slo", help="Upper bounds on result keys, e.g. p99_ttft_ms=500,p99_itl_ms=50.",
        rich_help_panel=_Search)] = None,
    find_max_rate: Annotated[bool, typer.Option(
        "--find-max-rate", help="Bisect the request rate for the highest one meeting every "
        "--slo, per engine configuration.", rich_help_panel=_Search)] = False,
    rate_range: Annotated[str | None, typer.Option(
        "--rate-range", help="LO,HI req/s bracket of the search (default: the --request-rate "
        "extremes, else 0.5x to 8x the trace's rate).", rich_help_panel=_Search)] = None,
    rate_tolerance: Annotated[float, typer.Option(
        "--rate-tolerance", help="Stop when (hi - lo) / hi is this small.",
        rich_help_panel=_Search)] = 0.05,
    executor: Annotated[str, typer.Option(
        "--executor", help="local (process pool) or ray (Ray tasks; pip install 'rt[ray]').")]
    = "local",
    address: Annotated[str | None, typer.Option(
        "--address", help="Ray cluster address (default: a local Ray instance).")] = None,
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", help="Parallel runs (default: the CPU count).")] = None,
    result_dir: Annotated[Path | None, typer.Option(
        "--result-dir", help="Sweep directory (default: results/sweep-<time>).")] = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots")] = True,
) -> None:
    """Simulate a grid of engine flags x request rates on one trace, in parallel; print a
    results table and draw latency against each swept flag and against rate (knee marked).

    With --slo and --find-max-rate: bisect the rate for the highest one meeting every SLO."""
    import datetime
    import itertools

    from analysis.report import ReportOptions
    from analysis.sweep import parse_slo, slo_needs
    from sim.engine_args import EngineArgs

    with _user_errors(), _user_errors():
        options = _report_options(percentile_metrics, metric_percentiles, goodput)
        assert isinstance(options, ReportOptions)
        slos = parse_slo(slo) if slo is not None else None
        if slos:
            need_m, need_p = slo_needs(slos)
            options = ReportOptions(
                list(dict.fromkeys([*options.percentile_metrics, *need_m])),
                sorted(set(options.percentiles) | set(need_p)), options.goodput)
        if find_max_rate and not slos:
            raise ValueError("--find-max-rate needs --slo")
        if executor not in ("local", "ray"):
            raise ValueError(f"--executor must be local or ray, got {executor!r}")
        rates = _float_list("--request-rate", request_rate)
        scales = _float_list("--time-scale", time_scale)
        if rates and scales:
            raise ValueError("give --request-rate or --time-scale, not both")
        synthetic = None
        if dataset_name is not None:
            if dataset_name != "random" or trace_file is not None or scales:
                raise ValueError("sweep's synthetic workload is --dataset-name random, "
                                 "without --trace or --time-scale")
            synthetic = {"num_prompts": num_prompts, "burstiness": burstiness, "seed": seed,
                         "lengths": workloads.RandomLengths(input_len, output_len,
                                                            range_ratio)}
        lists = {name: _int_list("--" + name.replace("_", "-"), text) for name, text in (
            ("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs),
            ("long_prefill_token_threshold", long_prefill),
            ("num_gpu_blocks_override", num_gpu_blocks), ("block_size", block_size))}
        flags = {name: values for name, values in lists.items() if values}
        models, gpus = model.split(","), gpu.split(",")
        make, base = _sweep_traces(trace_file, fmt, synthetic, workloads.TransformSpec(
            start_s=start, duration_s=duration, first_n=first_n), rates, scales)
        configs = []
        for combo in itertools.product(*flags.values(), models, gpus):
            named = dict(zip(flags, combo[:len(flags)], strict=True))
            labels = dict(named)
            if len(models) > 1:
                labels["model"] = combo[-2]
            if len(gpus) > 1:
                labels["gpu"] = combo[-1]
            configs.append((labels, EngineArgs(**named), combo[-2], combo[-1]))
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        root = result_dir or Path("results") / f"sweep-{stamp}"
        counter = itertools.count()

        def job(config: tuple, key: str | None, value: float | None) -> tuple:
            from sim.sweep import SweepPoint

            labels, args, model_name, gpu_name = config
            rate_labels, trace = make(key, value)
            point = SweepPoint(trace, args, model_name, gpu_name, profile, seed,
                               {**labels, **rate_labels})
            name = "_".join(f"{''.join(w[0] for w in k.split('_'))}{v:g}"
                            if isinstance(v, int | float) else f"{k}-{v}"
                            for k, v in point.labels.items()) or "run"
            return point, options, str(root / f"{next(counter):03d}-{name}")

        def run(jobs_: list[tuple]) -> list[dict[str, object]]:
            from sim.sweep import run_all

            with _progress(len(jobs_)) as progress:
                return run_all(_sweep_worker, jobs_, executor, jobs, address, progress)

        if find_max_rate:
            records = _find_max_rate(configs, job, run, slos, rate_range, rates, base,
                                     rate_tolerance)
        else:
            key = "request_rate" if rates else "time_scale" if scales else None
            axis = rates or scales or [None]
            records = run([job(c, key, v) for c in configs for v in axis])
        _sweep_output(records, root, slos, plots)


def _find_max_rate(configs: list, job: object, run: object, slos: object,
                   rate_range: str | None, rates: list[float] | None, base: object,
                   tolerance: float) -> list[dict[str, object]]:
    from analysis.sweep import RateSearch, meets_slo

    bracket = _float_list("--rate-range", rate_range)
    if bracket is None and rates and len(rates) >= 2:
        bracket = [min(rates), max(rates)]
    if bracket is None and base is not None:
        arrivals = [r.arrival_s for r in base]  # type: ignore[attr-defined]
        trace_rate = len(arrivals) / max(arrivals[-1] - arrivals[0], 1e-9)
        bracket = [round(trace_rate * 0.5, 4), round(trace_rate * 8, 4)]
    if bracket is None or len(bracket) != 2 or bracket[0] >= bracket[1]:
        raise ValueError("--find-max-rate needs a bracket: --rate-range LO,HI (LO < HI)")
    searches = [RateSearch(bracket[0], bracket[1], tolerance) for _ in configs]
    records: list[dict[str, object]] = []
    while True:
        batch = [(i, r) for i, s in enumerate(searches) for r in s.next_rates()]
        if not batch:
            break
        results = run([job(configs[i], "request_rate", r) for i, r in batch])  # type: ignore[operator]
        for (i, rate), record in zip(batch, results, strict=True):
            searches[i].record(rate, meets_slo(record, slos))  # type: ignore[arg-type]
            records.append(record)
    for (labels, *_), search in zip(configs, searches, strict=True):
        name = ", ".join(f"{k}={v}" for k, v in labels.items()) or "config"
        answer = {"found": f"{search.best:g} req/s",
                  "at least hi": f">= {search.hi:g} req/s (the top of the range passed)",
                  "below range": f"< {search.lo:g} req/s (the bottom of the range failed)"}
        typer.echo(f"max rate meeting the SLOs, {name}: {answer[search.status]} "
                   f"({search.runs} runs, bisection)")
    return records


def _sweep_output(records: list[dict[str, object]], root: Path, slos: object,
                  plots: bool) -> None:
    from analysis.plots import latency_vs_flag, latency_vs_rate
    from analysis.sweep import render, results_table

    point_keys = [k for k in records[0] if k in _ENGINE_LISTS or k in (
        "model", "gpu", "time_scale")]
    if "request_rate" not in point_keys:
        point_keys.append("request_rate")
    table = results_table(records, point_keys, slos)  # type: ignore[arg-type]
    table["run_dir"] = [Path(str(r["run_dir"])).name for r in records]
    typer.echo(render(table))
    root.mkdir(parents=True, exist_ok=True)
    table.to_csv(root / "sweep.csv", index=False)
    (root / "sweep.json").write_text(json.dumps(records, indent=2, default=str) + "\n")
    if not plots:
        return
    full = __import__("pandas").DataFrame(records)
    figures = {}
    varying = [k for k in point_keys if k != "request_rate" and full[k].nunique() > 1]
    rate_key = "time_scale" if "time_scale" in point_keys else "request_rate"
    for flag in varying:
        if flag in _ENGINE_LISTS:
            series = rate_key if full[rate_key].nunique() > 1 else None
            figures[f"latency_vs_{flag}"] = latency_vs_flag(full, flag, series)
    if full["request_rate"].nunique() >= 3:
        full["config"] = [", ".join(f"{k}={r[k]}" for k in varying if k != rate_key) or "run"
                          for r in records]
        full["request_rate"] = full["request_rate"].astype(float)
        figures["latency_vs_rate"] = latency_vs_rate(full)
    _save_figures(figures, root)


# ---- rt replay (backends) -----------------------------------------------------------------------
# (replay commands are defined below this line)

if TYPE_CHECKING:
    from backends.engine.setup import RealSetup
    from backends.replay.api_process import Tokenizer
    from backends.replay.driver import ReplayResult
    from backends.replay.endpoint import EndpointConfig, EndpointInfo
    from sim.calibrate import StepSamples

_Real = "Real engine"
_Device = Annotated[str, typer.Option("--device", help="cpu or cuda.", rich_help_panel=_Real)]
_Dtype = Annotated[str, typer.Option(
    "--dtype", help="auto, float32, float16 or bfloat16 (auto: fp32 on the CPU, the "
    "checkpoint's half type on CUDA).", rich_help_panel=_Real)]
_KvCacheMemory = Annotated[int | None, typer.Option(
    "--kv-cache-memory", help="KV pool size in bytes (default: free GPU memory at "
    "--gpu-memory-utilization; 256 MiB on the CPU).", rich_help_panel=_Real)]
_MemoryUtilization = Annotated[float, typer.Option(
    "--gpu-memory-utilization", rich_help_panel=_Real)]
_RandomWeights = Annotated[bool, typer.Option(
    "--random-weights", help="Read only the model's config.json and initialise its weights "
    "at random from --seed on the device (seconds for an 8B model); --model may then also "
    "be a preset shape: llama-3.2-1b, llama-3.2-3b or llama-3.1-8b.",
    rich_help_panel=_Real)]
_Endpoint = "OpenAI-compatible endpoint (--endpoint)"
_DEFAULT_REPLAY = {"num_prompts": 32, "input_len": 96, "output_len": 24, "rate": 8.0}


@app.command()
def replay(
    trace_file: Annotated[Path | None, typer.Argument(
        help="Trace file (any `rt trace` format). Default: a small synthetic trace "
        f"({_DEFAULT_REPLAY['num_prompts']} random requests at {_DEFAULT_REPLAY['rate']:g} "
        "req/s).", show_default=False)] = None,
    model: Annotated[Path | None, typer.Option(
        "--model", help="Local Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3). "
        "Default: a tiny random Llama, built once in ~/.cache/rt/tiny-llama. With "
        "--endpoint: the model name to send (as --served-model-name).",
        rich_help_panel=_Real)] = None,
    random_weights: _RandomWeights = False,
    fmt: _Format = None,
    request_rate: _Rate = math.inf, burstiness: _Burst = 1.0,
    first_n: _FirstN = None, time_scale: _TimeScale = None,
    device: _Device = "cpu", dtype: _Dtype = "auto", kv_cache_memory: _KvCacheMemory = None,
    memory_utilization: _MemoryUtilization = 0.9,
    max_num_batched_tokens: _MaxBatched = None, max_num_seqs: _MaxSeqs = None,
    max_model_len: _EngineMaxLen = None, block_size: _BlockSize = 16,
    prefix_caching: _PrefixCaching = True, chunked_prefill: _ChunkedPrefill = True,
    long_prefill: _LongPrefill = 0,
    policy: _Policy = "fcfs",
    num_gpu_blocks: _NumBlocks = None,
    seed: _Seed = 0,
    result_dir: Annotated[Path | None, typer.Option(
        "--result-dir", help="Run directory to write (default: results/replay-<time>).")]
    = None,
    metric_percentiles: _Percentiles = "99",
    check_invariants: _CheckInvariants = False,
    endpoint: Annotated[str | None, typer.Option(
        "--endpoint", help="Replay against this OpenAI-compatible server instead "
        "(http://HOST:PORT, its /v1 or its /v1/completions URL); the engine flags are then "
        "unused.", rich_help_panel=_Endpoint)] = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="Model name of the request body (default: --model, else "
        "the first of GET /v1/models).", rich_help_panel=_Endpoint)] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="OPENAI_API_KEY", help="Bearer token for the endpoint.",
        show_default=False, rich_help_panel=_Endpoint)] = None,
    max_concurrency: Annotated[int | None, typer.Option(
        "--max-concurrency", help="Requests in flight at most (client-side, as vLLM bench).",
        rich_help_panel=_Endpoint)] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds one request may take in all; then it counts as failed.",
        rich_help_panel=_Endpoint)] = 600.0,
    vocab_size: Annotated[int, typer.Option(
        "--vocab-size", help="Prompt token ids are drawn from [10, N): at most the served "
        "model's vocabulary.", rich_help_panel=_Endpoint)] = 32000,
) -> None:
    """Replay a trace in real time through the vLLM-V1 core and a real model (CPU or GPU),
    or, with --endpoint, against any OpenAI-compatible server (client-side timing).

    Requests are released at their arrival times on the wall clock; the output blocks and
    the run directory are those of `rt simulate`. With no arguments: a tiny random Llama and
    a small synthetic trace on the CPU. Ctrl-C writes the records so far.
    """
    with _user_errors():
        percentiles = _parse_percentiles(metric_percentiles)
        trace = _replay_trace(trace_file, fmt, request_rate, burstiness, seed, first_n,
                              time_scale)
        if endpoint is not None:
            name = served_model_name or (str(model) if model is not None else None)
            config, info = _endpoint_setup(endpoint, name, api_key, max_concurrency, timeout,
                                           vocab_size, seed)
            if info.max_model_len is not None:
                _check_replay_lengths(trace, info.max_model_len)
            _run_endpoint(trace, config, info, result_dir, percentiles)
            return
        setup, tokenizer = _replay_setup(
            model, device=device, dtype=dtype, kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=memory_utilization,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, block_size=block_size,
            enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked_prefill,
            long_prefill_token_threshold=long_prefill, policy=policy,
            num_gpu_blocks_override=num_gpu_blocks, seed=seed, random_weights=random_weights)
        _check_replay_lengths(trace, setup.scheduler.max_model_len)
        _run_replay(trace, setup, tokenizer, result_dir, percentiles, check_invariants)


def _replay_trace(file: Path | None, fmt: str | None, rate: float, burstiness: float,
                  seed: int, first_n: int | None, time_scale: float | None
                  ) -> workloads.Trace:
    """The trace file (arrival flags serve length-only files), or the default synthetic
    trace; then --first-n and --time-scale."""
    arrivals = workloads.ArrivalProcess(rate, burstiness, seed)
    if file is None:
        spec = _DEFAULT_REPLAY
        trace = workloads.random_trace(
            int(spec["num_prompts"]),
            workloads.RandomLengths(int(spec["input_len"]), int(spec["output_len"]), 0.5),
            workloads.ArrivalProcess(spec["rate"], 1.0, seed))
    else:
        result = workloads.load_trace(file, fmt, arrivals=arrivals)
        _note(load_notes(result.report, None))
        trace = result.trace
    trace, _ = workloads.apply_transforms(trace, workloads.TransformSpec(
        first_n=first_n, time_scale=time_scale))
    if len(trace) == 0:
        fail(f"the workload has no requests to replay ({trace.name or 'trace'})")
    return trace


def _replay_setup(model: Path | None, **flags: object) -> tuple[RealSetup, Tokenizer | None]:
    """Build the real engine (and the model's tokenizer, if it has one); one line on error.
    With random_weights, --model may also name a preset shape (llama-3.1-8b, ...)."""
    from transformers.utils import logging as hf_logging

    from backends.engine.setup import RealEngineArgs, build_engine, load_tokenizer
    from backends.engine.tiny_model import build_tiny_llama, preset_config_dir

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        model_dir = model if model is not None else build_tiny_llama()
        if flags.get("random_weights") and not model_dir.is_dir():
            model_dir = preset_config_dir(str(model_dir))
        args = RealEngineArgs(model_dir=model_dir, **flags)  # type: ignore[arg-type]
        return build_engine(args), load_tokenizer(model_dir)
    except ValueError as err:
        fail(str(err))


def _check_replay_lengths(trace: workloads.Trace, max_model_len: int) -> None:
    for req in trace:
        if req.prompt_len + req.output_len > max_model_len:
            fail(f"request {req.request_id}: {req.prompt_len} prompt + {req.output_len} output "
                 f"tokens exceed max_model_len={max_model_len} (clip the trace with "
                 "`rt trace convert --max-model-len`)")


def _run_replay(trace: workloads.Trace, setup: RealSetup, tokenizer: Tokenizer | None,
                result_dir: Path | None, percentiles: list[float],
                check_invariants: bool) -> None:
    import datetime

    from backends.replay.driver import ReplayConfig
    from backends.replay.driver import replay as run_replay
    from sim.cost_model import startup_lines

    cache, sched = setup.cache, setup.scheduler
    for line in startup_lines(cache.num_blocks, cache.block_size, sched.max_model_len):
        typer.echo(line, err=True)
    _note([f"model {setup.args.model_dir} ({setup.shape.model_type}) on {setup.args.device}, "
           f"{setup.dtype}, attention: {setup.attention}"])
    config = ReplayConfig(sched, cache, setup.shape.vocab_size, setup.args.seed,
                          check_invariants)
    with _progress(len(trace)) as progress:
        result = run_replay(trace, config, setup.runner, tokenizer, progress)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = result_dir or Path("results") / f"replay-{stamp}"
    info = {
        "kind": "replay", "rt_version": _version(), "name": path.name,
        "trace": {"name": trace.name, "requests": len(trace),
                  "digest": workloads.trace_digest(trace)},
        "wall_s": round(result.wall_s, 3), "interrupted": result.interrupted,
        "tokenizer": tokenizer is not None,
        "prefix_cache": {"queries": result.prefix_cache_queries,
                         "hits": result.prefix_cache_hits},
        **setup.describe(),
    }
    _report_run(path, result, info, percentiles, len(trace))
    if result.interrupted:
        typer.echo("rt: interrupted: records of the requests so far were written", err=True)
        raise typer.Exit(code=130)


def _endpoint_setup(url: str, model: str | None, api_key: str | None,
                    max_concurrency: int | None, timeout: float, vocab_size: int, seed: int
                    ) -> tuple[EndpointConfig, EndpointInfo]:
    """The endpoint's config and what `GET /v1/models` says; one line on error."""
    try:
        from backends.replay.endpoint import EndpointConfig, EndpointError, probe
    except ImportError as err:
        fail(f"--endpoint needs {err.name}: pip install 'rt[serve]'")
    try:
        config = EndpointConfig(url, model, api_key, max_concurrency, timeout, vocab_size, seed)
        return config, probe(config)
    except EndpointError as err:
        fail(str(err))


def _run_endpoint(trace: workloads.Trace, config: EndpointConfig, info: EndpointInfo,
                  result_dir: Path | None, percentiles: list[float]) -> None:
    """Replay against the endpoint, write the run directory, print vLLM's block; failed
    requests are counted (exit 0, as vLLM bench) unless every request failed (exit 1)."""
    import datetime

    from analysis.console import benchmark_block
    from analysis.metrics import benchmark_metrics
    from analysis.rundir import load_run, write_run
    from backends.replay.endpoint import replay_endpoint, run_info

    _note([f"endpoint {info.completions_url}, model {info.model}, client-side timing"])
    with _progress(len(trace)) as progress:
        result = replay_endpoint(trace, config, info, progress)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = result_dir or Path("results") / f"endpoint-{stamp}"
    meta = {"kind": "endpoint", "rt_version": _version(), "name": path.name,
            "trace": {"name": trace.name, "requests": len(trace),
                      "digest": workloads.trace_digest(trace)},
            **run_info(result, config, info)}
    write_run(path, [r.to_row() for r in result.requests], {}, meta)
    run = load_run(path)
    failed, sent = result.num_failed, len(result.requests)
    if sent > failed:
        typer.echo(benchmark_block(benchmark_metrics(run.requests, percentiles),
                                   percentiles=percentiles, request_rate=None))
    if failed:
        first = next(iter(result.errors.items()), ("", ""))
        _note([f"{failed} of {sent} requests failed (first: {first[0]}: {first[1]}); "
               f"messages in {path / 'run.json'}"])
    typer.echo(f"rt: wrote {path} ({sent} requests, client-side timing, "
               f"{result.wall_s:.2f} s wall)", err=True)
    if result.interrupted:
        typer.echo("rt: interrupted: records of the requests so far were written", err=True)
        raise typer.Exit(code=130)
    if sent and failed == sent:
        typer.echo(f"rt: every request failed ({first[1]})", err=True)
        raise typer.Exit(code=1)


def _report_run(path: Path, result: ReplayResult, info: dict[str, object],
                percentiles: list[float], num_requests: int) -> None:
    """Write the run directory and print vLLM's block and rt's block (as `rt simulate`)."""
    from analysis.console import benchmark_block, rt_block
    from analysis.metrics import benchmark_metrics
    from analysis.rundir import load_run, write_run

    write_run(path, [r.to_row() for r in result.requests], result.step_columns, info)
    run = load_run(path)
    hit_rate = result.prefix_cache_hits / max(result.prefix_cache_queries, 1)
    if len(run.requests):
        typer.echo(benchmark_block(benchmark_metrics(run.requests, percentiles),
                                   percentiles=percentiles, request_rate=None))
        typer.echo(rt_block(run.requests, run.steps, hit_rate))
    typer.echo(f"rt: wrote {path} ({num_requests} requests, {result.num_steps} steps, "
               f"{result.wall_s:.2f} s wall)", err=True)


# ---- rt serve (backends; --simulate: sim) ------------------------------------------------------
# (serve commands are defined below this line)

_Serve = "Server"


@app.command()
def serve(
    model: Annotated[str | None, typer.Option(
        "--model", "--sim-model", help="Local Hugging Face model directory (default: the tiny "
        "random Llama on the CPU); with --simulate, the simulated model (preset or config, "
        "default llama-3.1-8b).", rich_help_panel=_Serve)] = None,
    simulate_: Annotated[bool, typer.Option(
        "--simulate", help="Execution times from the cost model on the wall clock, synthetic "
        "tokens (no model, no GPU).", rich_help_panel=_Serve)] = False,
    gpu: Annotated[str, typer.Option("--gpu", help="--simulate: the simulated GPU.",
                                     rich_help_panel=_Serve)] = "h200",
    profile: Annotated[str | None, typer.Option(
        "--profile", help="--simulate: calibrated cost-model profile (JSON).",
        rich_help_panel=_Serve)] = None,
    host: Annotated[str, typer.Option("--host", rich_help_panel=_Serve)] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", rich_help_panel=_Serve)] = 8000,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="The name clients pass as `model`.",
        rich_help_panel=_Serve)] = None,
    max_queued: Annotated[int | None, typer.Option(
        "--max-num-queued-requests", help="Answer 503 when this many requests await their "
        "first token.", rich_help_panel=_Serve)] = None,
    shutdown_timeout: Annotated[float, typer.Option(
        "--shutdown-timeout", help="On SIGTERM, seconds in-flight requests may finish before "
        "they are aborted.", rich_help_panel=_Serve)] = 10.0,
    device: _Device = "cpu", dtype: _Dtype = "auto", kv_cache_memory: _KvCacheMemory = None,
    memory_utilization: _MemoryUtilization = 0.9,
    max_num_batched_tokens: _MaxBatched = None, max_num_seqs: _MaxSeqs = None,
    max_model_len: _EngineMaxLen = None, block_size: _BlockSize = 16,
    prefix_caching: _PrefixCaching = True, chunked_prefill: _ChunkedPrefill = True,
    long_prefill: _LongPrefill = 0,
    policy: _Policy = "fcfs",
    num_gpu_blocks: _NumBlocks = None,
    seed: _Seed = 0,
    log_level: Annotated[str, typer.Option("--uvicorn-log-level",
                                           rich_help_panel=_Serve)] = "warning",
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /tokenize,
    /health, /metrics) from an engine-core process: a real model, or with --simulate the
    cost model on the wall clock. SIGTERM/Ctrl-C drains, then exits."""
    from backends.serve.api_server import ServeConfig, run_server

    if max_queued is not None and max_queued < 1:
        fail(f"--max-num-queued-requests must be >= 1, got {max_queued}")
    engine = dict(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                  max_model_len=max_model_len, block_size=block_size,
                  enable_prefix_caching=prefix_caching,
                  enable_chunked_prefill=chunked_prefill,
                  long_prefill_token_threshold=long_prefill, policy=policy,
                  num_gpu_blocks_override=num_gpu_blocks)
    with _user_errors():
        if simulate_:
            factory, kwargs, name, tokenizer_dir = _serve_simulated(model, gpu, profile, seed,
                                                                    engine)
        else:
            factory, kwargs, name, tokenizer_dir = _serve_real(
                model, seed, engine, device=device, dtype=dtype,
                kv_cache_memory=kv_cache_memory, gpu_memory_utilization=memory_utilization)
    config = ServeConfig(served_model_name or name, factory, kwargs, tokenizer_dir, max_queued)
    typer.echo(f"rt: serving {config.model_name} on http://{host}:{port}/v1", err=True)
    try:
        run_server(config, host, port, shutdown_timeout, log_level)
    except RuntimeError as err:
        fail(str(err))
    typer.echo("rt: server stopped", err=True)


def _serve_simulated(model: str | None, gpu: str, profile: str | None, seed: int,
                     engine: dict[str, object]) -> tuple[object, dict, str, Path | None]:
    """The wall-clock simulator's executor factory (validated here, built in the engine)."""
    from sim.engine_args import EngineArgs, build_setup
    from sim.live_executor import build_live_executor

    args = EngineArgs(**engine)  # type: ignore[arg-type]
    sim_model = model or "llama-3.1-8b"
    build_setup(args, sim_model, gpu, profile, seed)  # one-line errors before the fork
    kwargs = {"engine_args": args, "model": sim_model, "gpu": gpu, "profile": profile,
              "seed": seed}
    model_dir = Path(sim_model) if Path(sim_model).is_dir() else None  # its tokenizer
    return build_live_executor, kwargs, sim_model, model_dir


def _serve_real(model: str | None, seed: int, engine: dict[str, object],
                **real: object) -> tuple[object, dict, str, Path]:
    """The real executor's factory; the model is loaded in the engine process."""
    from backends.engine.setup import RealEngineArgs
    from backends.engine.tiny_model import build_tiny_llama
    from backends.serve.engine_process import build_real_executor

    model_dir = Path(model) if model is not None else build_tiny_llama()
    if not (model_dir / "config.json").is_file():
        fail(f"--model {model_dir}: not a model directory (no config.json)")
    args = RealEngineArgs(model_dir=model_dir, seed=seed, **engine, **real)  # type: ignore[arg-type]
    name = "tiny-llama" if model is None else model_dir.name
    return build_real_executor, {"args": args}, name, model_dir


# ---- rt calibrate / fidelity -----------------------------------------------------------------
# (calibration commands are defined below this line)

_Cal = "Calibration"
_ModelDir = Annotated[Path | None, typer.Option(
    "--model", help="Local Hugging Face model directory. Default: the tiny random Llama.",
    rich_help_panel=_Real)]
_Quick = Annotated[bool, typer.Option(
    "--quick", help="A small grid with few repeats (seconds; for tests).", rich_help_panel=_Cal)]
_TimeLimit = Annotated[float | None, typer.Option(
    "--time-limit", help="Seconds of grid at most (default: 300; --quick 30).",
    rich_help_panel=_Cal)]


@contextlib.contextmanager
def _bar(label: str) -> Iterator[object]:
    """A rich progress bar on stderr labelled `label`; yields update(done, total)."""
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _calibrate_setup(setup: RealSetup, tokenizer: Tokenizer | None, quick: bool,
                     time_limit: float | None, extra_steps: list[Path]) -> object:
    """Run the grid on `setup`, time the API server, fit; returns the `Profile`."""
    import dataclasses
    import datetime
    import platform

    import torch

    from backends.engine.calibration_grid import QUICK_GRID, GridSpec, run_grid, time_api_server
    from sim.calibrate import fit_api_server, fit_with_holdout, make_profile

    spec = QUICK_GRID if quick else GridSpec()
    if time_limit is not None:
        spec = dataclasses.replace(spec, time_limit_s=time_limit)
    with _bar("calibrating") as progress:
        grid = run_grid(setup.scheduler, setup.cache, setup.runner, setup.shape.vocab_size,
                        spec, setup.args.seed, progress)  # type: ignore[arg-type]
    if len(grid) < 7:
        fail(f"only {len(grid)} grid points fit the engine's limits; raise --max-model-len "
             "or --max-num-batched-tokens")
    features = [m.features for m in grid]
    seconds = [m.wall_s for m in grid]
    for path in extra_steps:
        samples = _steps_data(path, "wall")
        features += samples.features
        seconds += samples.seconds
    fit = fit_with_holdout(features, seconds)
    lens = (16, 128, 512, 2048) if not quick else (16, 256)
    api = time_api_server(setup.shape.vocab_size, tokenizer, lens, 5 if quick else 15)
    overhead = [m.host_overhead_s / m.wall_s for m in grid]
    describe = setup.describe()
    return make_profile(
        fit, device=str(describe["device"]) if setup.args.device == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads)",
        model=f"{Path(setup.args.model_dir).name} ({setup.shape.model_type})",
        dtype=setup.dtype, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        versions={"rt": _version(), "torch": torch.__version__,
                  "python": platform.python_version()},
        api_server=fit_api_server(api.prompt_lens, api.seconds),
        extra={"target": "wall", "grid_points": len(grid),
               "replay_steps": len(seconds) - len(grid),
               "grid": [{"kind": m.kind, **dataclasses.asdict(m.features),
                         "wall_s": m.wall_s, "execute_s": m.execute_s} for m in grid],
               "host_overhead_fraction_median": sorted(overhead)[len(overhead) // 2],
               "api_server_timing": {"method": api.method, "prompt_lens": list(api.prompt_lens),
                                     "seconds": list(api.seconds)}})


def _steps_data(path: Path, target: str) -> StepSamples:
    """Training data from a replay's steps.parquet (or its run directory)."""
    from sim.calibrate import read_replay_steps

    try:
        return read_replay_steps(path, target)
    except ValueError as err:
        fail(f"--from-steps: {err}")


def _profile_from_steps(paths: list[Path], target: str, api_server: object = None,
                        drift: bool = False) -> object:
    """`sim.calibrate.profile_from_replays`, its errors one line, with a note when the drift
    asked for was not found."""
    from sim.calibrate import profile_from_replays

    try:
        profile = profile_from_replays(paths, target, api_server=api_server,  # type: ignore[arg-type]
                                       drift=drift, rt_version=_version())
    except ValueError as err:
        fail(f"--from-steps: {err}")
    if drift and profile.step_time_drift_quantiles is None:
        _note(["--step-drift: fewer than 2 windows of 0.25 s with 8+ steps in these "
               "replays; the profile has i.i.d. step-time scatter only"])
    return profile


def _print_fit(profile: object) -> None:
    import dataclasses

    from sim.profile import Profile

    assert isinstance(profile, Profile)
    fit = profile.fit or {}
    for name in ("held_out", "all_samples"):
        q = fit.get(name) or {}
        if q.get("samples"):
            typer.echo(f"fit on {name.replace('_', ' ')}: {q['samples']} steps, MAPE "
                       f"{q['mape']:.1%}, p90 {q['p90_ape']:.1%}, worst {q['worst_ape']:.1%}, "
                       f"total-time bias {q['bias']:+.1%}", err=True)
    for key, value in dataclasses.asdict(profile.coefficients).items():
        typer.echo(f"  {key:<30} {value:.4g} s", err=True)


@app.command("calibrate")
def calibrate(
    output: Annotated[Path, typer.Option("-o", "--output", help="Profile JSON to write.")],
    model: _ModelDir = None, random_weights: _RandomWeights = False, device: _Device = "cpu",
    dtype: _Dtype = "auto",
    quick: _Quick = False, time_limit: _TimeLimit = None,
    from_steps: Annotated[list[Path] | None, typer.Option(
        "--from-steps", help="steps.parquet (or run directory) of an earlier `rt replay`: "
        "training data. Alone: fit on these steps only; with --model: added to the grid.",
        rich_help_panel=_Cal)] = None,
    target: Annotated[str, typer.Option(
        "--target", help="Step time to fit from --from-steps alone: wall (end - start, what "
        "the simulator must reproduce) or execute (the runner's measurement).",
        rich_help_panel=_Cal)] = "wall",
    step_drift: _StepDrift = False,
    max_num_batched_tokens: _MaxBatched = None, max_num_seqs: _MaxSeqs = None,
    max_model_len: _EngineMaxLen = None, num_gpu_blocks: _NumBlocks = None,
    seed: _Seed = 0,
) -> None:
    """Fit the simulator's `profile` cost model to the real backend: a designed grid of
    prefill, decode and mixed batches (warm-up, repeats, medians), the API-server costs, a
    non-negative least-squares fit of the six coefficients, its held-out error. Writes a
    profile for `rt simulate --profile`."""
    from sim.profile import write_profile

    if step_drift and not (from_steps and model is None):
        fail("--step-drift needs --from-steps alone (a grid has no step-time scatter)")
    if from_steps and model is None:
        profile = _profile_from_steps(from_steps, target, drift=step_drift)
    else:
        setup, tokenizer = _replay_setup(
            model, device=device, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            num_gpu_blocks_override=num_gpu_blocks, seed=seed, random_weights=random_weights)
        profile = _calibrate_setup(setup, tokenizer, quick, time_limit, from_steps or [])
    _print_fit(profile)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_profile(profile, output)  # type: ignore[arg-type]
    typer.echo(f"rt: wrote {output}", err=True)


@app.command("fidelity")
def fidelity(
    trace_file: Annotated[Path, typer.Argument(help="Trace file (any `rt trace` format).")],
    model: _ModelDir = None, random_weights: _RandomWeights = False, device: _Device = "cpu",
    dtype: _Dtype = "auto",
    profile: Annotated[Path | None, typer.Option(
        "--profile", help="Profile JSON (default: calibrate first, on the same engine).")]
    = None,
    max_error: Annotated[float | None, typer.Option(
        "--max-error", help="Exit 1 when |error| of p50/p90 TTFT or ITL exceeds this "
        "fraction (0.05 = 5%).")] = None,
    quick: _Quick = False, time_limit: _TimeLimit = None,
    fit_on_replay: Annotated[bool, typer.Option(
        "--fit-on-replay", help="No grid: fit the profile on the replay's own steps "
        "(in-sample; separates the simulator's structural error from calibration drift).",
        rich_help_panel=_Cal)] = False,
    calibrate_on: Annotated[str, typer.Option(
        "--calibrate-on", help="Without --profile: 'grid' (the designed grid of batches) or "
        "'replay' (a separate calibration replay of a trace resampled from TRACE: other "
        "requests and arrivals, the same lengths and mean rate; out of sample).",
        rich_help_panel=_Cal)] = "replay",
    step_noise: Annotated[bool, typer.Option(
        "--step-noise/--no-step-noise", help="Simulate with the profile's measured step-time "
        "scatter (`rt simulate --step-noise`); ignored, with a note, for a profile without "
        "one (the grid's).", rich_help_panel=_Cal)] = True,
    step_drift: _StepDrift = False,
    repeats: Annotated[int, typer.Option(
        "--repeats", help="Real replays of TRACE (with --calibrate-on replay, as many "
        "calibration replays, interleaved with them in the order C R R C C R ... so a "
        "linear drift of the machine's speed falls on both alike). "
        "With 2 or more, 'real' is their mean and 'noise' the largest deviation of one of "
        "them from it: how far this machine is from itself.")] = 1,
    sim_runs: Annotated[int, typer.Option(
        "--sim-runs", help="Simulations of TRACE, step-time noise drawn from seeds SEED, "
        "SEED+1, ...; 'sim' is their mean (as 'real' is of the real runs). One run when "
        "simulated steps are deterministic (--no-step-noise).", rich_help_panel=_Cal)] = 8,
    fmt: _Format = None, first_n: _FirstN = None, time_scale: _TimeScale = None,
    max_num_batched_tokens: _MaxBatched = None, max_num_seqs: _MaxSeqs = None,
    max_model_len: _EngineMaxLen = None, block_size: _BlockSize = 16,
    prefix_caching: _PrefixCaching = True, chunked_prefill: _ChunkedPrefill = True,
    long_prefill: _LongPrefill = 0, policy: _Policy = "fcfs", num_gpu_blocks: _NumBlocks = None,
    seed: _Seed = 0,
    result_dir: Annotated[Path | None, typer.Option(
        "--result-dir", help="Where real/, sim/, profile.json, fidelity.json and the plots "
        "go (default: results/fidelity-<time>).")] = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots")] = True,
) -> None:
    """Replay TRACE on the real backend and simulate it with the profile under the same
    engine flags and KV pool (blocks), then report the simulator's error: per metric (mean,
    p50, p90, p99 of TTFT, ITL, TPOT, E2E; throughput), per step, per request (TTFT).

    Without --profile it calibrates first, by default on replays of other requests like
    TRACE's; with --repeats N it replays N times and reports against their mean, with the
    real runs' own spread as the noise floor."""
    import datetime

    from sim.calibrate import replay_api_cost
    from sim.profile import load_profile

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = result_dir or Path("results") / f"fidelity-{stamp}"
    with _user_errors():
        if calibrate_on not in ("grid", "replay"):  # before loading a model
            fail(f"--calibrate-on must be grid or replay, got {calibrate_on!r}")
        if repeats < 1:
            fail(f"--repeats must be >= 1, got {repeats}")
        if sim_runs < 1:
            fail(f"--sim-runs must be >= 1, got {sim_runs}")
        if step_drift and (profile is not None or (calibrate_on == "grid" and not fit_on_replay)):
            fail("--step-drift needs a profile fitted here on replays (--calibrate-on replay or "
                 "--fit-on-replay, no --profile)")
        if step_drift and not step_noise:
            fail("--step-drift with --no-step-noise: the drift would be fitted and not used")
        trace = _replay_trace(trace_file, fmt, math.inf, 1.0, seed, first_n, time_scale)
        setup, tokenizer = _replay_setup(
            model, device=device, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size,
            enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked_prefill,
            long_prefill_token_threshold=long_prefill, policy=policy,
            num_gpu_blocks_override=num_gpu_blocks, seed=seed, random_weights=random_weights)
        _check_replay_lengths(trace, setup.scheduler.max_model_len)
        root.mkdir(parents=True, exist_ok=True)
        calibrate = profile is None and not fit_on_replay
        if calibrate and calibrate_on == "grid":
            profile = _write_fitted(_calibrate_setup(setup, tokenizer, quick, time_limit, []),
                                    root)
        calibrations: list[Path] = []
        reals: list[Path] = []
        for i in range(repeats):  # C R, R C, C R, ...: a linear drift falls on both alike
            suffix = f"-{i + 1}" if i else ""
            real_first = i % 2 == 1
            if real_first:
                reals.append(_fidelity_replay(trace, setup, tokenizer, root / f"real{suffix}"))
            if calibrate and calibrate_on == "replay":
                other = workloads.resample_like(trace, seed + i + 1)  # out of sample
                calibrations.append(_fidelity_replay(other, setup, tokenizer,
                                                     root / f"calibration{suffix}"))
            if not real_first:
                reals.append(_fidelity_replay(trace, setup, tokenizer, root / f"real{suffix}"))
        if calibrations or fit_on_replay:  # fit_on_replay: in-sample, on the real runs
            runs = calibrations or reals
            profile = _write_fitted(_profile_from_steps(runs, "wall", replay_api_cost(runs),
                                                        step_drift), root)
        assert profile is not None
        loaded = load_profile(profile)
        if step_noise and loaded.step_time_quantiles is None:
            _note([f"{profile} has no step-time scatter: simulated steps take exactly the "
                   "fitted time"])
            step_noise = False
        sim_dirs = _fidelity_simulate(trace, setup, profile, root, step_noise,
                                      sim_runs if step_noise else 1)
    _fidelity_report(reals, sim_dirs, loaded, root, plots, max_error)


def _write_fitted(profile: object, root: Path) -> Path:
    """Print the fit's quality and write the profile as root/profile.json."""
    from sim.profile import write_profile

    _print_fit(profile)
    write_profile(profile, root / "profile.json")  # type: ignore[arg-type]
    return root / "profile.json"


def _fidelity_replay(trace: workloads.Trace, setup: RealSetup, tokenizer: Tokenizer | None,
                     path: Path) -> Path:
    from analysis.rundir import write_run
    from backends.replay.driver import ReplayConfig
    from backends.replay.driver import replay as run_replay

    config = ReplayConfig(setup.scheduler, setup.cache, setup.shape.vocab_size, setup.args.seed)
    with _bar("replaying (real)") as progress:
        result = run_replay(trace, config, setup.runner, tokenizer, progress)  # type: ignore[arg-type]
    if result.interrupted:
        raise typer.Exit(code=130)
    info = {"kind": "replay", "rt_version": _version(), "name": "real",
            "trace": {"name": trace.name, "requests": len(trace),
                      "digest": workloads.trace_digest(trace)},
            "wall_s": round(result.wall_s, 3), "tokenizer": tokenizer is not None,
            "prefix_cache": {"queries": result.prefix_cache_queries,
                             "hits": result.prefix_cache_hits}, **setup.describe()}
    write_run(path, [r.to_row() for r in result.requests], result.step_columns, info)
    typer.echo(f"rt: replayed {len(trace)} requests, {result.num_steps} steps, "
               f"{result.wall_s:.2f} s wall -> {path}", err=True)
    return path


def _fidelity_simulate(trace: workloads.Trace, setup: RealSetup, profile: Path,
                       root: Path, step_noise: bool, runs: int) -> list[Path]:
    """The same trace in the simulator, with the real engine's resolved flags and pool,
    `runs` times (step-noise seeds seed, seed + 1, ...; the token ids keep the replay's
    seed): root/sim, root/sim-2, ..."""
    import dataclasses

    from analysis.rundir import write_run
    from sim.engine_args import EngineArgs, build_setup
    from sim.simulator import simulate as run_simulation

    sched, cache, args = setup.scheduler, setup.cache, setup.args
    sim_args = EngineArgs(
        max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
        max_model_len=sched.max_model_len, block_size=cache.block_size,
        enable_prefix_caching=cache.enable_prefix_caching,
        enable_chunked_prefill=sched.enable_chunked_prefill,
        long_prefill_token_threshold=sched.long_prefill_token_threshold, policy=sched.policy,
        num_gpu_blocks_override=cache.num_blocks)
    try:
        sim = build_setup(sim_args, str(args.model_dir), "h200", str(profile), args.seed,
                          step_noise=step_noise)
    except ValueError as err:
        fail(str(err))
    paths = []
    for i in range(runs):
        noise = sim.config.step_noise
        config = (sim.config if noise is None else dataclasses.replace(
            sim.config, step_noise=dataclasses.replace(noise, seed=args.seed + i)))
        result = run_simulation(trace, config, sim.cost_model)
        name = f"sim-{i + 1}" if i else "sim"
        info = {"kind": "simulate", "rt_version": _version(), "name": name,
                "trace": {"name": trace.name, "requests": len(trace),
                          "digest": workloads.trace_digest(trace)},
                "wall_s": round(result.wall_s, 3),
                "prefix_cache": {"queries": result.prefix_cache_queries,
                                 "hits": result.prefix_cache_hits}, **sim.describe(),
                "step_noise_seed": None if noise is None else args.seed + i}
        paths.append(root / name)
        write_run(paths[-1], [r.to_row() for r in result.requests], result.step_columns, info)
    return paths


def _fidelity_report(real_dirs: list[Path], sim_dirs: list[Path], profile: object, root: Path,
                     plots: bool, max_error: float | None) -> None:
    from analysis.fidelity import fidelity_report, gate, render
    from analysis.plots import cdfs, latency_values, percentile_curves
    from runtime.batch import BatchFeatures
    from sim.calibrate import predict

    with _user_errors():
        reals = [_load_checked(path) for path in real_dirs]
        sims = [_load_checked(path) for path in sim_dirs]
        real = reals[0]
        steps = real.steps  # type: ignore[attr-defined]
        names = list(BatchFeatures.__dataclass_fields__)
        features = [BatchFeatures(**{n: int(row[n]) for n in names})
                    for row in steps[names].to_dict("records")]
        measured = (steps["end_s"] - steps["start_s"]).to_numpy()
        predicted = predict(profile.coefficients, features)  # type: ignore[attr-defined]
        report = fidelity_report(reals, sims, measured, predicted)  # type: ignore[arg-type]
        typer.echo(render(report))
        (root / "fidelity.json").write_text(json.dumps(report.to_json_dict(), indent=2) + "\n")
        if plots:
            series = {("real" if i == 0 else f"real {i + 1}"):
                      latency_values(run.requests)  # type: ignore[attr-defined]
                      for i, run in enumerate(reals)}
            series["sim"] = latency_values(sims[0].requests)  # type: ignore[attr-defined]
            _save_figures({"percentiles": percentile_curves(series), "cdf": cdfs(series)},
                          root / "plots")
        typer.echo(f"rt: wrote {root}/fidelity.json", err=True)
        violations = gate(report, max_error) if max_error is not None else []
    for line in violations:
        typer.echo(f"rt: fidelity: {line}", err=True)
    if violations:
        raise typer.Exit(code=1)


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


@bench_app.command("sim")
def bench_sim(
    traces: Annotated[list[Path] | None, typer.Option(
        "--trace", help="Trace to simulate (repeatable). Default: the embedded excerpt.")]
    = None,
    model: Annotated[str, typer.Option("--model")] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option("--gpu")] = "h200",
    baseline: Annotated[bool, typer.Option(
        "--baseline/--no-baseline", help="Also time one-by-one stepping (slower).")] = True,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Also write the JSON here.")]
    = None,
) -> None:
    """Simulated requests per wall-clock second, fast-forwarding vs stepping one by one."""
    from sim.benchmarks import bench_sim as run

    with _user_errors():
        loaded = {str(path): workloads.load_trace(path).trace for path in traces or []}
        if not loaded:
            loaded = {"embedded azure_conv first 10 min": workloads.default_trace()}
        report = run(loaded, model, gpu, baseline)
    _write_json(report, out)


@bench_app.command("serve")
def bench_serve(
    concurrency: Annotated[int, typer.Option(
        "--concurrency", min=1, help="Streams in flight at most (client-side).")] = 200,
    num_prompts: Annotated[int | None, typer.Option(
        "--num-prompts", min=1, help="Requests (default: --concurrency).")] = None,
    request_rate: _Rate = math.inf,
    input_len: Annotated[int, typer.Option("--random-input-len", min=1)] = 256,
    output_len: Annotated[int, typer.Option("--random-output-len", min=1)] = 128,
    model: Annotated[str, typer.Option("--model")] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option("--gpu")] = "h200",
    profile: Annotated[str | None, typer.Option("--profile")] = None,
    max_num_seqs: _MaxSeqs = None,
    max_model_len: _EngineMaxLen = 4096,
    seed: _Seed = 0,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds one request may take at most.")] = 300.0,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Also write the JSON here.")]
    = None,
) -> None:
    """Load-test `rt serve --simulate` on a free loopback port (bounded; the server is always
    stopped): replay random requests through the `rt replay --endpoint` client, simulate the
    same arrivals with `rt simulate`'s core, and report errors, throughput and the latency
    the server path adds (server minus simulated, ms). Exit 1 on any error."""
    from backends.bench.serve_load import LoadConfig, compare, run_load, sent_arrivals
    from sim.engine_args import EngineArgs, build_setup
    from sim.simulator import simulate as run_simulate

    with _user_errors():
        lengths = workloads.RandomLengths(input_len, output_len)
        trace = workloads.random_trace(num_prompts or concurrency, lengths,
                                       workloads.ArrivalProcess(request_rate, 1.0, seed))
        args = EngineArgs(max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        setup = build_setup(args, model, gpu, profile, seed)
    command = [sys.executable, "-m", "cli", "serve", "--simulate", "--sim-model", model,
               "--gpu", gpu, "--seed", str(seed), "--max-model-len", str(max_model_len)]
    command += ["--profile", profile] if profile else []
    command += ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []
    config = LoadConfig(tuple(command), concurrency, setup.config.vocab_size, seed,
                        request_timeout_s=timeout)
    try:
        load = run_load(trace, config)
    except RuntimeError as err:
        fail(str(err))
    simulated = run_simulate(sent_arrivals(trace, load.endpoint.requests), setup.config,
                             setup.cost_model)
    report = {"command": "rt bench serve", "concurrency": concurrency,
              "random_input_len": input_len, "random_output_len": output_len,
              "request_rate": request_rate if math.isfinite(request_rate) else "inf",
              "model": model, "gpu": gpu,
              **compare(trace, load, simulated.requests)}
    _write_json(report, out)
    if report["errors"] or report["token_count_mismatches"]:
        raise typer.Exit(code=1)


# ---- rt bench gpu (backends) --------------------------------------------------------------------
# (the GPU benchmark command is defined below this line)


@bench_app.command("gpu")
def bench_gpu(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Also write the JSON here.")]
    = None,
    engine: Annotated[bool, typer.Option(
        "--engine/--no-engine", help="Engine output tokens/s against transformers' generate "
        "with static batching (goal >= 5x).")] = True,
    engine_model: Annotated[str, typer.Option(
        help="1b or 3b (Llama-3.2 shape, random bf16 weights built once under ~/.cache/rt), "
        "tiny, or a local model directory.")] = "1b",
    engine_requests: Annotated[int, typer.Option(min=1)] = 64,
    engine_prompt_len: Annotated[int, typer.Option(min=1, help="Mean prompt tokens.")] = 512,
    engine_output_len: Annotated[int, typer.Option(min=1, help="New tokens each.")] = 128,
    hf_batch_size: Annotated[int | None, typer.Option(
        min=1, help="transformers' static batch size [default: as many as rt runs at once]")]
    = None,
) -> None:
    """Kernel correctness in bf16, decode attention bandwidth and prefill TFLOP/s against a
    copy and a matmul measured in the same run, and engine tokens/s against transformers
    (a CUDA device; under 10 minutes)."""
    try:
        from backends.bench.engine_throughput import EnginePlan, engine_throughput_section
        from backends.bench.gpu import GpuUnavailable, run_gpu_bench
    except ImportError as err:
        fail(f"rt bench gpu needs the real extra (torch, triton): {err}")
    with _user_errors():
        plan = EnginePlan(num_requests=engine_requests, prompt_len=engine_prompt_len,
                          output_len=engine_output_len, hf_batch_size=hf_batch_size)
        engine_bench = engine_throughput_section(engine_model, plan) if engine else None
        try:
            report = run_gpu_bench(out, engine_throughput=engine_bench,
                                   log=lambda line: typer.echo(f"rt: {line}", err=True))
        except GpuUnavailable as err:
            fail(str(err))
    _write_json(report, None)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
