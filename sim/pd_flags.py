"""`rt simulate`'s P/D flags and the fleet run they select (`sim.pd.simulate_pd` with the
decode and prefill routers built from the flags)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.flags import Typed, flag, given_options
from runtime.router import make_policy
from sim.fleet_config import FleetFlags
from sim.fleet_records import FleetResult
from sim.kv_transfer import GB, KvTransferConfig
from sim.pd import PDDecider, PDSetup, simulate_pd
from sim.simulator import Progress
from workloads import Trace

PD_PANEL = "P/D disaggregation (fleet)"
# A KV transfer link at least 1 MB/s (a 40 GB KV cache then moves in 11 h), its fixed time at
# most a minute
MIN_TRANSFER_GBPS, MAX_TRANSFER_LATENCY_MS = 1e-3, 60_000.0
# What tunes a P/D run: given without P/D, each would be ignored
PD_TUNING = ("pd_threshold", "pd_transfer_gbps", "pd_transfer_latency_ms", "prefill_router",
             "prefill_router_arg")


@dataclass(frozen=True, slots=True)
class PDFlags:
    """Prefill/decode disaggregation over a fleet whose pools have roles (times in ms)."""

    pd_decider: str = flag("never", "--pd-decider", "When a request is prefilled on a "
                           "prefill replica and decoded on another: never, always, "
                           "prefix-threshold (llm-d: when the part of its prompt not cached "
                           "on the chosen decode replica is >= --pd-threshold tokens). Roles: "
                           "the --fleet pools' role (prefill, decode, both).", PD_PANEL)
    pd_threshold: int = flag(16, "--pd-threshold", "prefix-threshold: uncached prompt tokens "
                             "from which a request is disaggregated.", PD_PANEL)
    pd_transfer_gbps: float = flag(25.0, "--pd-transfer-gbps", "KV transfer bandwidth of a "
                                   "prefill->decode link in GB/s (1e9 bytes/s), shared by the "
                                   "transfers on it.", PD_PANEL)
    pd_transfer_latency_ms: float = flag(0.05, "--pd-transfer-latency-ms", "Fixed time per "
                                         "KV transfer.", PD_PANEL)
    prefill_router: str | None = flag(None, "--prefill-router", "Routing policy among the "
                                      "prefill replicas (default: --router's).", PD_PANEL)
    prefill_router_arg: list[str] | None = flag(None, "--prefill-router-arg", "KEY=VALUE "
                                                "argument of the prefill policy (repeat; "
                                                "default: --router-arg's).", PD_PANEL)

    def __post_init__(self) -> None:
        PDDecider(self.pd_decider, self.pd_threshold)  # raises on a bad decider or threshold
        # 1e-300 GB/s or 1e308 ms ran the simulation, then failed in its metrics (the int64
        # cast of a 1e300 s finish); NaN was named as bytes/s
        if not MIN_TRANSFER_GBPS <= self.pd_transfer_gbps < math.inf:
            raise ValueError(f"--pd-transfer-gbps must be a finite number >= "
                             f"{MIN_TRANSFER_GBPS:g} GB/s, got {self.pd_transfer_gbps}")
        if not 0 <= self.pd_transfer_latency_ms <= MAX_TRANSFER_LATENCY_MS:
            raise ValueError(f"--pd-transfer-latency-ms must be in [0, "
                             f"{MAX_TRANSFER_LATENCY_MS:,.0f}] ms, got "
                             f"{self.pd_transfer_latency_ms}")
        KvTransferConfig(self.pd_transfer_gbps * GB, self.pd_transfer_latency_ms / 1e3)
        if self.prefill_router is not None:  # a bad name or argument: one line, P/D or not
            make_policy(self.prefill_router, self.prefill_router_arg or [])

    def check_applies(self, is_pd: bool, typed: Typed | None = None) -> None:
        """ValueError naming a P/D flag given (`given_options`: on the command line `typed`,
        else other than its default) that cannot apply: any of them without P/D (`is_pd`),
        --pd-threshold under a decider other than prefix-threshold (as autoscaling's flags
        need --autoscale)."""
        if not is_pd and (given := given_options(self, PD_TUNING, typed)):
            raise ValueError(f"{given[0]} needs P/D (--pd-decider always or prefix-threshold "
                             "on a fleet, or pools with roles)")
        if self.pd_decider != "prefix-threshold" and (
                given := given_options(self, ("pd_threshold",), typed)):
            raise ValueError(f"{given[0]} needs --pd-decider prefix-threshold")

    @property
    def decider(self) -> PDDecider:
        return PDDecider(self.pd_decider, self.pd_threshold)

    @property
    def transfer(self) -> KvTransferConfig:
        return KvTransferConfig(self.pd_transfer_gbps * GB, self.pd_transfer_latency_ms / 1e3)

    def is_pd(self, roles: Sequence[str] | None) -> bool:
        """Whether the run needs `simulate_pd` (a decider, or pools with roles)."""
        return self.pd_decider != "never" or any(role != "both" for role in roles or ())

    def describe(self) -> dict[str, Any]:
        """run.json's "pd" section."""
        return dataclasses.asdict(self)


def simulate_pd_fleet(trace: Trace, replicas: Sequence[PDSetup], roles: Sequence[str] | None,
                      fleet: FleetFlags, pd: PDFlags, seed: int = 0,
                      progress: Progress | None = None) -> FleetResult:
    """What `rt simulate --replicas N | --fleet FILE` runs with P/D flags: the decode policy
    is `--router` seeded `seed` (as `simulate_fleet`'s), the prefill policy
    `--prefill-router` (default `--router`) seeded `seed + 1`; `roles` per replica
    (`FleetSpec.roles()`; None: all "both")."""
    roles = list(roles) if roles is not None else ["both"] * len(replicas)
    if fleet.routers > 1:
        raise ValueError(f"--routers {fleet.routers} does not combine with P/D yet (one "
                         "decode and one prefill router)")
    policy = make_policy(fleet.router, fleet.router_arg or [], seed)
    name = pd.prefill_router or fleet.router
    args = pd.prefill_router_arg if pd.prefill_router_arg is not None else (
        fleet.router_arg if pd.prefill_router is None else None)
    prefill_policy = make_policy(name, args or [], seed + 1)
    timing = fleet.timing()
    return simulate_pd(trace, replicas, roles, policy, prefill_policy, pd.decider, pd.transfer,
                       timing["refresh_s"], timing["routing_latency_s"], progress,
                       timing["kv_event_delay_s"])

