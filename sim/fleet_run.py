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
from sim.engine_args import SimSetup
from sim.fleet import simulate_fleet
from sim.fleet_config import FleetFlags, FleetSpec, build_fleet, load_fleet
from sim.pd_flags import PDFlags, simulate_pd_fleet
from sim.simulator import Progress
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
