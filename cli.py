"""rt command line: the composition root, and the only module that touches argv, the
environment and logging.

Flags are declared once, as fields of the libraries' frozen flag dataclasses (`EngineFlags`,
`EngineArgs`, `SimFlags`, `RealEngineFlags`, `WorkloadFlags`, `ReportFlags`, each command's
own such as `ServeBenchFlags` or `InspectFlags`; each field's metadata names its option), and
a description longer than a line beside them (`FIDELITY_HELP`). `with_flags` turns a command
parameter annotated `Annotated[SomeFlags, Flags(...)]` into those options and hands the
command the instance. Each command then calls the libraries and prints; where a run needs two
sides the layering keeps apart (sim/ and backends/, or either and analysis/), the library
takes the other side as functions or one typed object and this module passes it (e.g.
`analysis.sweep_run.PointRunner`, `sim.fidelity_run.RealEngine`); a run's output (run
directory, printed blocks, status lines, exit status) is one object, `CONSOLE`. User errors
(bad flags, bad files) become one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import os
import socket
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.markup import escape
from typer.core import TyperGroup
from typer.models import OptionInfo

import workloads
from analysis.compare import COMPARE_HELP, CompareFiles
from analysis.output import JsonOut, checked_dir, default_dir, save_figures
from analysis.report import REPORT_HELP, TABLE_DEFAULTS, ReportFiles, ReportFlags
from analysis.run_console import RunConsole
from analysis.rundir import check_output_file
from backends.bench.flags import SERVE_BENCH_HELP, GpuBenchFlags, ServeBenchFlags, ServeLoadFlags
from backends.engine.flags import ModelDirFlags, RealEngineFlags
from backends.replay.flags import REPLAY_HELP, REPLAY_TRACE_HELP, EndpointFlags, replay_workload
from backends.route.flags import (
    ROUTE_HELP,
    ROUTE_PANEL,
    FleetModelFlags,
    RouteBenchFlags,
    RouteFlags,
)
from backends.serve.flags import SERVE_HELP, ServeFlags, ServeModelFlags
from runtime.config import EngineFlags
from runtime.flags import FlagGroup as Flags
from runtime.flags import FlagSpec, Typed, expand_groups, given_options, listed
from sim.autoscale_flags import AutoscaleFlags
from sim.bench_flags import FLEET_BENCH_HELP, FleetBenchFlags, SchedulerBenchFlags, SimBenchFlags
from sim.calibrate_flags import CALIBRATE_HELP, CalibrationSources
from sim.cost.kv_cache_sizing import DEFAULT_GPU_MEMORY_UTILIZATION
from sim.engine_args import SIMULATE_HELP, EngineArgs, SimFlags
from sim.fidelity import FIDELITY_HELP, CalibrationFlags, FidelityFlags
from sim.fleet_config import FLEET_UP_POLICY, ROUTER_POLICY, FleetFlags
from sim.pd_flags import PDFlags
from sim.plan import PLAN_HELP, PLAN_WORKLOAD, PlanFlags
from sim.sweep import SWEEP_FLEETS, SWEEP_GRID, SWEEP_HELP, SWEEP_MODELS, SWEEP_WORKLOAD, SweepFlags
from workloads.arrivals import MAX_SEED
from workloads.flags import TraceFileFlags, WorkloadFlags, load_workload
from workloads.trace_flags import FILE_FLAGS, SYNTHETIC_FLAGS, ConvertFlags, InspectFlags

if TYPE_CHECKING:
    from backends.replay.real_run import LoadedEngine
    from sim.fidelity_run import FidelityDirs

_ARGV = "rt.argv"  # ctx.meta key: the arguments as given, for naming a refused value
# The exceptions of the click that typer parses with (typer 0.29 vendors its own copy).
_CLICK = importlib.import_module(typer.BadParameter.__module__)
_SOURCE = importlib.import_module(f"{_CLICK.__package__}.core").ParameterSource
_CONTEXT = importlib.import_module(f"{_CLICK.__package__}.globals").get_current_context


class _ParserErrors(TyperGroup):
    """rt's root group: the parser's own refusals (an unknown command or option, a missing
    one, a value of the wrong type or out of range) as one line naming the option and the
    value, exit 2, as the commands' own checks (`fail`); not click's usage block."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        ctx.meta.setdefault(_ARGV, list(args))
        with _one_line(ctx):
            return super().parse_args(ctx, args)

    def invoke(self, ctx: Any) -> Any:
        with _one_line(ctx):
            return super().invoke(ctx)


@contextlib.contextmanager
def _one_line(ctx: Any) -> Iterator[None]:
    try:
        yield
    except getattr(_CLICK, "NoArgsIsHelpError", ()):  # `rt bench`: the help, as before
        raise
    except _CLICK.UsageError as err:
        fail(parser_error(err, ctx.meta.get(_ARGV, [])))


def parser_error(err: Any, argv: list[str]) -> str:
    """A click UsageError's message on one line, with the refused value when it does not
    name it."""
    message = " ".join(err.format_message().split())
    param = err.param if isinstance(err, _CLICK.BadParameter) else None
    given = _given(param.opts + param.secondary_opts, argv) if param is not None else None
    return message if given is None or repr(given) in message else f"{message} (got {given!r})"


