"""rt command line: the composition root, and the only module that touches argv, the
environment and logging.

Flags are declared once, as fields of the libraries' frozen flag dataclasses (`EngineFlags`,
`EngineArgs`, `SimFlags`, `RealEngineFlags`, `WorkloadFlags`, `ReportFlags`; each field's
metadata names its option). `with_flags` turns a command parameter annotated
`Annotated[SomeFlags, Flags(...)]` into those options and hands the command the instance.
Each command then calls the libraries and prints. User errors (bad flags, bad files) become
one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import inspect
import json
import math
import sys
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

import workloads
from analysis.progress import progress
from analysis.report import ReportFiles, ReportFlags
from backends.bench.flags import GpuBenchFlags, ServeBenchFlags
from backends.engine.flags import RealEngineFlags
from backends.replay.flags import EndpointFlags
from backends.route.flags import ROUTE_PANEL, RouteFlags
from backends.serve.flags import SERVER_PANEL, ServeFlags
from runtime.config import EngineFlags
from runtime.flags import FlagGroup as Flags
from runtime.flags import FlagSpec, build_group, group_specs
from sim.autoscale_flags import AutoscaleFlags
from sim.engine_args import EngineArgs, SimFlags
from sim.fidelity import CALIBRATION_PANEL, CalibrationFlags, FidelityFlags
from sim.fleet_config import FleetFlags
from sim.pd_flags import PDFlags
from sim.plan import PlanFlags
from sim.sweep import GRID_PANEL, SweepFlags
from workloads.flags import WorkloadFlags, load_workload

if TYPE_CHECKING:
    from analysis.rundir import Run
    from backends.engine.setup import RealSetup
    from backends.replay.api_process import Tokenizer
    from runtime.records import RunResult
    from sim.engine_args import SimSetup
    from sim.profile import Profile

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


# ---- flags declared once ----


def _option(spec: FlagSpec) -> inspect.Parameter:
    option = typer.Option(*spec.decls, help=spec.help, rich_help_panel=spec.panel,
                          envvar=spec.envvar)
    return inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=spec.default,
                             annotation=Annotated[spec.hint, option])


def with_flags(command: Callable[..., None]) -> Callable[..., None]:
    """Expose `Annotated[FlagClass, Flags(...)]` parameters of `command` as one typer option
    per field (an option two groups share, such as --seed, appears once and feeds both);
    the command is called with the built dataclasses."""
    hints = typing.get_type_hints(command, include_extras=True)
    own = [p.replace(annotation=hints[p.name], kind=inspect.Parameter.KEYWORD_ONLY)
           for p in inspect.signature(command).parameters.values() if not _group(hints[p.name])]
    params, seen = list(own), {p.name for p in own}
    groups = []
    for name, hint in hints.items():
        if name != "return" and (group := _group(hint)):
            cls = typing.get_args(hint)[0]
            specs = group_specs(cls, group)
            params += [_option(s) for s in specs if s.name not in seen]
            seen.update(s.name for s in specs)
            groups.append((name, cls, group, specs))
    own_names = {p.name for p in own}

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        with user_errors():
            built = {name: build_group(cls, group, specs, kwargs)
                     for name, cls, group, specs in groups}
        command(**{k: v for k, v in kwargs.items() if k in own_names}, **built)

    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def _group(hint: Any) -> Flags | None:
    return next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Flags)),
                None)


# ---- output and errors ----


def fail(message: str) -> NoReturn:
    """Print one readable line for a user error and exit with status 2."""
    typer.echo(f"rt: error: {message}", err=True)
    raise typer.Exit(code=2)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Bad input (a ValueError from the libraries, workloads.TraceError included: they name
    the field and value) or an unreadable/unwritable file: one line, exit 2."""
    try:
        yield
    except ValueError as err:
        fail(str(err))
    except OSError as err:
        fail(f"{err.filename}: {err.strerror}")


def note(lines: typing.Iterable[str]) -> None:
    for line in lines:
        typer.echo(f"rt: note: {line}", err=True)


