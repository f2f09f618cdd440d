"""`rt simulate --replicas N | --fleet FILE`'s run: the replicas (one setup times N, or the
fleet file's pools) behind the --router policy; with a P/D decider or pools with roles,
prefill and decode disaggregated (`sim.pd_flags`); with --autoscale, pools scaled in the loop
(`sim.autoscale_flags`). `SimulateRun.simulate_into` writes and shows the run through the
caller's `SimOutput` (run directories and result blocks are analysis/'s)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from runtime.flags import Typed, given_options
from runtime.records import RunResult, RunSummary
from runtime.router.policy import RouterPolicy
from sim.autoscale_flags import AutoscaleFlags, fixed_scaling, simulate_autoscaled_fleet
from sim.engine_args import EngineArgs, SimFlags, SimSetup, build_setup, token_times
from sim.fleet import pre_routable, runs_in_lockstep, simulate_fleet
from sim.fleet_config import FleetFlags, FleetSpec, build_fleet, load_fleet, refuse_overrides
from sim.fleet_workers import usable_cpus
from sim.pd import check_roles
from sim.pd_flags import PDFlags, simulate_pd_fleet
from sim.simulator import Progress, simulate
from workloads import Trace, trace_info

# What only a fleet's run reads (its router, what the router sees, its processes)
FLEET_ONLY = ("router", "router_arg", "router_refresh_ms", "routing_latency_ms",
              "kv_event_delay_ms", "sim_workers")


class SimOutput(Protocol):
    """Where `rt simulate`'s run goes and how it is shown (`analysis.run_console.RunConsole`
    is one)."""

    def progress(self, label: str, total: int | None = None
                 ) -> AbstractContextManager[Callable[[int, int], None]]:
        """A progress bar over `total` requests, updated through the function it yields."""

    def save(self, path: Path, kind: str, trace: Mapping[str, Any], result: RunResult,
             describe: Mapping[str, Any], **extra: Any) -> None:
        """Write the records as run directory `path` (`trace`: `workloads.trace_info`)."""

    def show_simulated(self, path: Path, summary: RunSummary, percentiles: Sequence[float],
                       request_rate: float | None, fleet: bool, autoscaled: bool) -> None:
        """Print the run written at `path` (read back without its token times): vLLM's and
        rt's blocks, and a fleet's routing and scaling."""

    def tell(self, line: str) -> None:
        """A plain line for the user (vLLM's start-up lines)."""


@dataclass(frozen=True)
class FleetRun:
    """A fleet ready to simulate: `setup` is the command's engine (one replica's)."""

    setup: SimSetup
    fleet: FleetFlags
    pd: PDFlags
    autoscale: AutoscaleFlags
    spec: FleetSpec | None
    replicas: Sequence[SimSetup]
    roles: list[str] | None
    policies: Sequence[RouterPolicy]  # one per router replica (--routers)

    @classmethod
    def build(cls, setup: SimSetup, fleet: FleetFlags, pd: PDFlags, autoscale: AutoscaleFlags,
              spec: FleetSpec | None = None, typed: Typed | None = None) -> FleetRun:
        """ValueError (one line) on a bad fleet file, policy or combination, before any
        output. `spec`: --fleet's file when the caller has read it already; `typed`: the
        flags the command line gave (`given_options`)."""
        config = setup.config
        if spec is None and fleet.fleet is not None:
            spec = load_fleet(fleet.fleet)
        replicas = (build_fleet(spec, config.seed, config.check_invariants,
                                config.step_noise is not None) if spec
                    else [setup] * fleet.replicas)
        roles = spec.roles() if spec else None
        policies = fleet.policies(config.seed)  # a bad --router or --router-arg: one line
        autoscale.check_pool_sizes(spec, fleet.replicas)
        if autoscale.enabled and pd.is_pd(roles):
            raise ValueError("--autoscale does not combine with P/D (--pd-decider, pool roles) "
                             "yet")
        if fleet.routers > 1 and pd.is_pd(roles):  # before the start-up lines
            raise ValueError(f"--routers {fleet.routers} does not combine with P/D yet (one "
                             "decode and one prefill router)")
        if pd.is_pd(roles):
            check_roles(roles or ["both"] * len(replicas), len(replicas), pd.decider)
        pd.check_applies(pd.is_pd(roles), typed)
        return cls(setup, fleet, pd, autoscale, spec, replicas, roles, policies)

    def run(self, trace: Trace, progress: Progress | None = None
            ) -> tuple[RunResult, dict[str, Any]]:
        """The fleet's records, and run.json's fleet, pd, autoscale and scaling sections."""
        fleet, pd, autoscale = self.fleet, self.pd, self.autoscale
        is_pd = pd.is_pd(self.roles)
        if autoscale.enabled:
            result, scaling = simulate_autoscaled_fleet(trace, self.setup, self.spec, fleet,
                                                        autoscale, progress)
        else:
            if is_pd:
                result = simulate_pd_fleet(trace, self.replicas, self.roles, fleet, pd,
                                           self.setup.config.seed, progress)
            else:
                result = simulate_fleet(trace, self.replicas, list(self.policies),
                                        progress=progress, workers=fleet.sim_workers,
                                        **fleet.timing())
            scaling = fixed_scaling(self.setup, self.spec, fleet, autoscale, result)
        return result, {"fleet": fleet.describe(self.spec),
                        "pd": pd.describe() if is_pd else None,
                        "autoscale": autoscale.describe() if autoscale.enabled else None,
                        "scaling": scaling.to_json()}

    def workers_note(self) -> str | None:
        """The start-up line saying why --sim-workers > 1 does not apply (the fleet then runs
        in one process: not an error, so one flag serves a loop over routers), or that its
        lockstep processes outnumber the CPUs; None when it applies or is 1."""
        workers = self.fleet.sim_workers
        if workers == 1:
            return None
        processes, cpus = min(workers, len(self.replicas)), usable_cpus()
        if (processes > cpus and runs_in_lockstep(self.policies)
                and not (self.autoscale.enabled or self.pd.is_pd(self.roles))):
            return (f"note: --sim-workers {workers}: {processes} processes in lockstep on "
                    f"{cpus} CPUs; every routing decision waits for the slowest process, so "
                    "more processes than free CPUs run slower than fewer")
        if self.autoscale.enabled:
            why = "--autoscale reads the replicas as it runs"
        elif self.pd.is_pd(self.roles):
            why = "P/D reads the replicas as it routes"
        elif not (pre_routable(self.policies) or runs_in_lockstep(self.policies)):
            why = (f"router {self.fleet.router!r} reads the replicas' metrics or KV events "
                   "(or first tokens) as it routes")
        elif len(self.replicas) == 1:
            why = "one replica"
        else:
            return None
        return f"note: --sim-workers {workers}: {why}; simulating the fleet in one process"


@dataclass(frozen=True)
class SimulateRun:
    """`rt simulate`'s run: one engine (`setup`), or with `fleet` that fleet of them."""

    setup: SimSetup
    fleet: FleetRun | None

    @classmethod
    def build(cls, engine: EngineArgs, sim: SimFlags, fleet: FleetFlags, pd: PDFlags,
              autoscale: AutoscaleFlags, seed: int, check_invariants: bool,
              typed: Typed | None = None) -> SimulateRun:
        """ValueError (one line) on a bad flag, fleet file or combination. With --fleet
        FILE the file's first pool is the command's engine (its pools set the engine flags,
        GPU, model and profile: one of those flags given as well is refused). `typed`: the
        flags the command line gave, a flag of another mode at its default value is refused
        too (`given_options`)."""
        autoscale.check_applies(typed)
        spec = None
        if fleet.fleet is not None:
            refuse_overrides(engine, sim, typed)
            spec = load_fleet(fleet.fleet)
            setup = build_fleet(FleetSpec(spec.pools[:1]), seed, check_invariants,
                                sim.step_noise)[0]
        else:
            setup = build_setup(engine, sim.model, sim.gpu, sim.profile, seed,
                                check_invariants, sim.step_noise)
        is_fleet = fleet.is_fleet or autoscale.enabled
        if not is_fleet and pd.pd_decider != "never":
            raise ValueError("--pd-decider needs a fleet: --replicas N or --fleet FILE")
        if not is_fleet:  # a fleet's flag on one engine would be ignored
            given = (given_options(fleet, FLEET_ONLY, typed)
                     + given_options(autoscale, ("gpu_cost_per_hour",), typed))
            if given:
                raise ValueError(f"{given[0]} needs a fleet: --replicas N or --fleet FILE")
            pd.check_applies(False, typed)
        return cls(setup, FleetRun.build(setup, fleet, pd, autoscale, spec, typed) if is_fleet
                   else None)

    @property
    def first(self) -> SimSetup:
        """The engine whose start-up lines and run.json sections stand for the run."""
        return self.fleet.replicas[0] if self.fleet else self.setup

    def run(self, trace: Trace, progress: Progress | None = None
            ) -> tuple[RunResult, dict[str, Any]]:
        """The records, and run.json's extra sections (a fleet's; none for one engine)."""
        if self.fleet:
            return self.fleet.run(trace, progress)
        return simulate(trace, self.setup.config, self.setup.cost_model, progress), {}

    def simulate_into(self, trace: Trace, path: Path, out: SimOutput,
                      percentiles: Sequence[float], request_rate: float | None) -> None:
        """Print the start-up lines, simulate under `out`'s progress bar, write run directory
        `path` and show it; the records are dropped before the run is read back (a 1 M-request
        run's records and frames are never held at once)."""
        describe = self.first.describe()
        if self.fleet:  # client times when any replica's front end delays its tokens
            describe["token_times"] = token_times(r.config for r in self.fleet.replicas)
        for line in self.first.startup_lines:
            out.tell(line)
        note = self.fleet.workers_note() if self.fleet else None
        if note is not None:
            out.tell(note)
        with out.progress("simulating", len(trace)) as update:
            result, extra = self.run(trace, update)
        summary = result.summary()
        out.save(path, "simulate", trace_info(trace), result, describe, **extra)
        del result
        out.show_simulated(path, summary, percentiles, request_rate, self.fleet is not None,
                           self.fleet is not None and self.fleet.autoscale.enabled)