def _given(opts: list[str], argv: list[str]) -> str | None:
    """The value last given to one of `opts` in `argv` ("--x V" or "--x=V"), else None."""
    found = None
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in opts:
            found = value if eq else argv[i + 1] if i + 1 < len(argv) else found
    return found


app = typer.Typer(name="rt", help="LLM-serving runtime twin: one vLLM-V1 scheduler/KV core, "
                  "simulated or real.", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False, cls=_ParserErrors)
RT = (sys.executable, str(Path(__file__).resolve()))  # the command line that starts rt
bench_app = typer.Typer(help="Benchmarks that write JSON.", no_args_is_help=True)
trace_app = typer.Typer(help="Generate, inspect and convert request traces.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(trace_app, name="trace")


# ---- flags declared once ----


def printed(text: str | None) -> str | None:
    """Help text as typer's rich mode should print it: a paragraph's source lines joined (rich
    keeps a line break, so a paragraph wrapped at ~90 columns in the source wraps raggedly on
    any terminal) and `[` escaped where rich would read markup (`'rt[ray]'` printed as
    `'rt'`, `[default: ...]` dropped)."""
    if text is None:
        return None
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(escape(" ".join(line.strip() for line in paragraph.splitlines()))
                       for paragraph in paragraphs)


def _option(spec: FlagSpec) -> Any:
    return Annotated[spec.hint, typer.Option(*spec.decls, help=printed(spec.help),
                                             envvar=spec.envvar,
                                             rich_help_panel=spec.panel, min=spec.minimum,
                                             max=spec.maximum)]


def with_flags(command: Callable[..., None]) -> Callable[..., None]:
    """Expose `Annotated[FlagClass, Flags(...)]` parameters of `command` as one typer option
    per field (an option two groups share, such as --seed, appears once and feeds both);
    the command is called with the built dataclasses (and, to a parameter annotated `Typed`,
    which of their flags were given). Options are listed: the command's own and its
    `inline` groups' in signature order, then the other groups'."""
    return expand_groups(command, _option, user_errors, _was_given)


def _was_given(name: str) -> bool:
    """Whether the running command's option `name` was typed or set by its environment
    variable, at whatever value (not left at its default)."""
    return _CONTEXT().get_parameter_source(name) in (_SOURCE.COMMANDLINE, _SOURCE.ENVIRONMENT)


def command(group: typer.Typer, name: str | None = None, help: str | None = None
            ) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register a function as command `name` of `group`, its flag groups expanded
    (`with_flags`); `help`: its --help description (default: its docstring)."""
    return lambda function: group.command(name, help=printed(help or inspect.getdoc(function)))(
        with_flags(function))


# ---- output and errors ----


def fail(message: str) -> NoReturn:
    """Print one readable line for a user error and exit with status 2."""
    typer.echo(f"rt: error: {message}", err=True)
    raise typer.Exit(code=2)


@contextlib.contextmanager
def user_errors(*also: type[Exception], only: bool = False) -> Iterator[None]:
    """Bad input (a ValueError from the libraries, workloads.TraceError included: they name
    the field and value), an unreadable/unwritable file, or one of `also`: one line, exit 2.
    With `only`, `also` alone (a serving loop's: anything else is a bug, its traceback)."""
    caught: tuple[type[Exception], ...] = also if only else (ValueError, OSError, *also)
    try:
        yield
    except typer.Exit:  # a RuntimeError too: the command's own exit
        raise
    except caught as err:
        fail(f"{err.filename}: {err.strerror}" if isinstance(err, OSError) and err.filename
             else str(err))


def not_with(given: list[str], mode: str) -> None:
    """ValueError naming the first of `given` (flags as typed, `given_options` with the
    command's `Typed`: one at its default value too) and `mode`, the flag under which they
    do not apply: refused, never silently ignored."""
    if given:
        raise ValueError(f"{given[0]} does not apply with {mode}")


def tp_needs_simulate(sizing: EngineArgs, typed: Typed) -> None:
    """ValueError naming -tp given without --simulate (rt serve, rt fleet up): only the
    simulated engine shards a model."""
    if given := given_options(sizing, ("tensor_parallel_size",), typed):
        raise ValueError(f"{given[0]} needs --simulate (the real engine runs on one device)")


def stop(code: int) -> NoReturn:
    raise typer.Exit(code=code)


def say(line: str) -> None:
    typer.echo(f"rt: {line}", err=True)  # a progress or status line


tell = functools.partial(typer.echo, err=True)  # a plain line on stderr


def note(lines: Iterable[str]) -> None:
    for line in lines:
        typer.echo(f"rt: note: {line}", err=True)


CONSOLE = RunConsole(typer.echo, say, tell, stop)  # where runs go, how they are shown


def workload(flags: WorkloadFlags, path: Path | None = None) -> workloads.Trace:
    loaded = load_workload(flags, path)
    note(loaded.notes)
    return loaded.trace


# ---- parameters several commands share ----

_Trace = Annotated[TraceFileFlags, Flags(inline=True)]
_ModelDir = Annotated[ModelDirFlags, Flags(inline=True)]
_RouterPolicy = Annotated[FleetFlags, ROUTER_POLICY]
_Percentiles = Annotated[ReportFlags, Flags(only=("metric_percentiles",))]
_Out = Annotated[JsonOut, Flags(inline=True)]
_Plots = Annotated[bool, typer.Option("--plots/--no-plots", help="Draw the PNGs.")]
_CheckInvariants = Annotated[bool, typer.Option(
    "--check-invariants", help="Check the KV pool after every step (slow).")]
_Seed = Annotated[int, typer.Option("--seed", help="Seed of every random draw (as vLLM).",
                                    min=0, max=MAX_SEED)]


def _result_dir(kind: str) -> OptionInfo:
    """The `--result-dir` option of a command whose run directory defaults to
    results/<kind>-<time>; the parameter is `Annotated[Path | None, _result_dir(kind)]`."""
    option: OptionInfo = typer.Option(  # typed as Any by typer, so it serves as a default
        "--result-dir", help=f"Run directory to write (default: results/{kind}-<time>).")
    return option


# ---- rt trace ... (workloads) ----


@command(trace_app, "inspect")
def trace_inspect(
    file: Path,
    flags: Annotated[WorkloadFlags, Flags(only=FILE_FLAGS)],
    how: Annotated[InspectFlags, Flags()],
) -> None:
    """Print a trace's statistics: rows, span, rates, burstiness, lengths, prefix reuse."""
    with user_errors():
        text, notes = how.report(flags, file)
    note(notes)
    typer.echo(text)


@command(trace_app, "convert")
def trace_convert(
    src: Path, dst: Path,
    flags: Annotated[WorkloadFlags, Flags(only=FILE_FLAGS)],
    out: Annotated[ConvertFlags, Flags()],
) -> None:
    """Convert a trace file (any supported format) to rt JSONL, Vidur CSV or vLLM bench's
    timed_trace JSONL."""
    with user_errors():
        check_output_file(dst, "DST", [src])
        trace = workload(flags, src)
        out.write(trace, dst)
    say(f"wrote {len(trace)} requests to {dst} ({out.to})")


@command(trace_app, "gen")
def trace_gen(
    output: Annotated[Path, typer.Option("-o", "--output", help="rt JSONL file to write.")],
    flags: Annotated[WorkloadFlags, Flags(only=SYNTHETIC_FLAGS,
                                          defaults={"dataset_name": "random"})],
) -> None:
    """Generate a synthetic trace with `vllm bench serve` flags (same seed, same arrivals)."""
    with user_errors():
        check_output_file(output, "--output", [flags.dataset_path])
        trace = workload(flags)
        workloads.write_rt_jsonl(trace, output)
    say(f"wrote {len(trace)} requests to {output} ({flags.dataset_name})")


# ---- rt simulate ----


@command(app, help=SIMULATE_HELP)
def simulate(
    *,
    trace_file: _Trace,
    work: Annotated[WorkloadFlags, Flags(exclude=("max_model_len",))],
    engine: Annotated[EngineArgs, Flags()],
    sim: Annotated[SimFlags, Flags()],
    fleet: Annotated[FleetFlags, Flags()],
    pd: Annotated[PDFlags, Flags()],
    autoscale: Annotated[AutoscaleFlags, Flags()],
    report: _Percentiles,
    result_dir: Annotated[Path | None, _result_dir("simulate")] = None,
    check_invariants: _CheckInvariants = False,
    typed: Typed,
) -> None:
    """Simulate a trace through the vLLM-V1 core, or a fleet of them, on a simulated clock."""
    from sim.fleet_run import SimulateRun

    with user_errors():
        percentiles = report.options().percentiles
        from analysis.rundir import check_run_path

        out = checked_dir(result_dir, "simulate", check_run_path)
        trace = workload(work, trace_file.trace)
        run = SimulateRun.build(engine, sim, fleet, pd, autoscale, work.seed, check_invariants,
                                typed)
        rate = work.request_rate if work.dataset_name is not None else None
        run.simulate_into(trace, out, CONSOLE, percentiles, rate)


# ---- rt report / compare (analysis), rt sweep / plan (sim + analysis) ----


@command(app, "report", help=REPORT_HELP)
def report(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (rt simulate / rt replay).")],
    flags: Annotated[ReportFlags, Flags()],
    files: Annotated[ReportFiles, Flags()],
) -> None:
    """Report one run: vLLM's metrics, where the time went, and plots."""
    from analysis.report import load_checked, report_run

    with user_errors():
        home = run_dir if run_dir.is_dir() else run_dir.with_suffix("")  # a vLLM JSON: FILE/
        text, written, figures = report_run(load_checked(run_dir), flags.options(), files,
                                            home)
        typer.echo(text)
        for path in written:
            say(f"wrote {path}")
        save_figures(figures, files.plot_dir or home / "plots", say)


@command(app, "compare", help=COMPARE_HELP)
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories (two or more).")],
    flags: Annotated[ReportFlags, Flags(defaults=TABLE_DEFAULTS)],
    files: Annotated[CompareFiles, Flags(inline=True)],
    plots: _Plots = True,
) -> None:
    """Compare runs of one workload side by side: a table and overlaid plots."""
    from analysis.compare import compare_dirs

    with user_errors():
        html, figures = compare_dirs(run_dirs, flags.options(), files, plots, typer.echo)
        if html is not None:
            say(f"wrote {html}")
        save_figures(figures, files.plot_dir or default_dir("compare"), say)


@command(app, "sweep", help=SWEEP_HELP)
def sweep(
    *,
    trace_file: _Trace,
    work: Annotated[WorkloadFlags, SWEEP_WORKLOAD],
    grid: Annotated[EngineArgs, SWEEP_GRID],
    targets: Annotated[SimFlags, SWEEP_MODELS],
    fleets: Annotated[FleetFlags, SWEEP_FLEETS],
    sim: Annotated[SimFlags, Flags(only=("profile",))],
    flags: Annotated[ReportFlags, Flags(defaults=TABLE_DEFAULTS)],
    how: Annotated[SweepFlags, Flags()],
    result_dir: Annotated[Path | None, typer.Option(
        "--result-dir", help="Sweep directory (default: results/sweep-<time>).")] = None,
    plots: _Plots = True,
    typed: Typed,
) -> None:
    """Simulate a grid of engine flags x request rates on one trace; table and plots."""
    from analysis.rundir import check_runs_root
    from analysis.sweep import SWEEP_TABLE, sweep_slos, write_sweep
    from analysis.sweep_run import PointRunner, run_sweep, widen_options
    from sim.sweep import GRID_ENGINE_FLAGS, SweepPlan, simulate_point

    with user_errors():
        how.check_search(typed)
        slos = sweep_slos(how.slo, how.find_max_rate)
        plan, notes = SweepPlan.build(trace_file.trace, work, listed(grid),
                                      listed(targets), listed(fleets),
                                      sim.profile, how,
                                      checked_dir(result_dir, "sweep", functools.partial(
                                          check_runs_root, table=SWEEP_TABLE)))
        note(notes)
        runner = PointRunner(how.run_all, simulate_point, workloads.trace_info,
                             widen_options(flags.options(), slos))
        records, lines = run_sweep(plan, runner, how, slos)
        for line in lines:
            typer.echo(line)
        text, figures = write_sweep(records, plan.root, GRID_ENGINE_FLAGS, slos, plots)
    typer.echo(text)
    save_figures(figures, plan.root, say)


@command(app, "plan", help=PLAN_HELP)
def plan(
    *,
    trace_file: Annotated[Path | None, typer.Argument(
        help="Trace file (default: the embedded excerpt).", show_default=False)] = None,
    work: Annotated[WorkloadFlags, PLAN_WORKLOAD],
    space: Annotated[PlanFlags, Flags()],
    how: Annotated[SweepFlags, Flags(only=("executor", "address", "jobs"))],
    result_dir: Annotated[Path | None, typer.Option(
        "--result-dir", help="Where every simulated shape's run directory, plan.csv, the "
        "Pareto plot and the winning fleet.toml go (default: results/plan-<time>); an "
        "existing one is resumed.")] = None,
) -> None:
    """The cheapest fleet that meets every SLO on a trace."""
    from analysis.plan import PLAN_TABLE, report_plan
    from analysis.rundir import check_runs_root
    from analysis.sweep import parse_slo
    from analysis.sweep_run import PointRunner, widen_options
    from sim.plan import simulate_shape

    with user_errors():
        if space.slo is None:
            raise ValueError("--slo is required, e.g. p99_ttft_ms=500,p99_itl_ms=50")
        root = checked_dir(result_dir, "plan", functools.partial(check_runs_root,
                                                                 table=PLAN_TABLE))
        records: list[dict[str, Any]] = []
        slos, trace = parse_slo(space.slo), workload(work, trace_file)
        runner = PointRunner(how.run_all, simulate_shape, workloads.trace_info, widen_options(
            ReportFlags(percentile_metrics="ttft,tpot,itl,e2el").options(), slos))
        ranked, pruned = space.plan(trace, work.seed, functools.partial(
            runner.judge, trace=trace, seed=work.seed, root=root, slos=slos, records=records))
    note([f"pruned {p.candidate.name()}: {p.reason}" for p in pruned])
    closest = report_plan(records, slos, root, ranked, len(pruned), typer.echo, say)
    if closest is not None:
        fail(f"no shape within --max-gpus {space.max_gpus} meets {space.slo} (closest: "
             f"{closest})")


# ---- rt replay (backends) ----


@command(app, help=REPLAY_HELP)
def replay(
    *,
    trace_file: Annotated[Path | None, typer.Argument(help=REPLAY_TRACE_HELP,
                                                      show_default=False)] = None,
    checkpoint: _ModelDir,
    work: Annotated[WorkloadFlags, Flags(exclude=("max_model_len",))],
    engine: Annotated[EngineFlags, Flags()],
    real: Annotated[RealEngineFlags, Flags()],
    report: _Percentiles,
    result_dir: Annotated[Path | None, _result_dir("replay")] = None,
    check_invariants: _CheckInvariants = False,
    client: Annotated[EndpointFlags, Flags()],
    typed: Typed,
) -> None:
    """Replay a trace in real time on a real model, or against an OpenAI-compatible server."""
    from analysis.rundir import check_run_path

    with user_errors():
        if client.endpoint is not None:  # the server's engine flags are its own
            not_with(given_options(real, typed=typed) + given_options(engine, typed=typed)
                     + (["--check-invariants"] if check_invariants else []),
                     "--endpoint (the server runs the model)")
        percentiles = list(report.options().percentiles)
        out = checked_dir(result_dir, "endpoint" if client.endpoint is not None else "replay",
                          check_run_path)
        trace = workload(replay_workload(work, trace_file), trace_file)
        if client.endpoint is not None:
            settings = client.config_args(str(checkpoint.model) if checkpoint.model else None,
                                          work.seed)
            run_endpoint(trace, settings, out, percentiles)
            return
        real_engine(checkpoint.model, engine, real, work.seed).replay_into(
            trace, out, percentiles, check_invariants)


def real_engine(model: Path | None, engine: EngineFlags, real: RealEngineFlags,
                seed: int) -> LoadedEngine:
    """`backends.engine.setup.load_real_engine` on the console, quiet (no transformers bars);
    its callers turn a bad model or flag into one line (`user_errors`)."""
    from transformers.utils import logging as hf_logging

    from backends.engine.setup import load_real_engine
    from backends.replay.real_run import LoadedEngine

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return LoadedEngine(*load_real_engine(model, engine, real, seed), CONSOLE)


def run_endpoint(trace: workloads.Trace, settings: dict[str, Any], path: Path,
                 percentiles: list[float]) -> None:
    """`backends.replay.endpoint_run.run_endpoint` on the console (one line if the serve
    extra is missing)."""
    try:
        from backends.replay.endpoint_run import run_endpoint as run
    except ImportError as err:
        fail(f"--endpoint needs {err.name}: pip install 'rt[serve]'")
    run(trace, settings, path, percentiles, CONSOLE)


# ---- rt serve (backends; --simulate: sim) ----


# `rt serve`'s device sizing: the simulated engine's (`rt simulate`'s) --gpu-memory-utilization
# and -tp; the option's default differs by engine (None: the engine's own), so it is resolved
# in `_serve_executor`, and the real engine's own option of that name is this one.
_SERVE_SIZING = Flags(only=("gpu_memory_utilization", "tensor_parallel_size"),
                      defaults={"gpu_memory_utilization": None})


@command(app, help=SERVE_HELP)
def serve(
    *,
    model: Annotated[ServeModelFlags, Flags(inline=True)],
    sim: Annotated[SimFlags, Flags(only=("gpu", "profile", "step_noise"))],
    engine: Annotated[EngineFlags, Flags()],
    sizing: Annotated[EngineArgs, _SERVE_SIZING],
    real: Annotated[RealEngineFlags, Flags(exclude=("random_weights",
                                                    "gpu_memory_utilization"))],
    server: Annotated[ServeFlags, Flags()],
    seed: _Seed = 0,
    typed: Typed,
) -> None:
    """Serve the OpenAI API from a real model or, with --simulate, the cost model."""
    from analysis.rundir import rt_version
    from backends.serve import api_server

    with user_errors():
        config = api_server.ServeConfig.of(server, *_serve_executor(
            model.model, sim, engine, sizing, real, server.simulate, seed, typed),
            rt_version=rt_version())
        sock = api_server.listening_socket(server.host, server.port)  # before the engine
    stack = api_server.http_stack()
    say(f"serving {config.model_name} on {api_server.socket_url(sock)}/v1 "
        f"({stack.describe()})")
    with user_errors(RuntimeError, only=True):  # RuntimeError: the engine process died
        api_server.run_server(config, sock, stack, server.shutdown_timeout,
                              server.uvicorn_log_level)
    say("server stopped")


def _serve_executor(model: str | None, sim: SimFlags, engine: EngineFlags, sizing: EngineArgs,
                    real: RealEngineFlags, simulate: bool, seed: int, typed: Typed
                    ) -> tuple[Any, ...]:
    """`rt serve`'s executor spec: the simulated engine's with --simulate, else the real
    one's. A flag of the other engine given (`typed`) is refused naming it (it was ignored:
    --simulate's pool took 0.92 whatever --gpu-memory-utilization said)."""
    from backends.serve.executor import real_executor_spec
    from sim.live_executor import live_executor_spec

    utilization = sizing.gpu_memory_utilization
    if simulate:
        if given := given_options(real, typed=typed):
            raise ValueError(f"{given[0]} is the real engine's: not with --simulate")
        args = EngineArgs(**dataclasses.asdict(engine), tensor_parallel_size=(
            sizing.tensor_parallel_size), gpu_memory_utilization=(
            DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization))
        return live_executor_spec(args, model, sim.gpu, sim.profile, seed, sim.step_noise)
    if given := given_options(sim, typed=typed):
        raise ValueError(f"{given[0]} is the simulated engine's: it needs --simulate")
    tp_needs_simulate(sizing, typed)
    if utilization is not None:
        real = dataclasses.replace(real, gpu_memory_utilization=utilization)
    return real_executor_spec(model, engine, real, seed)


# ---- rt calibrate / fidelity ----


@command(app, "calibrate", help=CALIBRATE_HELP)
def calibrate(
    *,
    output: Annotated[Path, typer.Option("-o", "--output", help="Profile JSON to write.")],
    checkpoint: _ModelDir,
    real: Annotated[RealEngineFlags, Flags()],
    engine: Annotated[EngineFlags, Flags()],
    cal: Annotated[CalibrationFlags, Flags()],
    sources: Annotated[CalibrationSources, Flags(inline=True)],
    seed: _Seed = 0,
    typed: Typed,
) -> None:
    """Fit the simulator's `profile` cost model to the real backend."""
    from analysis.rundir import request_columns, rt_version, source_run_info
    from sim.calibrate_run import grid_profile, runs_profile, save_profile, steps_profile

    with user_errors():
        check_output_file(output, "--output", [*(sources.from_run or []),  # before the fit
                                               *(sources.from_steps or [])])
        mode = sources.mode(checkpoint.model is not None, cal.step_drift)
        if mode != "grid":  # no grid, no real engine: their flags would be ignored
            not_with(given_options(cal, ("quick", "time_limit"), typed)
                     + given_options(real, typed=typed)
                     + (given_options(engine, typed=typed) if mode == "steps" else []),
                     f"{'--from-steps' if mode == 'steps' else '--from-run'} (no model runs here)")
        sources.check_measured(source_run_info)  # never a simulated run: a circular fit
        if mode == "runs":
            profile, lines = runs_profile(sources.from_run or [], request_columns, engine, seed,
                                          rt_version())
            for line in lines:
                tell(line)
        elif mode == "steps":
            profile, notes = steps_profile(sources.from_steps or [], sources.target,
                                           rt_version(), drift=cal.step_drift)
            note(notes)
        else:
            loaded = real_engine(checkpoint.model, engine, real, seed)
            profile = grid_profile(loaded, cal, sources.from_steps or [], rt_version())
        save_profile(profile, output, tell)
    say(f"wrote {output}")


@command(app, "fidelity", help=FIDELITY_HELP)
def fidelity(
    *,
    trace_file: Annotated[Path, typer.Argument(help="Trace file (any `rt trace` format).")],
    checkpoint: _ModelDir,
    real: Annotated[RealEngineFlags, Flags()],
    work: Annotated[WorkloadFlags, Flags(only=("fmt", "first_n", "time_scale", "seed"))],
    engine: Annotated[EngineFlags, Flags()],
    noise: Annotated[SimFlags, Flags(only=("step_noise", "gpu"), defaults={"step_noise": True})],
    cal: Annotated[CalibrationFlags, Flags()],
    how: Annotated[FidelityFlags, Flags()],
    fleet: Annotated[FleetFlags, FLEET_UP_POLICY],
    result_dir: Annotated[Path | None, typer.Option(
        "--result-dir", help="Where real/, sim/, profile.json, fidelity.json and the plots "
        "go (default: results/fidelity-<time>).")] = None,
    plots: _Plots = True,
    client: Annotated[EndpointFlags, Flags()],
    typed: Typed,
) -> None:
    """Replay a trace on the real backend, simulate it, report the simulator's error."""
    from analysis.fidelity import replay_order

    with user_errors():
        how.check(cal.step_drift, noise.step_noise, client.endpoint is not None)
        if how.fleet or client.endpoint is not None:
            not_with(given_options(real, typed=typed),
                     "--fleet (rt serve --simulate replicas)" if how.fleet
                     else "--endpoint (the server runs the model)")
        trace = workload(work, trace_file)  # (a bad trace: one line, --endpoint or not)
    root = result_dir or default_dir("fidelity")
    if how.fleet and client.endpoint is None:  # rt serve --simulate replicas behind rt route
        return _fidelity_fleet(trace, (engine, str(checkpoint.model or "llama-3.1-8b"),
                                       noise.gpu, how.profile, work.seed), fleet, root)
    order = replay_order(how.repeats, how.calibration_replays())
    with user_errors():
        dirs, notes = (_fidelity_endpoint(trace, checkpoint.model, engine, noise.step_noise,
                                          how, order, cal.step_drift, client, work.seed, root)
                       if client.endpoint is not None else _fidelity_real(
                           trace, checkpoint.model, engine, real, cal, how, order,
                           noise.step_noise, work.seed, root))
        note(notes)
        if CONSOLE.report_fidelity(dirs, root, plots, how.max_error):
            raise typer.Exit(code=1)


def _fidelity_real(trace: workloads.Trace, model: Path | None, engine: EngineFlags,
                   real: RealEngineFlags, cal: CalibrationFlags, how: FidelityFlags,
                   order: list[tuple[str, int]], step_noise: bool, seed: int, root: Path
                   ) -> tuple[FidelityDirs, list[str]]:
    """`rt fidelity` on the real engine (`sim.fidelity_run.RealFidelity`), replays in
    `order`; what it wrote and notes."""
    from analysis.rundir import rt_version
    from sim.fidelity_run import RealFidelity

    loaded = real_engine(model, engine, real, seed)
    return RealFidelity.of(loaded, CONSOLE, trace, root, cal, rt_version()).run(
        how, order, cal.step_drift, step_noise, tokenizer=loaded.tokenized)


def _fidelity_endpoint(trace: workloads.Trace, model: Path | None, engine: EngineFlags,
                       step_noise: bool, how: FidelityFlags, order: list[tuple[str, int]],
                       step_drift: bool, client: EndpointFlags, seed: int, root: Path
                       ) -> tuple[FidelityDirs, list[str]]:
    """`rt fidelity --endpoint` (`sim.endpoint_fidelity`), replays in `order` as `rt replay
    --endpoint`; what it wrote and notes."""
    from analysis.rundir import rt_version
    from sim.endpoint_fidelity import EndpointFidelityPlan, endpoint_fidelity

    settings = client.config_args(None, seed)
    plan = EndpointFidelityPlan.of(how, order, seed, str(model) if model else None,
                                   step_noise, step_drift, rt_version())
    out = endpoint_fidelity(trace, engine, plan, root, lambda t, path, s: run_endpoint(
        t, {**settings, "seed": s}, path, []), CONSOLE.save)
    return out.dirs(), out.lines


def _fidelity_fleet(trace: workloads.Trace, args: tuple[Any, ...], fleet: FleetFlags,
                    root: Path) -> None:
    """`rt fidelity --fleet`: the real fleet (`backends.route.fleet_fidelity`) against its
    twin (`sim.fleet_twin.fleet_twin`); `args`: engine flags, model, GPU, profile and seed."""
    try:
        from analysis.fleet_fidelity import write_fleet_fidelity
        from backends.route.fleet_fidelity import fleet_fidelity_plan, run_fleet_fidelity
        from sim.fleet_twin import fleet_twin
    except ImportError as err:
        fail(f"--fleet needs {err.name}: pip install 'rt[serve]'")
    with user_errors():
        typer.echo(run_fleet_fidelity(fleet_fidelity_plan(Path(__file__), fleet, *args),
                   trace, root, CONSOLE, functools.partial(fleet_twin, trace, fleet, *args),
                   write_fleet_fidelity))
    say(f"wrote {root / 'fleet_fidelity.json'}")  # as the one-engine comparison says


# ---- rt bench ... ----


@command(bench_app, "scheduler")
def bench_scheduler(flags: Annotated[SchedulerBenchFlags, Flags(inline=True)],
                    out: _Out) -> None:
    """Microseconds per step of schedule() + update_from_output(): 64/256/1024 running
    decodes with prefix caching, and a mixed chunked-prefill workload."""
    with user_errors():
        typer.echo(out.write(flags.report()))


@command(bench_app, "sim")
def bench_sim(sim: Annotated[SimFlags, Flags(only=("model", "gpu"))],
              flags: Annotated[SimBenchFlags, Flags(inline=True)], out: _Out) -> None:
    """Simulated requests per wall-clock second, fast-forwarding vs stepping one by one."""
    with user_errors():
        typer.echo(out.write(flags.report(sim.model, sim.gpu)))


@command(bench_app, "serve", help=SERVE_BENCH_HELP)
def bench_serve(
    work: Annotated[WorkloadFlags, Flags(only=("request_rate", "input_len", "output_len",
                                               "seed"),
                                         defaults={"input_len": 256})],
    sim: Annotated[SimFlags, Flags(only=("model", "gpu", "profile"))],
    engine: Annotated[EngineFlags, Flags(only=("max_num_seqs", "max_model_len"),
                                         defaults={"max_model_len": 4096})],
    load: Annotated[ServeLoadFlags, Flags(inline=True)],
    bench: Annotated[ServeBenchFlags, Flags()],
    out: _Out,
) -> None:
    """Load-test `rt serve --simulate` against the simulator on the same arrivals."""
    from backends.bench.serve_run import SimulatedServer, failed, run_serve_bench
    from sim.benchmarks import serve_twin

    with user_errors(RuntimeError):  # RuntimeError: the server did not start
        server = SimulatedServer(sys.executable, sim.model, sim.gpu, sim.profile, work.seed,
                                 engine.max_model_len, engine.max_num_seqs)
        report = run_serve_bench(work, server, load, bench,
                                 functools.partial(serve_twin, sim, engine, work.seed))
        typer.echo(out.write(report))
    if failed(report):
        raise typer.Exit(code=1)


@command(bench_app, "fleet", help=FLEET_BENCH_HELP)
def bench_fleet(sim: Annotated[SimFlags, Flags(only=("model", "gpu"))],
                flags: Annotated[FleetBenchFlags, Flags(inline=True)], out: _Out) -> None:
    """Simulated requests per second of the fleet simulator against one engine."""
    with user_errors():
        typer.echo(out.write(flags.report(sim.model, sim.gpu)))


@command(bench_app, "gpu")
def bench_gpu(flags: Annotated[GpuBenchFlags, Flags()], out: _Out) -> None:
    """Kernel correctness in bf16, decode attention bandwidth and prefill TFLOP/s against a
    copy and a matmul measured in the same run, and engine tokens/s against transformers
    (a CUDA device; under 10 minutes)."""
    try:
        from backends.bench.gpu import GpuUnavailable, gpu_bench
    except ImportError as err:
        fail(f"rt bench gpu needs the real extra (torch, triton): {err}")
    with user_errors(GpuUnavailable):
        typer.echo(json.dumps(gpu_bench(flags, out.out, say), indent=2))


# ---- rt route, rt fleet up (backends.route) ----


# rt serve's input limits (--api-key or VLLM_API_KEY, --max-request-bytes), on the router too
_ROUTE_GUARD = Flags(only=("api_key", "max_request_bytes"), panel=ROUTE_PANEL)


def route_until_stopped(urls: list[str], policy: FleetFlags, route: RouteFlags,
                        guard: ServeFlags, seed: int, sock: socket.socket,
                        print_url: bool = False) -> None:
    """`backends.route.app`'s router under `policy` on `sock` (listening), with `guard`'s
    API key and body limit (its URL on stdout when `print_url`)."""
    from backends.route import app as route_app
    from backends.route.config import router_config

    with user_errors():
        config = router_config(urls, policy, route, guard, seed)
    with user_errors(RuntimeError, only=True):
        route_app.route_until_stopped(config, sock, route.shutdown_timeout, say,
                                      typer.echo if print_url else None)


def _router_socket(route: RouteFlags) -> socket.socket:
    """The router's listening socket, bound before anything else starts: a bad --host or
    --port is one line, and port 0's real port is the one printed."""
    from backends.listen import listening_socket

    with user_errors():
        return listening_socket(route.host, route.port)


@command(app, "route", help=ROUTE_HELP)
def route_command(*, route: Annotated[RouteFlags, Flags()], policy: _RouterPolicy,
                  guard: Annotated[ServeFlags, _ROUTE_GUARD], seed: _Seed = 0) -> None:
    """Route the OpenAI API over --backend servers under a router policy."""
    with _router_socket(route) as sock:
        route_until_stopped(route.backend or [], policy, route, guard, seed, sock)


fleet_app = typer.Typer(help="A fleet of rt serve replicas behind rt route, on loopback.",
                        no_args_is_help=True)
app.add_typer(fleet_app, name="fleet")
# What `rt fleet up` passes on to each replica's `rt serve`.
_FLEET_SERVER = Flags(only=("simulate", "max_num_queued_requests", "api_key",
                            "max_request_bytes"))
_FLEET_SERVER_ARGV = dataclasses.replace(_FLEET_SERVER, exclude=("api_key",))  # key: by env
_FLEET_SIM = Flags(only=("gpu", "profile"))


@command(fleet_app, "up")
def fleet_up(
    *,
    policy: Annotated[FleetFlags, FLEET_UP_POLICY],
    model: Annotated[FleetModelFlags, Flags(inline=True)],
    server: Annotated[ServeFlags, _FLEET_SERVER],
    sim: Annotated[SimFlags, _FLEET_SIM],
    engine: Annotated[EngineFlags, Flags()],
    sizing: Annotated[EngineArgs, _SERVE_SIZING],
    route: Annotated[RouteFlags, Flags(exclude=("backend",))],
    seed: _Seed = 0,
    typed: Typed,
) -> None:
    """Start --replicas `rt serve` processes (free ports of 127.0.0.1) and `rt route` in
    front of them on --port; print the router URL; on Ctrl-C/SIGTERM stop everything (no
    process is left behind). --api-key and --max-request-bytes hold for the router and
    every replica. --replicas: at most what this machine holds (a --simulate replica is 3
    processes and ~350 MB resident: its memory / 350 MB, its process limit / 3)."""
    from backends.route.fleet import FleetPlan, run_fleet
    from runtime.router import make_policy

    with user_errors():  # a bad policy or argument: one line before anything starts
        make_policy(policy.router, policy.router_arg or [], seed)
        if not server.simulate:
            tp_needs_simulate(sizing, typed)
    key = None if server.api_key is None else {**os.environ, "VLLM_API_KEY": server.api_key}
    with user_errors():  # more replicas than this machine holds: one line, nothing started
        plan = FleetPlan.of(RT, seed, [(server, _FLEET_SERVER_ARGV), (sim, _FLEET_SIM),
                                       (engine, None), (sizing, _SERVE_SIZING),
                                       (model, None)], policy.replicas,
                            route.shutdown_timeout, env=key)  # the key: not on a command line
    with _router_socket(route) as sock, user_errors(RuntimeError, only=True):
        run_fleet(plan, functools.partial(route_until_stopped, policy=policy, route=route,
                                          guard=server, seed=seed, sock=sock,
                                          print_url=True), say)


@command(bench_app, "route")
def bench_route(
    *,
    policy: _RouterPolicy,
    sim: Annotated[SimFlags, Flags(only=("model", "gpu", "profile"))],
    flags: Annotated[RouteBenchFlags, Flags(inline=True)],
    seed: _Seed = 0,
    out: _Out,
) -> None:
    """The router's overhead: one `rt serve --simulate` backend, `rt route` in front of it,
    the same streaming requests straight to the backend and through the router in the same
    run; requests/s and p50/p99 TTFT and E2E of each path and the router's added ms."""
    from backends.route.bench import route_bench_config, run_route_bench

    config = route_bench_config(RT, sim.model, sim.gpu, sim.profile, seed, policy.router,
                                policy.router_arg or [], policy.router_refresh_ms, flags)
    with user_errors(RuntimeError):
        typer.echo(out.write(run_route_bench(config)))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
