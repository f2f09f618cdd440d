"""A heterogeneous fleet from a TOML file (`rt simulate --fleet FILE`), read with `tomllib`.

    [[pool]]
    name = "big"                  # unique
    count = 2                     # replicas in the pool, >= 1
    gpu = "h200"                  # sim.hardware name
    model = "llama-3.1-70b"       # sim.model_presets name or a local HF config
    tensor_parallel_size = 4      # GPUs per replica (default 1)
    cost_per_hour = 14.0          # per replica, any currency (default 0)
    profile = "calibrated"        # optional cost-model profile (default: the roofline)
    role = "both"                 # P/D: "prefill", "decode" or "both" (default; see sim.pd)

    [pool.engine]                 # optional `vllm serve` flags, by vLLM name
    max_num_seqs = 128
    gpu_memory_utilization = 0.9

Replicas are numbered pool by pool, in file order. Every problem is one ValueError line
naming the pool, the field and the value.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from runtime.flags import FlagGroup, Typed, check_bounds, flag, given_options
from runtime.router.policy import RouterPolicy
from runtime.router.registry import make_policy, policy_names
from sim.engine_args import EngineArgs, SimFlags, SimSetup, build_setup
from sim.hardware import MAX_USD_PER_GPU_HOUR

POOL_FIELDS = ("name", "count", "gpu", "model", "tensor_parallel_size", "cost_per_hour",
               "profile", "role", "engine")
ROLES = ("prefill", "decode", "both")
REQUIRED_FIELDS = ("name", "count", "gpu", "model")
# Replicas (and router replicas) of one fleet at most: each is a simulated engine, or with
# `rt fleet up` a process; far beyond any fleet measured here (64), far below a size whose
# lists alone exhaust memory or that never finishes (a 10^20-replica --replicas).
MAX_REPLICAS = 4096
# Processes that simulate one fleet (`--sim-workers`: pre-routed or in lockstep): a
# many-core machine's, not a number that forks thousands of processes by a typo.
MAX_SIM_WORKERS = 256
ENGINE_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(EngineArgs)
                 if f.name != "tensor_parallel_size"}


MAX_ROUTER_DELAY_MS = 3_600_000  # an hour: refresh, routing latency, KV-event delay


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One pool of identical replicas."""

    name: str
    count: int
    gpu: str
    model: str
    engine_args: EngineArgs
    cost_per_hour: float = 0.0
    profile: str | None = None
    role: str = "both"  # P/D: which phases its replicas serve (sim.pd)


@dataclass(frozen=True, slots=True)
class FleetSpec:
    pools: tuple[PoolSpec, ...]

    @property
    def num_replicas(self) -> int:
        return sum(pool.count for pool in self.pools)

    def pool_of_replica(self) -> list[str]:
        """Replica index -> its pool's name."""
        return [pool.name for pool in self.pools for _ in range(pool.count)]

    def roles(self) -> list[str]:
        """Replica index -> its pool's P/D role."""
        return [pool.role for pool in self.pools for _ in range(pool.count)]