def write_json(data: object, out: Path | None) -> None:
    text = json.dumps(data, indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    sys.stdout.write(text + "\n")


def save_figures(figures: Mapping[str, Any], directory: Path) -> None:
    if not figures:
        return
    directory.mkdir(parents=True, exist_ok=True)
    for stem, figure in figures.items():
        figure.savefig(directory / f"{stem}.png", dpi=90)
    typer.echo(f"rt: wrote {', '.join(f'{s}.png' for s in figures)} to {directory}", err=True)


def default_dir(kind: str) -> Path:
    return Path("results") / f"{kind}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def trace_info(trace: workloads.Trace) -> dict[str, Any]:
    return {"name": trace.name, "requests": len(trace), "digest": workloads.trace_digest(trace)}


def save_run(path: Path, kind: str, trace: workloads.Trace, result: RunResult,
             describe: Mapping[str, Any], **extra: Any) -> Run:
    """Write a run directory (`analysis.rundir.save_result`) and read it back."""
    from analysis.rundir import save_result

    return save_result(path, kind, trace_info(trace), result, describe, **extra)


def print_run(run: Run, result: RunResult, percentiles: list[float],
              request_rate: float | None = None) -> None:
    """vLLM's result block and rt's block (as `rt simulate` prints them)."""
    from analysis.console import benchmark_block, rt_block
    from analysis.metrics import benchmark_metrics

    if len(run.requests):
        typer.echo(benchmark_block(benchmark_metrics(run.requests, percentiles),
                                   percentiles=percentiles, request_rate=request_rate))
        hits = result.prefix_cache_hits / max(result.prefix_cache_queries, 1)
        typer.echo(rt_block(run.requests, run.steps, hits))
    typer.echo(f"rt: wrote {run.path} ({len(run.requests)} requests, {result.num_steps} "
               f"steps, {result.wall_s:.2f} s wall)", err=True)


def workload(flags: WorkloadFlags, path: Path | None = None) -> workloads.Trace:
    loaded = load_workload(flags, path)
    note(loaded.notes)
    return loaded.trace


_Percentiles = Annotated[ReportFlags, Flags(only=("metric_percentiles",))]
_Out = Annotated[Path | None, typer.Option("--out", "-o", help="Also write the JSON here.")]
_Plots = Annotated[bool, typer.Option("--plots/--no-plots", help="Draw the PNGs.")]


def _result_dir(kind: str) -> Any:
    return Annotated[Path | None, typer.Option(
        "--result-dir", help=f"Run directory to write (default: results/{kind}-<time>).")]


_CheckInvariants = Annotated[bool, typer.Option(
    "--check-invariants", help="Check the KV pool after every step (slow).")]
_Seed = Annotated[int, typer.Option("--seed", help="Seed of every random draw (as vLLM).")]


# ---- rt trace ... (workloads) ----

_TRACE_FLAGS = ("fmt", "trace_model", "hash_block_size", "request_rate", "burstiness", "seed",
                "start_s", "duration_s", "first_n", "time_scale", "target_rate",
                "max_model_len")
_SYNTHETIC = ("fmt", "dataset_name", "dataset_path", "num_prompts", "input_len", "output_len",
              "range_ratio", "prefix_len", "rep_prefix_len", "rep_suffix_len",
              "rep_num_prefixes", "rep_output_len", "turns", "turn_gap_s", "request_rate",
              "burstiness", "seed", "max_model_len")


@trace_app.command("inspect")
@with_flags
def trace_inspect(
    file: Path,
    flags: Annotated[WorkloadFlags, Flags(only=_TRACE_FLAGS)],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    keep_failed: Annotated[bool, typer.Option(
        "--keep-failed", help="Statistics over every row, failed rows included.")] = False,
    block_size: Annotated[int, typer.Option(
        "--block-size", help="Prefix-cache block (tokens) for prompts without hash ids.")] = 16,
) -> None:
    """Print a trace's statistics: rows, span, rates, burstiness, lengths, prefix reuse."""
    from workloads.flags import all_rows_stats
    from workloads.report import render_stats

    with user_errors():
        if keep_failed:
            stats, kind = all_rows_stats(flags, file)
        else:
            loaded = load_workload(flags, file)
            note(loaded.notes)
            stats, kind = workloads.trace_stats(loaded.trace, block_size), loaded.format
    if as_json:
        write_json({"file": str(file), "format": kind, **stats.to_dict()}, None)
    else:
        typer.echo("\n".join(render_stats(stats, f"{file} ({kind})")))


@trace_app.command("convert")
@with_flags
def trace_convert(
    src: Path, dst: Path,
    flags: Annotated[WorkloadFlags, Flags(only=_TRACE_FLAGS)],
    to: Annotated[str, typer.Option(
        "--to", help="Output format: rt (rt JSONL, lossless), vidur (CSV, times and lengths "
        "only) or timed_trace (vLLM bench's JSONL, 16-token hash ids).")] = "rt",
) -> None:
    """Convert a trace file (any supported format) to rt JSONL, Vidur CSV or vLLM bench's
    timed_trace JSONL."""
    writers = {"rt": workloads.write_rt_jsonl, "vidur": workloads.write_vidur_csv,
               "timed_trace": workloads.write_timed_trace}
    with user_errors():
        if to not in writers:
            raise workloads.TraceError("must be rt, vidur or timed_trace", column="--to",
                                       value=to)
        trace = workload(flags, src)
        writers[to](trace, dst)
    typer.echo(f"wrote {len(trace)} requests to {dst} ({to})")


@trace_app.command("gen")
@with_flags
def trace_gen(
    output: Annotated[Path, typer.Option("-o", "--output", help="rt JSONL file to write.")],
    flags: Annotated[WorkloadFlags, Flags(only=_SYNTHETIC, defaults={"dataset_name": "random"})],
) -> None:
    """Generate a synthetic trace with `vllm bench serve` flags (same seed, same arrivals)."""
    with user_errors():
        trace = workload(flags)
        workloads.write_rt_jsonl(trace, output)
    typer.echo(f"wrote {len(trace)} requests to {output} ({flags.dataset_name})")


# ---- rt simulate ----

_Trace = Annotated[Path | None, typer.Option(
    "--trace", help="Trace file (any `rt trace` format). Default: the embedded excerpt of the "
    "Azure conversation trace (first 10 min), unless --dataset-name is given.",
    rich_help_panel="Workload")]


@app.command()
@with_flags
def simulate(
    *,
    trace_file: _Trace = None,
    work: Annotated[WorkloadFlags, Flags(exclude=("max_model_len",))],
    engine: Annotated[EngineArgs, Flags()],
    sim: Annotated[SimFlags, Flags()],
    fleet: Annotated[FleetFlags, Flags()],
    pd: Annotated[PDFlags, Flags()],
    autoscale: Annotated[AutoscaleFlags, Flags()],
    report: _Percentiles,
    result_dir: _result_dir("simulate") = None,
    check_invariants: _CheckInvariants = False,
) -> None:
    """Simulate a trace through the vLLM-V1 core on a simulated clock (no GPU); with
    --replicas N or --fleet FILE, a fleet of such engines behind a router.

    Prints vLLM's start-up lines and "Serving Benchmark Result" block, then where the time
    went. TPOT = (E2EL - TTFT) / (output tokens - 1), vLLM's definition (guidellm calls
    this ITL); ITL = every gap between consecutive tokens.
    """
    from sim.engine_args import build_setup

    with user_errors():
        percentiles = report.options().percentiles
        trace = workload(work, trace_file)
        setup = build_setup(engine, sim.model, sim.gpu, sim.profile, work.seed,
                            check_invariants, sim.step_noise)
        rate = work.request_rate if work.dataset_name is not None else None
        path = result_dir or default_dir("simulate")
        if fleet.is_fleet or autoscale.enabled:
            run_fleet(trace, setup, fleet, pd, path, list(percentiles), rate, autoscale)
        elif pd.pd_decider != "never":
            raise ValueError("--pd-decider needs a fleet: --replicas N or --fleet FILE")
        else:
            run_simulation(trace, setup, path, list(percentiles), rate)


def run_simulation(trace: workloads.Trace, setup: SimSetup, path: Path,
                   percentiles: list[float], request_rate: float | None) -> None:
    from sim.simulator import simulate as run

    for line in setup.startup_lines:
        typer.echo(line, err=True)
    with progress("simulating", len(trace)) as update:
        result = run(trace, setup.config, setup.cost_model, update)
    run_dir = save_run(path, "simulate", trace, result, setup.describe())
    print_run(run_dir, result, percentiles, request_rate)


def run_fleet(trace: workloads.Trace, setup: SimSetup, fleet: FleetFlags, pd: PDFlags,
              path: Path, percentiles: list[float], request_rate: float | None,
              autoscale: AutoscaleFlags) -> None:
    """`setup` x --replicas (or the --fleet file's pools) behind the --router policy; with a
    P/D decider or pools with roles, prefill and decode disaggregated (`sim.pd`); with
    --autoscale, pools scaled in the loop (`sim.autoscale`)."""
    from analysis.fleet import fleet_block
    from analysis.scaling import replica_figure, scaling_block
    from runtime.router.registry import make_policy
    from sim.autoscale_flags import fixed_scaling, simulate_autoscaled_fleet
    from sim.fleet import simulate_fleet
    from sim.fleet_config import build_fleet, load_fleet
    from sim.pd_flags import simulate_pd_fleet

    config = setup.config
    spec = load_fleet(fleet.fleet) if fleet.fleet is not None else None
    replicas = (build_fleet(spec, config.seed, config.check_invariants,
                            config.step_noise is not None) if spec else [setup] * fleet.replicas)
    roles = spec.roles() if spec else None
    policy = make_policy(fleet.router, fleet.router_arg or [], config.seed)  # bad: one line
    if autoscale.enabled and pd.is_pd(roles):
        raise ValueError("--autoscale does not combine with P/D (--pd-decider, pool roles) yet")
    for line in replicas[0].startup_lines:
        typer.echo(line, err=True)
    with progress("simulating", len(trace)) as update:
        if autoscale.enabled:
            result, scaling = simulate_autoscaled_fleet(trace, setup, spec, fleet, autoscale,
                                                        update)
        elif pd.is_pd(roles):
            result = simulate_pd_fleet(trace, replicas, roles, fleet, pd, config.seed, update)
        else:
            result = simulate_fleet(trace, replicas, policy, fleet.router_refresh_ms / 1e3,
                                    fleet.routing_latency_ms / 1e3, update)
    if not autoscale.enabled:
        scaling = fixed_scaling(setup, spec, fleet, autoscale, result)
    run = save_run(path, "simulate", trace, result, replicas[0].describe(),
                   fleet=fleet.describe(spec), pd=pd.describe() if pd.is_pd(roles) else None,
                   autoscale=autoscale.describe() if autoscale.enabled else None,
                   scaling=scaling.to_json())
    print_run(run, result, percentiles, request_rate)
    typer.echo(fleet_block(run.requests, run.steps))
    typer.echo(scaling_block(run.info["scaling"]))
    if autoscale.enabled:
        save_figures({"replicas": replica_figure(run.info["scaling"], run.requests)},
                     run.path / "plots")


# ---- rt report / compare / sweep (analysis) ----


def load_checked(path: Path) -> Run:
    from analysis.report import check_run
    from analysis.rundir import load_run

    run = load_run(path)
    check_run(run)
    return run


@app.command("report")
@with_flags
def report(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (rt simulate / rt replay).")],
    flags: Annotated[ReportFlags, Flags()],
    files: Annotated[ReportFiles, Flags()],
) -> None:
    """Report one run with vLLM's metrics, where the time went (all requests and the slowest
    1%/10% by TTFT and E2E), and plots: percentile curves, CDFs, attribution, timeline.

    TPOT = (E2EL - TTFT) / (output tokens - 1), vLLM's (guidellm calls it ITL); ITL = every
    gap between consecutive tokens, pooled.
    """
    from analysis.report import report_run

    with user_errors():
        home = run_dir if run_dir.is_dir() else run_dir.with_suffix("")  # a vLLM JSON: FILE/
        text, written, figures = report_run(load_checked(run_dir), flags.options(), files,
                                            home)
        typer.echo(text)
        for path in written:
            typer.echo(f"rt: wrote {path}", err=True)
        save_figures(figures, files.plot_dir or home / "plots")


@app.command("compare")
@with_flags
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories (two or more).")],
    flags: Annotated[ReportFlags, Flags(defaults={"percentile_metrics": "ttft,tpot,itl,e2el",
                                                  "metric_percentiles": "50,90,99"})],
    csv: Annotated[Path | None, typer.Option("--csv", help="Also write the table here.")]
    = None,
    html: Annotated[Path | None, typer.Option(
        "--html", help="Also write one self-contained HTML page here: the table, the overlaid "
        "curves and each run's report.")] = None,
    plot_dir: Annotated[Path | None, typer.Option(
        "--plot-dir", help="Where the overlaid curves go (default: results/compare-<time>).")]
    = None,
    plots: _Plots = True,
) -> None:
    """Compare runs of one workload side by side: rows = metrics, columns = runs, and a
    ratio column against the first run; overlaid percentile curves and CDFs whose legend
    names what differs (budget, model, sim vs real...)."""
    from analysis.compare import compare_runs, render_table

    with user_errors():
        if len(run_dirs) < 2:
            raise ValueError("compare needs two or more run directories")
        runs = [load_checked(p) for p in run_dirs]
        table, figures = compare_runs(runs, flags.options(), plots)
        typer.echo(render_table(table))
        if csv is not None:
            table.to_csv(csv)
        if html is not None:
            from analysis.html_report import write_html_report

            typer.echo(f"rt: wrote {write_html_report(runs, html, flags.options())}", err=True)
        save_figures(figures, plot_dir or default_dir("compare"))


