"""`rt bench scheduler`, `rt bench sim` and `rt bench fleet`'s own flags, and the traces they
time (a file, or the embedded Azure conversation excerpt)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import workloads
from runtime.flags import check_bounds, comma_list, flag
from sim.fleet_config import MAX_REPLICAS, MAX_SIM_WORKERS
from workloads import Trace

DEFAULT_TRACE_NAME = "embedded azure_conv first 10 min"
MAX_REPEAT = 20  # `rt bench fleet --repeat` at most: each repeat runs every --scaling fleet


@dataclass(frozen=True, slots=True)
class SchedulerBenchFlags:
    seed: int = flag(0, "--seed", "Seed of the synthetic prompts.", min=0,
                     max=workloads.MAX_SEED)
    quick: bool = flag(False, "--quick/--no-quick", "Fewer steps (a smoke run).")

    def report(self) -> dict[str, object]:
        """`sim.benchmarks.bench_scheduler`'s report under these flags."""
        from sim.benchmarks import bench_scheduler

        return bench_scheduler(seed=self.seed, quick=self.quick)


@dataclass(frozen=True, slots=True)
class SimBenchFlags:
    trace: list[Path] | None = flag(None, "--trace", "Trace to simulate (repeatable). Default: "
                                    "the embedded excerpt.")
    baseline: bool = flag(True, "--baseline/--no-baseline", "Also time one-by-one stepping "
                          "(slower).")

    def traces(self) -> dict[str, Trace]:
        """The traces by name: each --trace file, or the embedded excerpt."""
        loaded = {str(path): workloads.load_trace(path).trace for path in self.trace or []}
        return loaded or {DEFAULT_TRACE_NAME: workloads.default_trace()}

    def report(self, model: str, gpu: str) -> dict[str, object]:
        """`sim.benchmarks.bench_sim`'s report on these traces, `model` on `gpu`."""
        from sim.benchmarks import bench_sim

        return bench_sim(self.traces(), model, gpu, self.baseline)


# `rt bench fleet --help`'s description of the command, beside its flags.
FLEET_BENCH_HELP = """\
Simulated requests per second of the fleet simulator: N replicas on the trace replayed
N times faster (each replica carries one engine's load) against one engine on the trace
as recorded, in the same run; and the cost per request of the smallest and largest
--scaling fleets (with --repeat N, the median of N interleaved pairs). Rates per wall and
per CPU second. With a pre-routed router (round-robin, random, session-hash) or one that
reads only completions (least-outstanding, power-of-two, sglang-cache-aware: processes in
lockstep), the N replicas also in --sim-workers processes: the wall-clock rate against one
engine's (CPU seconds stay the measure of the work).
"""


@dataclass(frozen=True, slots=True)
class FleetBenchFlags:
    trace: Path | None = flag(None, "--trace", "Trace (default: the embedded Azure "
                              "conversation excerpt).")
    first_n: int | None = flag(None, "--first-n", "Keep the first N requests.", min=1)
    replicas: int = flag(16, "--replicas", "The fleet timed against one engine.", min=1,
                         bounds=(1, MAX_REPLICAS))
    scaling: str = flag("4,64", "--scaling", "Two or more fleet sizes whose cost per request "
                        "is compared.")
    router: str = flag("round-robin", "--router", "Routing policy.")
    router_arg: list[str] | None = flag(None, "--router-arg", "KEY=VALUE argument of the "
                                        "policy (repeat).")
    baseline: bool = flag(True, "--baseline/--no-baseline", "Also time the fleet stepping "
                          "one by one.")
    sim_workers: int | None = flag(None, "--sim-workers", "Processes for the --replicas "
                                   "fleet's wall-clock row (a pre-routed or lockstep router "
                                   "only; default: the CPUs it may use, at most --replicas).",
                                   bounds=(1, MAX_SIM_WORKERS))
    repeat: int = flag(1, "--repeat", f"Runs of each --scaling fleet (1-{MAX_REPEAT}), "
                       "interleaved (4, 64, 64, 4, 4, 64, ...); the cost ratio is the median "
                       "of the pairs.", min=1,
                       bounds=(1, MAX_REPEAT))

    def __post_init__(self) -> None:
        sizes = self.sizes()
        if len(sizes) < 2 or min(sizes) < 1:
            raise ValueError(f"--scaling needs two or more sizes >= 1, got {self.scaling!r}")
        if max(sizes) > MAX_REPLICAS:
            raise ValueError(f"--scaling sizes must be at most {MAX_REPLICAS}, got "
                             f"{self.scaling!r}")
        check_bounds(self)

    def sizes(self) -> tuple[int, ...]:
        """--scaling's fleet sizes (ValueError naming the flag on a non-integer: once int()'s
        own message, "invalid literal ... 'x'")."""
        if not self.scaling.strip():
            return ()
        return tuple(comma_list("--scaling", self.scaling, int))

    def load(self) -> tuple[Trace, str]:
        """The trace (first N requests, if asked) and the name the report gives it."""
        trace = (workloads.load_trace(self.trace).trace if self.trace is not None
                 else workloads.default_trace())
        name = str(self.trace) if self.trace is not None else DEFAULT_TRACE_NAME
        if self.first_n is not None:
            trace, name = workloads.first_n(trace, self.first_n), f"{name}, first {self.first_n}"
        return trace, name

    def report(self, model: str, gpu: str) -> dict[str, object]:
        """`sim.bench_fleet.bench_fleet`'s report under these flags, `model` on `gpu`."""
        from sim.bench_fleet import bench_fleet

        trace, name = self.load()
        return bench_fleet(trace, name, model, gpu, self.replicas, self.sizes(), self.router,
                           tuple(self.router_arg or ()), baseline=self.baseline,
                           sim_workers=self.sim_workers, repeat=self.repeat)