def load_fleet(path: Path) -> FleetSpec:
    """Read and check a fleet file; ValueError (one line) on any problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read fleet file {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8; once the codec's line, the file unnamed
        raise ValueError(f"{path}: not valid TOML: not UTF-8 text (byte {e.start})") from None
    return parse_fleet(text, str(path))


def parse_fleet(text: str, source: str = "fleet file") -> FleetSpec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{source}: not valid TOML: {e}") from None
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise ValueError(f"{source}: not valid TOML: nested too deeply") from None
    unknown = sorted(set(data) - {"pool"})
    if unknown:
        raise ValueError(f"{source}: unknown table or key {unknown[0]!r} (expected [[pool]])")
    tables = data.get("pool")
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"{source}: no [[pool]] tables (a fleet needs at least one pool)")
    for i, table in enumerate(tables):
        if not isinstance(table, dict):
            raise ValueError(f"{source}: pool {i + 1} must be a [[pool]] table, got {table!r}")
    pools = tuple(_pool(table, i) for i, table in enumerate(tables))
    names = [pool.name for pool in pools]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{source}: pool name {name!r} is used twice")
    total = sum(pool.count for pool in pools)
    if total > MAX_REPLICAS:  # each pool's count is capped, and so is the fleet (--replicas')
        raise ValueError(f"{source}: the pools' counts sum to {total:,} replicas; a fleet "
                         f"holds at most {MAX_REPLICAS}")
    return FleetSpec(pools)


def _pool(table: dict[str, Any], index: int) -> PoolSpec:
    where = f"pool {index + 1}"
    if "name" not in table:
        raise ValueError(f"{where}: missing field 'name'")
    name = _string(table, "name", where)
    where = f"pool {name!r}"
    for key in REQUIRED_FIELDS:
        if key not in table:
            raise ValueError(f"{where}: missing field {key!r}")
    for key in table:
        if key not in POOL_FIELDS:
            raise ValueError(f"{where}: unknown field {key!r} (fields: {', '.join(POOL_FIELDS)})")
    count = _integer(table, "count", where)
    tensor_parallel_size = _integer(table, "tensor_parallel_size", where, default=1)
    cost = table.get("cost_per_hour", 0.0)
    if isinstance(cost, bool) or not isinstance(cost, int | float) or not math.isfinite(cost) \
            or cost < 0:
        raise ValueError(f"{where}: cost_per_hour must be a number >= 0, got {cost!r}")
    if cost > MAX_USD_PER_GPU_HOUR * tensor_parallel_size:
        raise ValueError(f"{where}: cost_per_hour must be at most {MAX_USD_PER_GPU_HOUR:g} $ "
                         f"per GPU ({tensor_parallel_size} GPUs), got {cost!r}")
    profile = _string(table, "profile", where) if "profile" in table else None
    role = _string(table, "role", where) if "role" in table else "both"
    if role not in ROLES:
        raise ValueError(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
    engine = table.get("engine", {})
    if not isinstance(engine, dict):
        raise ValueError(f"{where}: engine must be a table of engine flags, got {engine!r}")
    flags: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # flag -> its key in the file
    for key, value in engine.items():
        field = key.replace("-", "_")
        if field in spelled:  # max-num-seqs and max_num_seqs: the last one silently won
            raise ValueError(f"{where}: engine flag {field} is given twice "
                             f"({spelled[field]!r} and {key!r})")
        spelled[field] = key
        flags[field] = _engine_flag(key, value, where)
    try:
        args = EngineArgs(**flags, tensor_parallel_size=tensor_parallel_size)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    return PoolSpec(name, count, _string(table, "gpu", where), _string(table, "model", where),
                    args, float(cost), profile, role)


def _string(table: dict[str, Any], key: str, where: str) -> str:
    value = table[key]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: {key} must be a non-empty string, got {value!r}")
    return value


def _integer(table: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    if value > MAX_REPLICAS:
        raise ValueError(f"{where}: {key} must be at most {MAX_REPLICAS}, got {value}")
    return value


def _engine_flag(key: str, value: object, where: str) -> Any:
    name = key.replace("-", "_")
    kind = ENGINE_FIELDS.get(name)
    if kind is None:
        raise ValueError(f"{where}: unknown engine flag {key!r} "
                         f"(flags: {', '.join(ENGINE_FIELDS)}; tensor_parallel_size is a "
                         "pool field)")
    base = kind.replace(" | None", "")
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "str": isinstance(value, str),
    }.get(base, True)
    if not ok:
        raise ValueError(f"{where}: engine flag {key} must be {base}, got {value!r}")
    # ignore: `ok` above made a "float" value an int or a float, which mypy cannot see
    return float(value) if base == "float" else value  # type: ignore[arg-type]


def refuse_overrides(engine: EngineArgs, sim: SimFlags, typed: Typed | None = None) -> None:
    """ValueError naming the first engine, GPU, model or profile flag given with --fleet FILE
    (`given_options`: on the command line `typed`, else other than its default): the file
    sets them per pool, so the flag would be ignored without a word."""
    pool_fields = ("gpu", "model", "profile", "tensor_parallel_size")
    for config in (sim, engine):
        for f in dataclasses.fields(config):
            given = given_options(config, (f.name,), typed) if f.name != "step_noise" else []
            if not given:
                continue
            where, table = ((f.name, "[[pool]]") if f.name in pool_fields
                            else ("engine flags", "[pool.engine]"))
            raise ValueError(f"--fleet sets each pool's {where}: {given[0]} would be ignored "
                             f"(set {f.name} in its {table} table)")


def build_fleet(spec: FleetSpec, seed: int = 0, check_invariants: bool = False,
                step_noise: bool = False) -> list[SimSetup]:
    """One `SimSetup` per replica (a pool's replicas share theirs). ValueError naming the
    pool on an unknown GPU or model, or a model that does not fit its GPU."""
    setups: list[SimSetup] = []
    for pool in spec.pools:
        try:
            setup = build_setup(pool.engine_args, pool.model, pool.gpu, pool.profile, seed,
                                check_invariants, step_noise)
        except ValueError as e:
            raise ValueError(f"pool {pool.name!r}: {e}") from None
        setups.extend([setup] * pool.count)
    return setups


FLEET_PANEL = "Fleet (replicas behind a router)"
# The router policy as the live router offers it (`rt route`, `rt bench route`), and with the
# replica count (`rt fleet up`, and `rt fidelity --fleet`'s fleet).
ROUTER_POLICY = FlagGroup(only=("router", "router_arg", "router_refresh_ms"))
FLEET_UP_POLICY = FlagGroup(only=("replicas", "router", "router_arg", "router_refresh_ms"))


class RouterTiming(TypedDict):
    """What routers see and when (`FleetFlags.timing`): `simulate_fleet`'s keyword
    arguments of the same names, seconds."""

    refresh_s: float
    routing_latency_s: float
    kv_event_delay_s: float


@dataclass(frozen=True, slots=True)
class FleetFlags:
    """How many replicas, behind which router, seeing what and when (times in ms)."""

    replicas: int = flag(1, "--replicas", "Identical replicas of the engine behind one "
                         "router (in rt simulate, 1 is the single-engine simulator).",
                         FLEET_PANEL,
                         bounds=(1, MAX_REPLICAS))
    fleet: Path | None = flag(None, "--fleet", "TOML file of heterogeneous pools (name, count, "
                              "gpu, model, tensor_parallel_size, engine flags, cost_per_hour); "
                              "instead of --replicas.", FLEET_PANEL)
    router: str = flag("round-robin", "--router", f"Routing policy: {', '.join(policy_names())}.",
                       FLEET_PANEL)
    router_arg: list[str] | None = flag(None, "--router-arg", "KEY=VALUE argument of the "
                                        "policy (repeat).", FLEET_PANEL)
    router_refresh_ms: float = flag(50.0, "--router-refresh-ms", "Replica metrics (waiting, "
                                    "running, KV usage) are snapshots this old at most "
                                    "(llm-d's 50; 0 = an oracle).", FLEET_PANEL)
    routing_latency_ms: float = flag(0.0, "--routing-latency-ms", "Time from arrival to the "
                                     "chosen replica's API server.", FLEET_PANEL)
    kv_event_delay_ms: float = flag(0.0, "--kv-event-delay-ms", "KV events (blocks stored, "
                                    "removed) reach the routers that score with them this "
                                    "long after the step that produced them (0 = at once).",
                                    FLEET_PANEL)
    routers: int = flag(1, "--routers", "Router replicas, each with private state (in-flight "
                        "counts, prefix indexes, its own scrape ticks); requests spread "
                        "round-robin by arrival.", FLEET_PANEL, bounds=(1, MAX_REPLICAS))
    sim_workers: int = flag(1, "--sim-workers", "Processes that simulate the replicas, each "
                            "a contiguous range of them; the records are those of 1. A fleet "
                            "routed before any step (round-robin, random, session-hash) runs "
                            "them apart; one behind routers that read only completions "
                            "(least-outstanding, power-of-two, sglang-cache-aware) in "
                            "lockstep, the processes meeting at each routing decision. "
                            "Other fleets run in one process.", FLEET_PANEL,
                            bounds=(1, MAX_SIM_WORKERS))

    def __post_init__(self) -> None:
        check_bounds(self)
        for name in ("router_refresh_ms", "routing_latency_ms", "kv_event_delay_ms"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_ROUTER_DELAY_MS:  # NaN too; 1e308 failed after the run
                raise ValueError(f"--{name.replace('_', '-')} must be in "
                                 f"[0, {MAX_ROUTER_DELAY_MS:,}] ms, got {value}")
        if self.fleet is not None and self.replicas != 1:
            raise ValueError("give --replicas or --fleet, not both")
        make_policy(self.router, self.router_arg or [])  # a bad one: one line, fleet or not

    @property
    def is_fleet(self) -> bool:
        return self.replicas > 1 or self.fleet is not None or self.routers > 1

    def policies(self, seed: int) -> list[RouterPolicy]:
        """One fresh --router policy per router replica: router r seeded seed + r * 7919
        (router 0 as a single router; ValueError, one line, on a bad name or argument)."""
        return [make_policy(self.router, self.router_arg or [], seed + r * 7919)
                for r in range(self.routers)]

    def timing(self) -> RouterTiming:
        """`simulate_fleet`'s keyword arguments for what routers see and when, seconds."""
        return {"refresh_s": self.router_refresh_ms / 1e3,
                "routing_latency_s": self.routing_latency_ms / 1e3,
                "kv_event_delay_s": self.kv_event_delay_ms / 1e3}

    def describe(self, spec: FleetSpec | None) -> dict[str, Any]:
        """run.json's "fleet" section."""
        pools = None if spec is None else [dataclasses.asdict(p) for p in spec.pools]
        return {"replicas": spec.num_replicas if spec else self.replicas, "router": self.router,
                "router_args": list(self.router_arg or []),
                "router_refresh_ms": self.router_refresh_ms,
                "routing_latency_ms": self.routing_latency_ms,
                "kv_event_delay_ms": self.kv_event_delay_ms, "routers": self.routers,
                "pools": pools}