_SWEEP_ENGINE = ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
                 "num_gpu_blocks_override", "block_size")
_SWEEP_WORK = ("fmt", "dataset_name", "num_prompts", "input_len", "output_len", "range_ratio",
               "burstiness", "seed", "start_s", "duration_s", "first_n")


@app.command("sweep")
@with_flags
def sweep(
    *,
    trace_file: _Trace = None,
    work: Annotated[WorkloadFlags, Flags(only=_SWEEP_WORK)],
    grid: Annotated[EngineArgs, Flags(only=_SWEEP_ENGINE, lists=True, panel=GRID_PANEL)],
    targets: Annotated[SimFlags, Flags(only=("model", "gpu"), lists=True, panel=GRID_PANEL,
                                       defaults={"model": "llama-3.1-8b", "gpu": "h200"})],
    fleets: Annotated[FleetFlags, Flags(only=("replicas", "router"), lists=True,
                                        panel=GRID_PANEL)],
    sim: Annotated[SimFlags, Flags(only=("profile",))],
    flags: Annotated[ReportFlags, Flags(defaults={"percentile_metrics": "ttft,tpot,itl,e2el",
                                                  "metric_percentiles": "50,90,99"})],
    how: Annotated[SweepFlags, Flags()],
    result_dir: Annotated[Path | None, typer.Option(
        "--result-dir", help="Sweep directory (default: results/sweep-<time>).")] = None,
    plots: _Plots = True,
) -> None:
    """Simulate a grid of engine flags x request rates on one trace, in parallel; print a
    results table and draw latency against each swept flag and against rate (knee marked).

    With --slo and --find-max-rate: bisect the rate for the highest one meeting every SLO."""
    from analysis.sweep import parse_slo, rate_bracket, search_max_rates, search_summary
    from sim.sweep import SweepPlan, sweep_configs

    with user_errors():
        slos = parse_slo(how.slo) if how.slo is not None else None
        if how.find_max_rate and not slos:
            raise ValueError("--find-max-rate needs --slo")
        key, axis = how.axis()
        plan = SweepPlan(sweep_configs(grid, targets["model"], targets["gpu"],
                                       fleets.get("replicas", [1]),
                                       fleets.get("router", ["round-robin"])),
                         *_sweep_workload(trace_file, work, key == "time_scale"), sim.profile,
                         work.seed, result_dir or default_dir("sweep"))
        run = functools.partial(_run_sweep_jobs, options=_sweep_options(flags, slos),
                                executor=how.executor, jobs=how.jobs, address=how.address)
        if how.find_max_rate:
            assert slos is not None
            bracket = rate_bracket(how.bracket(), axis if key == "request_rate" else None,
                                   plan.trace_rate())
            records, searches = search_max_rates(
                len(plan.configs), lambda batch: run([plan.job(i, "request_rate", r)
                                                      for i, r in batch]),
                slos, bracket, how.rate_tolerance)
            for config, search in zip(plan.configs, searches, strict=True):
                typer.echo(search_summary(config.labels, search))
        else:
            records = run(plan.grid(key, axis or [None]))
        _sweep_output(records, plan.root, slos, plots)


def _sweep_workload(trace_file: Path | None, work: WorkloadFlags, scaled: bool
                    ) -> tuple[workloads.Trace | None, WorkloadFlags | None]:
    """The sweep's base trace (a file, windowed) or its synthetic workload."""
    if work.dataset_name is None:
        return workload(work, trace_file), None
    if work.dataset_name != "random" or trace_file is not None or scaled:
        raise ValueError("sweep's synthetic workload is --dataset-name random, without "
                         "--trace or --time-scale")
    return None, work


def _sweep_options(flags: ReportFlags, slos: dict[str, float] | None) -> Any:
    """The report options, widened to the metrics and percentiles the SLOs need."""
    from analysis.report import ReportOptions
    from analysis.sweep import slo_needs

    options = flags.options()
    if not slos:
        return options
    metrics, percentiles = slo_needs(slos)
    return ReportOptions(list(dict.fromkeys([*options.percentile_metrics, *metrics])),
                         sorted(set(options.percentiles) | set(percentiles)), options.goodput)


def _run_sweep_jobs(jobs_: list[tuple[Any, str]], options: Any, executor: str,
                    jobs: int | None, address: str | None) -> list[dict[str, Any]]:
    from sim.sweep import run_all

    with progress("sweeping", len(jobs_)) as update:
        return run_all(_sweep_worker, [(point, options, d) for point, d in jobs_], executor,
                       jobs, address, update)


def _sweep_worker(job: tuple[Any, Any, str]) -> dict[str, Any]:
    """One sweep run (in a pool process or a Ray task): simulate, write the run directory,
    report it from the files."""
    from analysis.report import result_dict
    from analysis.rundir import finished_run
    from sim.sweep import simulate_point

    point, options, run_dir = job
    done = finished_run(Path(run_dir), sweep=dict(point.labels), trace=trace_info(point.trace))
    if done is not None:  # the sweep runs again into its directory: this point finished
        return {**point.labels, **result_dict(done, options), "run_dir": run_dir}
    result, setup = simulate_point(point)
    rate = {"request_rate": point.labels["request_rate"]} \
        if "request_rate" in point.labels else {}
    run = save_run(Path(run_dir), "simulate", point.trace, result, setup.describe(),
                   sweep=dict(point.labels), **rate)
    return {**point.labels, **result_dict(run, options), "run_dir": run_dir}


def _sweep_output(records: list[dict[str, Any]], root: Path, slos: dict[str, float] | None,
                  plots: bool) -> None:
    from analysis.sweep import write_sweep

    text, figures = write_sweep(records, root, _SWEEP_ENGINE, slos, plots)
    typer.echo(text)
    save_figures(figures, root)


# ---- rt plan (sim + analysis) ----


