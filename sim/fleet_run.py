"""`rt simulate --replicas N | --fleet FILE`'s run: the replicas (one setup times N, or the
fleet file's pools) behind the --router policy; with a P/D decider or pools with roles,
prefill and decode disaggregated (`sim.pd_flags`); with --autoscale, pools scaled in the loop
(`sim.autoscale_flags`). The caller writes the run directory from `FleetRun.run`'s result
and run.json sections."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.records import RunResult
from runtime.router.policy import RouterPolicy
from sim.autoscale_flags import AutoscaleFlags, fixed_scaling, simulate_autoscaled_fleet
from sim.engine_args import EngineArgs, SimFlags, SimSetup, build_setup
from sim.fleet import simulate_fleet
from sim.fleet_config import FleetFlags, FleetSpec, build_fleet, load_fleet
from sim.pd_flags import PDFlags, simulate_pd_fleet
from sim.simulator import Progress, simulate
from workloads import Trace


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
    def build(cls, setup: SimSetup, fleet: FleetFlags, pd: PDFlags, autoscale: AutoscaleFlags
              ) -> FleetRun:
        """ValueError (one line) on a bad fleet file, policy or combination."""
        config = setup.config
        spec = load_fleet(fleet.fleet) if fleet.fleet is not None else None
        replicas = (build_fleet(spec, config.seed, config.check_invariants,
                                config.step_noise is not None) if spec
                    else [setup] * fleet.replicas)
        roles = spec.roles() if spec else None
        policies = fleet.policies(config.seed)  # a bad --router or --router-arg: one line
        if autoscale.enabled and pd.is_pd(roles):
            raise ValueError("--autoscale does not combine with P/D (--pd-decider, pool roles) "
                             "yet")
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
                                        progress=progress, **fleet.timing())
            scaling = fixed_scaling(self.setup, self.spec, fleet, autoscale, result)
        return result, {"fleet": fleet.describe(self.spec),
                        "pd": pd.describe() if is_pd else None,
                        "autoscale": autoscale.describe() if autoscale.enabled else None,
                        "scaling": scaling.to_json()}


@dataclass(frozen=True)
class SimulateRun:
    """`rt simulate`'s run: one engine (`setup`), or with `fleet` that fleet of them."""

    setup: SimSetup
    fleet: FleetRun | None

    @classmethod
    def build(cls, engine: EngineArgs, sim: SimFlags, fleet: FleetFlags, pd: PDFlags,
              autoscale: AutoscaleFlags, seed: int, check_invariants: bool) -> SimulateRun:
        """ValueError (one line) on a bad flag, fleet file or combination."""
        setup = build_setup(engine, sim.model, sim.gpu, sim.profile, seed, check_invariants,
                            sim.step_noise)
        is_fleet = fleet.is_fleet or autoscale.enabled
        if not is_fleet and pd.pd_decider != "never":
            raise ValueError("--pd-decider needs a fleet: --replicas N or --fleet FILE")
        return cls(setup, FleetRun.build(setup, fleet, pd, autoscale) if is_fleet else None)

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