@app.command("plan")
@with_flags
def plan(
    *,
    trace_file: Annotated[Path | None, typer.Argument(
        help="Trace file (default: the embedded excerpt).", show_default=False)] = None,
    work: Annotated[WorkloadFlags, Flags(only=("fmt", "start_s", "duration_s", "first_n",
                                               "time_scale", "target_rate", "seed"))],
    space: Annotated[PlanFlags, Flags()],
    how: Annotated[SweepFlags, Flags(only=("executor", "address", "jobs"))],
    result_dir: Annotated[Path | None, typer.Option(
        "--result-dir", help="Where every simulated shape's run directory, plan.csv, the "
        "Pareto plot and the winning fleet.toml go (default: results/plan-<time>); an "
        "existing one is resumed.")] = None,
) -> None:
    """The cheapest fleet that meets every SLO on a trace, with no failed request: searches
    GPU kinds x models x tensor parallelism x token budgets x max_num_seqs x routers,
    prunes what cannot work before simulating, and bisects each candidate's replica count."""
    from analysis.plan import pareto_figure, plan_table, render_plan
    from analysis.sweep import parse_slo
    from sim.plan import cheapest, search

    with user_errors():
        if space.slo is None:
            raise ValueError("--slo is required, e.g. p99_ttft_ms=500,p99_itl_ms=50")
        slos, prices = parse_slo(space.slo), space.prices()
        trace, root = workload(work, trace_file), result_dir or default_dir("plan")
        records: list[dict[str, Any]] = []
        judge = functools.partial(_judge_shapes, trace=trace, seed=work.seed, slos=slos,
                                  root=root, how=how, records=records)
        searches, pruned = search(space.candidates(), trace, space.max_gpus, prices, judge,
                                  work.seed)
    for p in pruned:
        note([f"pruned {p.candidate.name()}: {p.reason}"])
    table = plan_table(records, slos)
    typer.echo(render_plan(table))
    table.to_csv(root / "plan.csv", index=False)
    save_figures({"pareto": pareto_figure(records)}, root)
    ranked = cheapest(searches, prices)
    typer.echo(f"rt: {len(records)} shapes simulated, {len(pruned)} candidates pruned", err=True)
    if not ranked:
        fail(f"no shape within --max-gpus {space.max_gpus} meets {space.slo} (closest: "
             f"{table.iloc[0]['shape'] if len(table) else 'none simulated'})")
    (root / "fleet.toml").write_text(ranked[0].fleet_toml())
    typer.echo(f"cheapest: {ranked[0].name()} at ${ranked[0].cost_per_hour:.2f}/h "
               f"({ranked[0].gpus} GPUs, router {ranked[0].candidate.router}) -> "
               f"{root / 'fleet.toml'}")


def _judge_shapes(shapes: list[Any], trace: workloads.Trace, seed: int,
                  slos: dict[str, float], root: Path, how: SweepFlags,
                  records: list[dict[str, Any]]) -> list[bool]:
    """Simulate the shapes (or read a finished run's record: plans resume), keep their
    records, say which meet the SLOs."""
    from analysis.sweep import meets_slo
    from sim.sweep import run_all

    options = _sweep_options(ReportFlags(percentile_metrics="ttft,tpot,itl,e2el"), slos)
    jobs = [(shape, trace, seed, options, str(root / shape.name())) for shape in shapes]
    with progress("planning", len(jobs)) as update:
        done = run_all(_plan_worker, jobs, how.executor, how.jobs, how.address, update)
    for record in done:
        record["meets_slo"] = meets_slo(record, slos)
    records += done
    return [bool(r["meets_slo"]) for r in done]


def _plan_worker(job: tuple[Any, workloads.Trace, int, Any, str]) -> dict[str, Any]:
    """One shape: simulate (one engine, or the fleet behind its router), write the run
    directory and its record (plan.json); a directory with plan.json is not run again."""
    from analysis.plan import what_binds
    from analysis.report import result_dict
    from runtime.router.registry import make_policy
    from sim.engine_args import build_setup
    from sim.fleet import simulate_fleet
    from sim.pd import PDDecider, simulate_pd
    from sim.simulator import simulate as run

    shape, trace, seed, options, run_dir = job
    path = Path(run_dir)
    if (path / "plan.json").is_file():
        return dict(json.loads((path / "plan.json").read_text()))
    c = shape.candidate
    setup = build_setup(c.engine_args, c.model, c.gpu, None, seed)
    fleet = [setup] * shape.num_replicas
    if c.pd_ratio is not None:
        result = simulate_pd(trace, fleet, c.roles(shape.replicas), make_policy(c.router, [], seed),
                             make_policy(c.router, [], seed + 1), PDDecider("always"))
    elif shape.num_replicas == 1:
        result = run(trace, setup.config, setup.cost_model)
    else:
        result = simulate_fleet(trace, fleet, make_policy(c.router, [], seed))
    saved = save_run(path, "simulate", trace, result, setup.describe(),
                     plan={"shape": shape.name(), "replicas": shape.num_replicas})
    record = {**result_dict(saved, options), "shape": shape.name(), "gpu": c.gpu,
              "model": c.model, "tp": c.tensor_parallel_size, "replicas": shape.num_replicas,
              "gpus": shape.gpus, "cost_per_hour": shape.cost_per_hour,
              "binds": what_binds(saved.requests)}
    (path / "plan.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


# ---- rt replay (backends) ----

_REAL = "Real engine"
_DEFAULT_REPLAY = WorkloadFlags(dataset_name="random", num_prompts=32, input_len=96,
                                output_len=24, range_ratio=0.5, request_rate=8.0)
_ModelDir = Annotated[Path | None, typer.Option(
    "--model", help="Local Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3). "
    "Default: a tiny random Llama, built once in ~/.cache/rt/tiny-llama-v2.",
    rich_help_panel=_REAL)]


@app.command()
@with_flags
def replay(
    *,
    trace_file: Annotated[Path | None, typer.Argument(
        help="Trace file (any `rt trace` format). Default: a small synthetic trace "
        f"({_DEFAULT_REPLAY.num_prompts} random requests at {_DEFAULT_REPLAY.request_rate:g} "
        "req/s), unless --dataset-name is given.", show_default=False)] = None,
    model: _ModelDir = None,
    work: Annotated[WorkloadFlags, Flags(exclude=("max_model_len",))],
    engine: Annotated[EngineFlags, Flags()],
    real: Annotated[RealEngineFlags, Flags()],
    report: _Percentiles,
    result_dir: _result_dir("replay") = None,
    check_invariants: _CheckInvariants = False,
    client: Annotated[EndpointFlags, Flags()],
) -> None:
    """Replay a trace in real time through the vLLM-V1 core and a real model (CPU or GPU),
    or, with --endpoint, against any OpenAI-compatible server (client-side timing).

    Requests are released at their arrival times on the wall clock; the output blocks and
    the run directory are those of `rt simulate`. With no arguments: a tiny random Llama and
    a small synthetic trace on the CPU. Ctrl-C writes the records so far.
    """
    with user_errors():
        percentiles = list(report.options().percentiles)
        trace = replay_trace(work, trace_file)
        if client.endpoint is not None:
            settings = client.config_args(str(model) if model else None, work.seed)
            run_endpoint(trace, settings, result_dir or default_dir("endpoint"), percentiles)
            return
        setup, tokenizer = real_engine(model, engine, real, work.seed)
        check_lengths(trace, setup.scheduler.max_model_len)
        run_replay(trace, setup, tokenizer, result_dir or default_dir("replay"), percentiles,
                   check_invariants)


def replay_trace(work: WorkloadFlags, path: Path | None) -> workloads.Trace:
    """The trace file, the --dataset-name workload, or the small default one."""
    if path is None and work.dataset_name is None:
        work = dataclasses.replace(_DEFAULT_REPLAY, seed=work.seed, first_n=work.first_n,
                                   time_scale=work.time_scale)
    return workload(work, path)


def real_engine(model: Path | None, engine: EngineFlags, real: RealEngineFlags,
                seed: int) -> tuple[RealSetup, Tokenizer | None]:
    """Build the real engine (and the model's tokenizer, if it has one); one line on error.
    With --random-weights, --model may also name a preset shape (llama-3.1-8b, ...)."""
    from transformers.utils import logging as hf_logging

    from backends.engine.setup import build_engine, load_tokenizer, real_engine_args
    from backends.engine.tiny_model import build_tiny_llama, preset_config_dir

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    with user_errors():
        model_dir = model if model is not None else build_tiny_llama()
        if real.random_weights and not model_dir.is_dir():
            model_dir = preset_config_dir(str(model_dir))
        args = real_engine_args(model_dir, engine, real, seed)
        return build_engine(args), load_tokenizer(model_dir)


def check_lengths(trace: workloads.Trace, max_model_len: int) -> None:
    for req in trace:
        if req.prompt_len + req.output_len > max_model_len:
            fail(f"request {req.request_id}: {req.prompt_len} prompt + {req.output_len} output "
                 f"tokens exceed max_model_len={max_model_len} (clip the trace with "
                 "`rt trace convert --max-model-len`)")


def replay_on(trace: workloads.Trace, setup: RealSetup, tokenizer: Tokenizer | None,
              check_invariants: bool = False) -> RunResult:
    from backends.replay.driver import ReplayConfig
    from backends.replay.driver import replay as run

    config = ReplayConfig(setup.scheduler, setup.cache, setup.shape.vocab_size,
                          setup.args.seed, check_invariants)
    with progress("replaying", len(trace)) as update:
        return run(trace, config, setup.runner, tokenizer, update)


def run_replay(trace: workloads.Trace, setup: RealSetup, tokenizer: Tokenizer | None,
               path: Path, percentiles: list[float], check_invariants: bool) -> None:
    from sim.cost.kv_cache_sizing import startup_lines

    cache, sched = setup.cache, setup.scheduler
    for line in startup_lines(cache.num_blocks, cache.block_size, sched.max_model_len):
        typer.echo(line, err=True)
    note([f"model {setup.args.model_dir} ({setup.shape.model_type}) on {setup.args.device}, "
          f"{setup.dtype}, attention: {setup.attention}"])
    result = replay_on(trace, setup, tokenizer, check_invariants)
    run = save_run(path, "replay", trace, result, setup.describe(),
                   interrupted=result.interrupted, tokenizer=tokenizer is not None)
    print_run(run, result, percentiles)
    if result.interrupted:
        typer.echo("rt: interrupted: records of the requests so far were written", err=True)
        raise typer.Exit(code=130)


def run_endpoint(trace: workloads.Trace, settings: dict[str, Any], path: Path,
                 percentiles: list[float]) -> None:
    """Replay against the endpoint, write the run directory, print vLLM's block; failed
    requests are counted (exit 0, as vLLM bench) unless every request failed (exit 1)."""
    try:
        from backends.replay.endpoint import replay_endpoint
        from backends.replay.endpoint import run_info as endpoint_info
        from backends.replay.endpoint_probe import EndpointConfig, probe
    except ImportError as err:
        fail(f"--endpoint needs {err.name}: pip install 'rt[serve]'")
    from analysis.console import benchmark_block
    from analysis.metrics import benchmark_metrics
    from analysis.rundir import load_run, run_info, write_run

    config = EndpointConfig(**settings)
    info = probe(config)
    if info.max_model_len is not None:
        check_lengths(trace, info.max_model_len)
    note([f"endpoint {info.completions_url}, model {info.model}, client-side timing"])
    with progress("replaying", len(trace)) as update:
        result = replay_endpoint(trace, config, info, update)
    write_run(path, [r.to_row() for r in result.requests], {},
              run_info("endpoint", path.name, trace_info(trace),
                       **endpoint_info(result, config, info)))
    failed, sent = result.num_failed, len(result.requests)
    if sent > failed:
        typer.echo(benchmark_block(benchmark_metrics(load_run(path).requests, percentiles),
                                   percentiles=percentiles, request_rate=None))
    first = next(iter(result.errors.items()), ("", ""))
    if failed:
        note([f"{failed} of {sent} requests failed (first: {first[0]}: {first[1]}); "
              f"messages in {path / 'run.json'}"])
    typer.echo(f"rt: wrote {path} ({sent} requests, client-side timing, "
               f"{result.wall_s:.2f} s wall)", err=True)
    if result.interrupted:
        typer.echo("rt: interrupted: records of the requests so far were written", err=True)
        raise typer.Exit(code=130)
    if sent and failed == sent:
        typer.echo(f"rt: every request failed ({first[1]})", err=True)
        raise typer.Exit(code=1)


# ---- rt serve (backends; --simulate: sim) ----



@app.command()
@with_flags
def serve(
    *,
    model: Annotated[str | None, typer.Option(
        "--model", "--sim-model", help="Local Hugging Face model directory (default: the tiny "
        "random Llama on the CPU); with --simulate, the simulated model (preset or config, "
        "default llama-3.1-8b).", rich_help_panel=SERVER_PANEL)] = None,
    sim: Annotated[SimFlags, Flags(only=("gpu", "profile"))],
    engine: Annotated[EngineFlags, Flags()],
    real: Annotated[RealEngineFlags, Flags(exclude=("random_weights",))],
    server: Annotated[ServeFlags, Flags()],
    seed: _Seed = 0,
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /tokenize,
    /health, /metrics) from an engine-core process: a real model, or with --simulate the
    cost model on the wall clock. SIGTERM/Ctrl-C drains, then exits."""
    from backends.serve.api_server import ServeConfig, run_server

    with user_errors():
        if server.simulate:
            factory, kwargs, name, tokenizer_dir = _serve_simulated(model, sim, engine, seed)
        else:
            factory, kwargs, name, tokenizer_dir = _serve_real(model, engine, real, seed)
    config = ServeConfig(server.served_model_name or name, factory, kwargs, tokenizer_dir,
                         server.max_num_queued_requests, api_key=server.api_key,
                         max_request_bytes=server.max_request_bytes)
    until_stopped(f"serving {config.model_name} on http://{server.host}:{server.port}/v1",
                  "server", lambda: run_server(config, server.host, server.port,
                                               server.shutdown_timeout,
                                               server.uvicorn_log_level))


def until_stopped(started: str, what: str, run: Callable[[], None]) -> None:
    """Say what serves where, run it until it stops (a RuntimeError: one line, exit 2)."""
    typer.echo(f"rt: {started}", err=True)
    try:
        run()
    except RuntimeError as err:
        fail(str(err))
    typer.echo(f"rt: {what} stopped", err=True)


def _serve_simulated(model: str | None, sim: SimFlags, engine: EngineFlags, seed: int
                     ) -> tuple[Any, dict[str, Any], str, Path | None]:
    """The wall-clock simulator's executor factory (validated here, built in the engine)."""
    from sim.engine_args import build_setup
    from sim.live_executor import build_live_executor

    args = EngineArgs(**dataclasses.asdict(engine))
    sim_model = model or "llama-3.1-8b"
    build_setup(args, sim_model, sim.gpu, sim.profile, seed)  # one-line errors before the fork
    kwargs = {"engine_args": args, "model": sim_model, "gpu": sim.gpu, "profile": sim.profile,
              "seed": seed}
    model_dir = Path(sim_model) if Path(sim_model).is_dir() else None  # its tokenizer, if any
    return build_live_executor, kwargs, sim_model, model_dir


def _serve_real(model: str | None, engine: EngineFlags, real: RealEngineFlags, seed: int
                ) -> tuple[Any, dict[str, Any], str, Path]:
    """The real executor's factory; the model is loaded in the engine process."""
    from backends.engine.setup import real_engine_args
    from backends.engine.tiny_model import build_tiny_llama
    from backends.serve.engine_process import build_real_executor

    model_dir = Path(model) if model is not None else build_tiny_llama()
    if not (model_dir / "config.json").is_file():
        fail(f"--model {model_dir}: not a model directory (no config.json)")
    args = real_engine_args(model_dir, engine, real, seed)
    name = "tiny-llama" if model is None else model  # as typed: vLLM's default served name
    return build_real_executor, {"args": args}, name, model_dir


# ---- rt calibrate / fidelity ----

def calibrate_grid(setup: RealSetup, tokenizer: Tokenizer | None, cal: CalibrationFlags,
                   extra_steps: list[Path]) -> Profile:
    """Run the grid on `setup`, time the API server, fit; returns the `Profile`."""
    from analysis.rundir import rt_version
    from backends.engine.calibration_grid import calibrate_engine
    from sim.calibrate import profile_from_grid, read_replay_steps

    with user_errors():
        steps = [read_replay_steps(path, "wall") for path in extra_steps]
        with progress("calibrating") as update:
            measured = calibrate_engine(setup, tokenizer, cal.quick, cal.time_limit, update)
        return profile_from_grid(measured, steps, rt_version())


def profile_from_steps(paths: list[Path], target: str, api_server: Any = None,
                       drift: bool = False) -> Profile:
    """`sim.calibrate.profile_from_replays`, its errors one line, with a note when the drift
    asked for was not found."""
    from analysis.rundir import rt_version
    from sim.calibrate import profile_from_replays

    try:
        profile = profile_from_replays(paths, target, api_server=api_server, drift=drift,
                                       rt_version=rt_version())
    except ValueError as err:
        fail(f"--from-steps: {err}")
    if drift and profile.step_time_drift_quantiles is None:
        note(["--step-drift: fewer than 2 windows of 0.25 s with 8+ steps in these replays; "
              "the profile has i.i.d. step-time scatter only"])
    return profile


def profile_from_client_runs(runs: list[Any], engine: EngineFlags, seed: int,
                             max_model_len: int | None = None, model: str = "unknown"
                             ) -> Profile:
    """`sim.client_calibrate`'s fit of client-timed runs (`sim.client_steps.ClientRun`)
    under the server's engine flags; prints the fit per term."""
    from analysis.rundir import rt_version
    from sim.client_calibrate import endpoint_configs
    from sim.client_calibrate import profile_from_client_runs as fit

    with user_errors():
        scheduler, cache, sources = endpoint_configs(engine, runs, max_model_len)
        profile, result = fit(runs, scheduler, cache, model=model, rt_version=rt_version(),
                              date=datetime.datetime.now(datetime.UTC).isoformat(
                                  timespec="seconds"), sources=sources, seed=seed)
    for line in result.lines():
        typer.echo(line, err=True)
    return profile


def calibrate_from_runs(paths: list[Path], engine: EngineFlags, seed: int) -> Profile:
    """`rt calibrate --from-run`: client-timed runs (run directories, vLLM bench JSONs)."""
    from analysis.rundir import load_run
    from sim.client_steps import client_run

    runs, infos = [], []
    with user_errors():
        for path in paths:
            run = load_run(path)
            columns = {name: run.requests[name].tolist() for name in run.requests.columns}
            try:
                runs.append(client_run(str(path), columns))
            except ValueError as err:
                fail(f"--from-run {err}")
            infos.append(run.info)
    lens = [i.get("endpoint", {}).get("max_model_len") for i in infos]
    names = [(i.get("model") or {}).get("name") for i in infos]
    return profile_from_client_runs(runs, engine, seed, next((x for x in lens if x), None),
                                    str(next((x for x in names if x), "unknown")))


def write_profile(profile: Profile, path: Path) -> Path:
    """Print the fit's quality and coefficients, write the profile."""
    from sim.profile import write_profile as write

    for name in ("held_out", "all_samples"):
        q = (profile.fit or {}).get(name) or {}
        if q.get("samples"):
            typer.echo(f"fit on {name.replace('_', ' ')}: {q['samples']} steps, MAPE "
                       f"{q['mape']:.1%}, p90 {q['p90_ape']:.1%}, worst {q['worst_ape']:.1%}, "
                       f"total-time bias {q['bias']:+.1%}", err=True)
    for key, value in dataclasses.asdict(profile.coefficients).items():
        typer.echo(f"  {key:<30} {value:.4g} s", err=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    write(profile, path)
    return path


@app.command("calibrate")
@with_flags
def calibrate(
    *,
    output: Annotated[Path, typer.Option("-o", "--output", help="Profile JSON to write.")],
    model: _ModelDir = None,
    real: Annotated[RealEngineFlags, Flags()],
    engine: Annotated[EngineFlags, Flags()],
    cal: Annotated[CalibrationFlags, Flags()],
    from_steps: Annotated[list[Path] | None, typer.Option(
        "--from-steps", help="steps.parquet (or run directory) of an earlier `rt replay`: "
        "training data. Alone: fit on these steps only; with --model: added to the grid.",
        rich_help_panel=CALIBRATION_PANEL)] = None,
    target: Annotated[str, typer.Option(
        "--target", help="Step time to fit from --from-steps alone: wall (end - start, what "
        "the simulator must reproduce) or execute (the runner's measurement).",
        rich_help_panel=CALIBRATION_PANEL)] = "wall",
    from_run: Annotated[list[Path] | None, typer.Option(
        "--from-run", help="A client-timed run (`rt replay --endpoint` directory, or a `vllm "
        "bench serve --save-detailed` JSON): fit the step costs and the front end's to its "
        "chunk times, under the server's engine flags (docs/calibration.md).",
        rich_help_panel=CALIBRATION_PANEL)] = None,
    seed: _Seed = 0,
) -> None:
    """Fit the simulator's `profile` cost model to the real backend: a designed grid of
    prefill, decode and mixed batches (warm-up, repeats, medians), the API-server costs, a
    non-negative least-squares fit of the six coefficients, its held-out error. Writes a
    profile for `rt simulate --profile`."""
    if cal.step_drift and not (from_steps and model is None):
        fail("--step-drift needs --from-steps alone (a grid has no step-time scatter)")
    if from_run:
        if from_steps or model is not None:
            fail("--from-run fits client timings alone: without --from-steps or --model")
        profile = calibrate_from_runs(from_run, engine, seed)
    elif from_steps and model is None:
        profile = profile_from_steps(from_steps, target, drift=cal.step_drift)
    else:
        setup, tokenizer = real_engine(model, engine, real, seed)
        profile = calibrate_grid(setup, tokenizer, cal, from_steps or [])
    with user_errors():
        write_profile(profile, output)
    typer.echo(f"rt: wrote {output}", err=True)


@app.command("fidelity")
@with_flags
def fidelity(
    *,
    trace_file: Annotated[Path, typer.Argument(help="Trace file (any `rt trace` format).")],
    model: _ModelDir = None,
    real: Annotated[RealEngineFlags, Flags()],
    work: Annotated[WorkloadFlags, Flags(only=("fmt", "first_n", "time_scale", "seed"))],
    engine: Annotated[EngineFlags, Flags()],
    noise: Annotated[SimFlags, Flags(only=("step_noise", "gpu"), defaults={"step_noise": True})],
    cal: Annotated[CalibrationFlags, Flags()],
    how: Annotated[FidelityFlags, Flags()],
    fleet: Annotated[FleetFlags, Flags(only=("replicas", "router", "router_arg",
                                             "router_refresh_ms"))],
    result_dir: Annotated[Path | None, typer.Option(
        "--result-dir", help="Where real/, sim/, profile.json, fidelity.json and the plots "
        "go (default: results/fidelity-<time>).")] = None,
    plots: _Plots = True,
) -> None:
    """Replay TRACE on the real backend and simulate it with the profile under the same
    engine flags and KV pool (blocks), then report the simulator's error: per metric (mean,
    p50, p90, p99 of TTFT, ITL, TPOT, E2E; throughput), per step, per request (TTFT).

    Without --profile it calibrates first, by default on replays of other requests like
    TRACE's; with --repeats N it replays N times and reports against their mean, with the
    real runs' own spread as the noise floor."""
    from sim.calibrate import replay_api_cost

    with user_errors():
        how.check(cal.step_drift, noise.step_noise)
    root = result_dir or default_dir("fidelity")
    if how.fleet:  # rt serve --simulate replicas behind rt route, against sim.fleet
        from analysis.fleet_fidelity import write_fleet_fidelity
        from analysis.rundir import save_result
        from backends.route.fleet_fidelity import fleet_fidelity_plan, run_fleet_fidelity
        from sim.fidelity import fleet_twin
        with user_errors(), progress("replaying through the router") as update:
            trace, args = workload(work, trace_file), (engine, str(model or "llama-3.1-8b"),
                                                       noise.gpu, how.profile, work.seed)
            typer.echo(run_fleet_fidelity(fleet_fidelity_plan(Path(__file__), fleet, *args),
                trace, root, save_result, functools.partial(fleet_twin, trace, fleet, *args),
                write_fleet_fidelity, update))
        return
    with user_errors():
        trace = workload(work, trace_file)
        setup, tokenizer = real_engine(model, engine, real, work.seed)
        check_lengths(trace, setup.scheduler.max_model_len)
        root.mkdir(parents=True, exist_ok=True)
        profile = how.profile
        if profile is None and how.calibrate_on == "grid" and not how.fit_on_replay:
            profile = write_profile(calibrate_grid(setup, tokenizer, cal, []),
                                    root / "profile.json")
        reals, calibrations = _fidelity_replays(
            trace, setup, tokenizer, root, how.repeats,
            profile is None and not how.fit_on_replay and how.calibrate_on == "replay")
        if replays := calibrations or (reals if how.fit_on_replay else []):
            profile = write_profile(profile_from_steps(replays, "wall", replay_api_cost(replays),
                                                       cal.step_drift), root / "profile.json")
        assert profile is not None
        sims = _fidelity_simulate(trace, setup, profile, root, noise.step_noise, how.sim_runs)
        _fidelity_report(reals, sims, profile, root, plots, how.max_error)


def _fidelity_replays(trace: workloads.Trace, setup: RealSetup, tokenizer: Tokenizer | None,
                      root: Path, repeats: int, calibrate: bool) -> tuple[list[Path], list[Path]]:
    """The real replays of TRACE and the calibration replays of traces resampled from it
    (out of sample), interleaved as `analysis.fidelity.replay_order` says."""
    from analysis.fidelity import replay_order

    dirs: dict[str, list[Path]] = {"real": [], "calibration": []}
    for kind, i in replay_order(repeats, calibrate):
        path = root / (kind + (f"-{i + 1}" if i else ""))
        source = (trace if kind == "real"
                  else workloads.resample_like(trace, setup.args.seed + i + 1))
        result = replay_on(source, setup, tokenizer)
        if result.interrupted:
            raise typer.Exit(code=130)
        save_run(path, "replay", source, result, setup.describe(),
                 tokenizer=tokenizer is not None)
        typer.echo(f"rt: replayed {len(source)} requests, {result.num_steps} steps, "
                   f"{result.wall_s:.2f} s wall -> {path}", err=True)
        dirs[kind].append(path)
    return dirs["real"], dirs["calibration"]


def _fidelity_simulate(trace: workloads.Trace, setup: RealSetup, profile: Path, root: Path,
                       step_noise: bool, runs: int) -> list[Path]:
    """The twin's simulations (`sim.fidelity.twin_simulations`): root/sim, root/sim-2, ..."""
    from sim.fidelity import twin_simulations

    sim, twins, notes = twin_simulations(trace, setup.scheduler, setup.cache,
                                         str(setup.args.model_dir), profile, setup.args.seed,
                                         step_noise, runs)
    note(notes)
    for twin in twins:
        save_run(root / twin.name, "simulate", trace, twin.result, sim.describe(),
                 step_noise_seed=twin.noise_seed)
    return [root / twin.name for twin in twins]


def _fidelity_report(real_dirs: list[Path], sim_dirs: list[Path], profile_path: Path,
                     root: Path, plots: bool, max_error: float | None) -> None:
    from analysis.fidelity import write_fidelity
    from sim.calibrate import predict_step_rows
    from sim.profile import load_profile

    reals = [load_checked(path) for path in real_dirs]
    predicted = predict_step_rows(load_profile(profile_path).coefficients, reals[0].steps)
    text, violations, figures = write_fidelity(reals, [load_checked(p) for p in sim_dirs],
                                               predicted, root, plots, max_error)
    typer.echo(text)
    save_figures(figures, root / "plots")
    typer.echo(f"rt: wrote {root}/fidelity.json", err=True)
    for line in violations:
        typer.echo(f"rt: fidelity: {line}", err=True)
    if violations:
        raise typer.Exit(code=1)


# ---- rt bench ... ----


@bench_app.command("scheduler")
def bench_scheduler(
    seed: Annotated[int, typer.Option(help="Seed of the synthetic prompts.")] = 0,
    quick: Annotated[bool, typer.Option(help="Fewer steps (a smoke run).")] = False,
    out: _Out = None,
) -> None:
    """Microseconds per step of schedule() + update_from_output(): 64/256/1024 running
    decodes with prefix caching, and a mixed chunked-prefill workload."""
    from sim.benchmarks import bench_scheduler as run

    write_json(run(seed=seed, quick=quick), out)


@bench_app.command("sim")
@with_flags
def bench_sim(
    sim: Annotated[SimFlags, Flags(only=("model", "gpu"))],
    traces: Annotated[list[Path] | None, typer.Option(
        "--trace", help="Trace to simulate (repeatable). Default: the embedded excerpt.")]
    = None,
    baseline: Annotated[bool, typer.Option(
        "--baseline/--no-baseline", help="Also time one-by-one stepping (slower).")] = True,
    out: _Out = None,
) -> None:
    """Simulated requests per wall-clock second, fast-forwarding vs stepping one by one."""
    from sim.benchmarks import bench_sim as run

    with user_errors():
        loaded = {str(path): workloads.load_trace(path).trace for path in traces or []}
        if not loaded:
            loaded = {"embedded azure_conv first 10 min": workloads.default_trace()}
        report = run(loaded, sim.model, sim.gpu, baseline)
    write_json(report, out)


@bench_app.command("serve")
@with_flags
def bench_serve(
    work: Annotated[WorkloadFlags, Flags(only=("request_rate", "input_len", "output_len",
                                               "seed"),
                                         defaults={"input_len": 256})],
    sim: Annotated[SimFlags, Flags(only=("model", "gpu", "profile"))],
    engine: Annotated[EngineFlags, Flags(only=("max_num_seqs", "max_model_len"),
                                         defaults={"max_model_len": 4096})],
    bench: Annotated[ServeBenchFlags, Flags()],
    concurrency: Annotated[int, typer.Option(
        "--concurrency", min=1, help="Streams in flight at most (client-side).")] = 200,
    num_prompts: Annotated[int | None, typer.Option(
        "--num-prompts", min=1, help="Requests (default: --concurrency).")] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds one request may take at most.")] = 300.0,
    out: _Out = None,
) -> None:
    """Load-test `rt serve --simulate` on a free loopback port (bounded; the server is always
    stopped): replay random requests through the chosen client, simulate the same arrivals
    with `rt simulate`'s core, and report errors, throughput, each process's CPU seconds and
    the latency the server path adds (server minus simulated, ms). With --soak, hold
    --concurrency streams for SECONDS instead. Exit 1 on any error."""
    from backends.bench.serve_load import (
        LoadConfig,
        compare,
        run_load,
        sent_arrivals,
        simulated_server,
    )
    from sim.engine_args import build_setup
    from sim.simulator import simulate as run_simulate

    with user_errors():
        work = dataclasses.replace(work, dataset_name="random",
                                   num_prompts=num_prompts or concurrency)
        trace = workload(work)
        args = EngineArgs(max_num_seqs=engine.max_num_seqs, max_model_len=engine.max_model_len)
        setup = build_setup(args, sim.model, sim.gpu, sim.profile, work.seed)
    server = simulated_server(sys.executable, sim.model, sim.gpu, sim.profile, work.seed,
                              engine.max_model_len, engine.max_num_seqs)
    config = LoadConfig(server, concurrency, setup.config.vocab_size, work.seed,
                        request_timeout_s=timeout, client=bench.client)
    if bench.soak is not None:
        _bench_soak(config, bench.soak, work.input_len, work.output_len, out)
        return
    try:
        load = run_load(trace, config)
    except RuntimeError as err:
        fail(str(err))
    simulated = run_simulate(sent_arrivals(trace, load.endpoint.requests), setup.config,
                             setup.cost_model)
    rate = work.request_rate
    report = {"command": "rt bench serve", "concurrency": concurrency,
              "random_input_len": work.input_len, "random_output_len": work.output_len,
              "request_rate": rate if math.isfinite(rate) else "inf", "model": sim.model,
              "gpu": sim.gpu, **compare(trace, load, simulated.requests)}
    write_json(report, out)
    if report["errors"] or report["token_count_mismatches"]:
        raise typer.Exit(code=1)


def _bench_soak(config: Any, seconds: float, input_len: int, output_len: int,
                out: Path | None) -> None:
    """`rt bench serve --soak`: exit 1 on an error, a token-count mismatch or KV left."""
    from backends.bench.serve_load import run_soak_load

    try:
        with user_errors():
            report = run_soak_load(config, seconds, input_len, output_len)
    except RuntimeError as err:  # the server did not start
        fail(str(err))
    write_json({"command": "rt bench serve --soak", **report}, out)
    if report["errors"] or report["token_count_mismatches"] or \
            report["kv_blocks_in_use_after"]:
        raise typer.Exit(code=1)


@bench_app.command("fleet")
@with_flags
def bench_fleet(
    sim: Annotated[SimFlags, Flags(only=("model", "gpu"))],
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="Trace (default: the embedded Azure conversation excerpt).")] = None,
    first_n: Annotated[int | None, typer.Option(
        "--first-n", min=1, help="Keep the first N requests.")] = None,
    replicas: Annotated[int, typer.Option(
        "--replicas", min=1, help="The fleet timed against one engine.")] = 16,
    scaling: Annotated[str, typer.Option(
        "--scaling", help="Two or more fleet sizes whose cost per request is compared.")]
    = "4,64",
    router: Annotated[str, typer.Option("--router", help="Routing policy.")] = "round-robin",
    router_arg: Annotated[list[str] | None, typer.Option(
        "--router-arg", help="KEY=VALUE argument of the policy (repeat).")] = None,
    baseline: Annotated[bool, typer.Option(
        "--baseline/--no-baseline", help="Also time the fleet stepping one by one.")] = True,
    out: _Out = None,
) -> None:
    """Simulated requests per second of the fleet simulator: N replicas on the trace replayed
    N times faster (each replica carries one engine's load) against one engine on the trace
    as recorded, in the same run; and the cost per request of the smallest and largest
    --scaling fleets. Rates per wall and per CPU second."""
    from sim.benchmarks import bench_fleet as run

    with user_errors():
        sizes = tuple(int(x) for x in scaling.split(",") if x.strip())
        if len(sizes) < 2 or min(sizes) < 1:
            raise ValueError(f"--scaling needs two or more sizes >= 1, got {scaling!r}")
        loaded = (workloads.load_trace(trace).trace if trace is not None
                  else workloads.default_trace())
        name = str(trace) if trace is not None else "embedded azure_conv first 10 min"
        if first_n is not None:
            loaded = workloads.first_n(loaded, first_n)
            name += f", first {first_n}"
        report = run(loaded, name, sim.model, sim.gpu, replicas, sizes, router,
                     tuple(router_arg or ()), baseline=baseline)
    write_json(report, out)


@bench_app.command("gpu")
@with_flags
def bench_gpu(flags: Annotated[GpuBenchFlags, Flags()], out: _Out = None) -> None:
    """Kernel correctness in bf16, decode attention bandwidth and prefill TFLOP/s against a
    copy and a matmul measured in the same run, and engine tokens/s against transformers
    (a CUDA device; under 10 minutes)."""
    try:
        from backends.bench.engine_throughput import EnginePlan, engine_throughput_section
        from backends.bench.gpu import GpuUnavailable, run_gpu_bench
    except ImportError as err:
        fail(f"rt bench gpu needs the real extra (torch, triton): {err}")
    with user_errors():
        plan = EnginePlan(num_requests=flags.engine_requests, prompt_len=flags.engine_prompt_len,
                          output_len=flags.engine_output_len, hf_batch_size=flags.hf_batch_size)
        section = engine_throughput_section(flags.engine_model, plan) if flags.engine else None
        try:
            report = run_gpu_bench(out, engine_throughput=section,
                                   log=lambda line: typer.echo(f"rt: {line}", err=True))
        except GpuUnavailable as err:
            fail(str(err))
    write_json(report, None)


# ---- rt route, rt fleet up (backends.route) ----

_RouterPolicy = Annotated[FleetFlags, Flags(only=("router", "router_arg", "router_refresh_ms"))]


def _router_config(urls: list[str], policy: FleetFlags, route: RouteFlags, seed: int) -> Any:
    from backends.route.app import router_config

    return router_config(urls, policy.router, policy.router_arg or [],
                         policy.router_refresh_ms, route, seed)


def _serve_router(config: Any, route: RouteFlags) -> None:
    from backends.route.app import run_router

    until_stopped(f"routing ({config.policy}) over {len(config.backends)} backends on "
                  f"http://{route.host}:{route.port}/v1", "router",
                  lambda: run_router(config, route.host, route.port, route.shutdown_timeout,
                                     route.uvicorn_log_level))


@app.command("route")
@with_flags
def route_command(
    *,
    route: Annotated[RouteFlags, Flags()],
    policy: _RouterPolicy,
    seed: _Seed = 0,
) -> None:
    """Route the OpenAI API (/v1/completions, /v1/chat/completions, streaming or not) over
    --backend servers with a shared router policy (as `rt simulate --replicas N --router`):
    its own in-flight counts and prefix index (the prompt's UTF-8 bytes), and each backend's
    /metrics scraped every --router-refresh-ms. Serves /v1/models, /health, /metrics.
    Failing backends are taken out and put back when healthy; SIGTERM/Ctrl-C drains."""
    with user_errors():
        config = _router_config(route.backend or [], policy, route, seed)
    _serve_router(config, route)


fleet_app = typer.Typer(help="A fleet of rt serve replicas behind rt route, on loopback.",
                        no_args_is_help=True)
app.add_typer(fleet_app, name="fleet")


@fleet_app.command("up")
@with_flags
def fleet_up(
    *,
    policy: Annotated[FleetFlags, Flags(only=("replicas", "router", "router_arg",
                                              "router_refresh_ms"))],
    model: Annotated[str | None, typer.Option(
        "--model", "--sim-model", help="As rt serve's --model (with --simulate, the "
        "simulated model).", rich_help_panel=ROUTE_PANEL)] = None,
    server: Annotated[ServeFlags, Flags(only=("simulate", "max_num_queued_requests"))],
    sim: Annotated[SimFlags, Flags(only=("gpu", "profile"))],
    engine: Annotated[EngineFlags, Flags()],
    route: Annotated[RouteFlags, Flags(exclude=("backend",))],
    seed: _Seed = 0,
) -> None:
    """Start --replicas `rt serve` processes (free ports of 127.0.0.1) and `rt route` in
    front of them on --port; print the router URL; on Ctrl-C/SIGTERM stop everything (no
    process is left behind)."""
    from backends.bench.serve_load import free_port
    from backends.route.fleet import FleetPlan, flag_argv, run_fleet
    from runtime.router import make_policy

    command = [sys.executable, str(Path(__file__).resolve()), "serve", "--seed", str(seed),
               *flag_argv(server, Flags(only=("simulate", "max_num_queued_requests"))),
               *flag_argv(sim, Flags(only=("gpu", "profile"))), *flag_argv(engine)]
    command += ["--model", model] if model else []
    with user_errors():  # a bad policy or argument: one line before anything starts
        make_policy(policy.router, policy.router_arg or [], seed)
    plan = FleetPlan(tuple(command), tuple(free_port() for _ in range(policy.replicas)),
                     stop_timeout_s=route.shutdown_timeout + 10)

    def serve_router(urls: list[str]) -> None:
        with user_errors():
            config = _router_config(urls, policy, route, seed)
        typer.echo(f"http://{route.host}:{route.port}/v1")
        _serve_router(config, route)

    try:
        run_fleet(plan, serve_router, lambda line: typer.echo(f"rt: {line}", err=True))
    except RuntimeError as err:
        fail(str(err))


@bench_app.command("route")
@with_flags
def bench_route(
    *,
    policy: _RouterPolicy,
    sim: Annotated[SimFlags, Flags(only=("model", "gpu", "profile"))],
    concurrency: Annotated[list[int] | None, typer.Option(
        "--concurrency", min=1, help="Closed-loop streams (repeat) [default: 1 and 200].")]
    = None,
    num_requests: Annotated[int, typer.Option(
        "--num-requests", min=1, help="Requests per path, round and concurrency.")] = 400,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1)] = 4,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Direct-then-routed "
                                        "rounds (interleaved against drift).")] = 2,
    seed: _Seed = 0,
    out: _Out = None,
) -> None:
    """The router's overhead: one `rt serve --simulate` backend, `rt route` in front of it,
    the same streaming requests straight to the backend and through the router in the same
    run; requests/s and p50/p99 TTFT and E2E of each path and the router's added ms."""
    from backends.bench.serve_load import free_port
    from backends.route.bench import RouteBenchConfig, run_route_bench

    script = str(Path(__file__).resolve())
    serve_cmd = [sys.executable, script, "serve", "--simulate", "--sim-model", sim.model,
                 "--gpu", sim.gpu, "--seed", str(seed), "--max-model-len", "4096"]
    serve_cmd += ["--profile", str(sim.profile)] if sim.profile else []
    route_cmd = [sys.executable, script, "route", "--router", policy.router, "--seed",
                 str(seed), "--router-refresh-ms", str(policy.router_refresh_ms)]
    for arg in policy.router_arg or []:
        route_cmd += ["--router-arg", arg]
    config = RouteBenchConfig(tuple(serve_cmd), tuple(route_cmd),
                              tuple(concurrency or (1, 200)), num_requests, max_tokens, rounds)
    try:
        report = run_route_bench(config, (free_port(), free_port()))
    except RuntimeError as err:
        fail(str(err))
    write_json({"command": "rt bench route", "router": policy.router, "model": sim.model,
                "gpu": sim.gpu, **report}, out)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
