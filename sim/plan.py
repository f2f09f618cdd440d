"""`rt plan`: the cheapest fleet that serves a trace under an SLO.

A candidate is a fleet configuration without its size (GPU kind, model, tensor parallelism,
token budget, max_num_seqs, router); a shape is a candidate with a replica count. For each
candidate the search

1. prunes what cannot work before simulating: the model does not fit the GPU, a request can
   never fit one replica's KV pool, or even `max_gpus` GPUs cannot carry the trace's mean
   token load at the replica's peak token throughput (a prefill-only step at the full token
   budget, the cheapest tokens a step computes: a safe lower bound on the replicas needed);
2. bisects the replica count between that bound and `max_gpus / tp` for the smallest count
   meeting every SLO (assuming more replicas never hurt, which holds for load-balancing
   routers on one trace), all candidates' next counts simulated together in one batch.

The cheapest passing shape wins (cost per hour = replicas x tp x the GPU's price), then fewer
GPUs. What runs a shape and judges it against the SLOs is the caller's (sim/ does not import
analysis/): it passes a function from shapes to pass/fail.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime import BatchFeatures
from runtime.flags import FlagGroup, check_bounds, comma_list, flag
from runtime.records import RunResult
from runtime.router.registry import policy_names
from sim.engine_args import EngineArgs, SimSetup, build_setup
from sim.fleet import can_ever_fit
from sim.fleet_config import MAX_REPLICAS
from sim.hardware import MAX_USD_PER_GPU_HOUR, gpu_key, resolve_gpu
from sim.model_presets import resolve_model
from workloads import Trace

PLAN_PANEL = "Plan (search space)"
# On-demand $/GPU-hour, specialty-cloud midpoints of May 2026 (A100 80GB $1.10-1.50, H100 SXM5
# $2.50-3.50, H200 $3.50-4.50: mercatus-ai.com, "cloud GPU pricing"); B200 and L40S are
# assumptions. Override with --gpu-cost.
DEFAULT_GPU_COST = {"a100-80gb": 1.30, "h100-sxm": 3.00, "h200": 4.00, "b200": 6.00,
                    "l40s": 1.00}
PEAK_THROUGHPUT_SLACK = 1.25  # the replica bound assumes 25% more than the peak: stays safe


# The workload flags `rt plan` offers: a trace file, windowed and rescaled.
PLAN_WORKLOAD = FlagGroup(only=("fmt", "start_s", "duration_s", "first_n", "time_scale",
                                "target_rate", "seed"))


# `rt plan --help`'s description of the command, beside its flags.
PLAN_HELP = """\
The cheapest fleet that meets every SLO on a trace, with no failed request: searches
GPU kinds x models x tensor parallelism x token budgets x max_num_seqs x routers,
prunes what cannot work before simulating, and bisects each candidate's replica count.
"""


@dataclass(frozen=True, slots=True)
class PlanFlags:
    """What `rt plan` searches over and what it may spend."""

    slo: str | None = flag(None, "--slo", "Upper bounds every shape must meet, e.g. "
                           "p99_ttft_ms=500,p99_itl_ms=50 (required).", PLAN_PANEL)
    gpus: str = flag("h200", "--gpus", "GPU kinds to consider (comma list).", PLAN_PANEL)
    models: str = flag("llama-3.1-8b", "--models", "Models (presets or HF config paths; "
                       "comma list; each shape serves one).", PLAN_PANEL)
    tensor_parallel_sizes: str = flag("1", "--tensor-parallel-sizes", "GPUs per replica "
                                      "(comma list).", PLAN_PANEL)
    max_num_batched_tokens: str | None = flag(None, "--max-num-batched-tokens", "Token "
                                              "budgets (comma list; default: vLLM's).",
                                              PLAN_PANEL)
    max_num_seqs: str | None = flag(None, "--max-num-seqs", "max_num_seqs values (comma "
                                    "list; default: vLLM's).", PLAN_PANEL)
    routers: str = flag("round-robin", "--routers", "Routing policies (comma list).",
                        PLAN_PANEL)
    pd_ratios: str | None = flag(None, "--pd-ratios", "P:D splits to search besides "
                                 "aggregated fleets, e.g. 1:1,1:3 (prefill:decode replicas, "
                                 "every request disaggregated; see docs/fleet.md).",
                                 PLAN_PANEL)
    max_gpus: int = flag(16, "--max-gpus", "GPUs per fleet at most.", PLAN_PANEL,
                         bounds=(1, MAX_REPLICAS))
    gpu_cost: str | None = flag(None, "--gpu-cost", "$/GPU-hour overrides, e.g. "
                                "h200=3.5,h100-sxm=2.5 (defaults: docs/plan.md).", PLAN_PANEL)

    def __post_init__(self) -> None:
        check_bounds(self)

    def prices(self) -> dict[str, float]:
        prices, given = dict(DEFAULT_GPU_COST), set()
        for item in (self.gpu_cost or "").split(","):
            if item.strip():
                name, _, value = item.partition("=")
                try:
                    price = float(value)
                except ValueError:
                    raise ValueError(f"--gpu-cost: expected NAME=USD, got {item!r}") from None
                if not 0 <= price <= MAX_USD_PER_GPU_HOUR:
                    raise ValueError(f"--gpu-cost: {item!r}: the price must be >= 0 and at most "
                                     f"{MAX_USD_PER_GPU_HOUR:g} $/h")
                try:
                    key = gpu_key(name)
                except ValueError as err:
                    raise ValueError(f"--gpu-cost: {err}") from None
                if key in given:  # (H200=100 once priced nothing: the plan kept h200's)
                    raise ValueError(f"--gpu-cost: {name.strip()!r} prices GPU {key} again")
                given.add(key)
                prices[key] = price
        return prices

    def plan(self, trace: Trace, seed: int, judge: Judge) -> tuple[list[Shape], list[Pruned]]:
        """Search every candidate (`search`): the shapes that met the SLOs, cheapest first
        (`cheapest`), and the candidates pruned."""
        prices = self.prices()
        searches, pruned = search(self.candidates(), trace, self.max_gpus, prices, judge, seed)
        return cheapest(searches, prices), pruned

    def candidates(self) -> list[Candidate]:
        """Every combination, in flag order (GPU outermost; aggregated before P:D splits)."""
        lists: list[list[Any]] = [
            _gpus(self.gpus), _names("--models", self.models),
            _counts("--tensor-parallel-sizes", self.tensor_parallel_sizes, required=True),
            _counts("--max-num-batched-tokens", self.max_num_batched_tokens) or [None],
            _counts("--max-num-seqs", self.max_num_seqs) or [None],
            _names("--routers", self.routers),
            [None, *_ratios(self.pd_ratios)]]
        combos: list[tuple[Any, ...]] = [()]
        for values in lists:
            combos = [(*c, v) for c in combos for v in values]
        return [Candidate(*c) for c in combos]


def _gpus(text: str) -> list[str]:
    """--gpus as preset keys (a price is found whatever the spelling), each once."""
    keys: list[str] = []
    for name in _names("--gpus", text):
        try:
            key = gpu_key(name)
        except ValueError as err:
            raise ValueError(f"--gpus: {err}") from None
        if key in keys:
            raise ValueError(f"--gpus: {name!r} is GPU {key} again")
        keys.append(key)
    return keys


def _once(option: str, values: list[Any], shown: list[str]) -> None:
    """ValueError naming the first value of a comma list given twice (its shape would be
    searched twice)."""
    for i, value in enumerate(values):
        if value in values[:i]:
            raise ValueError(f"{option}: {shown[i]!r} given twice")


def _ratios(text: str | None) -> list[tuple[int, int]]:
    """"1:1,1:3" -> [(1, 1), (1, 3)]; ValueError naming --pd-ratios."""
    ratios = []
    for item in (text or "").split(","):
        if item.strip():
            p, _, d = item.partition(":")
            try:
                ratio = (int(p), int(d))
            except ValueError:
                raise ValueError(f"--pd-ratios: expected P:D, got {item.strip()!r}") from None
            if min(ratio) < 1:
                raise ValueError(f"--pd-ratios: both sides must be >= 1, got {item.strip()!r}")
            ratios.append(ratio)
    _once("--pd-ratios", ratios, [f"{p}:{d}" for p, d in ratios])
    return ratios


def _items(option: str, text: str | None, kind: type) -> list[Any]:
    """A comma-list flag's values ([] when not given); ValueError naming the flag."""
    return comma_list(option, text, kind) if text and text.strip() else []


def _names(option: str, text: str | None) -> list[str]:
    """`_items` of names, at least one (an empty --gpus once searched nothing, then said
    that no shape met the SLO)."""
    values: list[str] = _items(option, text, str)
    if not values:
        raise ValueError(f"{option}: empty list")
    _once(option, values, values)
    return values


def _counts(option: str, text: str | None, required: bool = False) -> list[int]:
    """`_items` of integers, each >= 1 (and at least one when `required`)."""
    values = _items(option, text, int)
    if required and not values:
        raise ValueError(f"{option}: empty list")
    if any(v < 1 for v in values):
        raise ValueError(f"{option}: each value must be an integer >= 1, got {text!r}")
    _once(option, values, [str(v) for v in values])
    return values


@dataclass(frozen=True, slots=True)
class Candidate:
    """A fleet configuration without its replica count."""

    gpu: str
    model: str
    tensor_parallel_size: int
    max_num_batched_tokens: int | None
    max_num_seqs: int | None
    router: str
    pd_ratio: tuple[int, int] | None = None  # (prefill, decode) replicas per unit; None: both

    @property
    def unit(self) -> int:
        """Replicas per step of the replica count: P + D for a split, else 1."""
        return 1 if self.pd_ratio is None else sum(self.pd_ratio)

    def roles(self, units: int) -> list[str]:
        if self.pd_ratio is None:
            return ["both"] * units
        return ["prefill"] * (units * self.pd_ratio[0]) + ["decode"] * (units * self.pd_ratio[1])

    @property
    def engine_args(self) -> EngineArgs:
        return EngineArgs(max_num_batched_tokens=self.max_num_batched_tokens,
                          max_num_seqs=self.max_num_seqs,
                          tensor_parallel_size=self.tensor_parallel_size)

    def name(self) -> str:
        budget = f"-b{self.max_num_batched_tokens}" if self.max_num_batched_tokens else ""
        seqs = f"-s{self.max_num_seqs}" if self.max_num_seqs else ""
        pd = f"-pd{self.pd_ratio[0]}-{self.pd_ratio[1]}" if self.pd_ratio else ""
        return (f"{self.gpu}-{self.model.replace('/', '_')}-tp{self.tensor_parallel_size}"
                f"{budget}{seqs}-{self.router}{pd}")


@dataclass(frozen=True, slots=True)
class Shape:
    """A candidate with its replica count, and what it costs."""

    candidate: Candidate
    replicas: int  # units: replicas for an aggregated fleet, P + D replicas for a split
    gpu_cost_per_hour: float

    @property
    def num_replicas(self) -> int:
        return self.replicas * self.candidate.unit

    @property
    def gpus(self) -> int:
        return self.num_replicas * self.candidate.tensor_parallel_size

    @property
    def cost_per_hour(self) -> float:
        return self.gpus * self.gpu_cost_per_hour

    def name(self) -> str:
        return f"{self.candidate.name()}-x{self.num_replicas}"

    def summary(self) -> str:
        return (f"{self.name()} at ${self.cost_per_hour:.2f}/h ({self.gpus} GPUs, router "
                f"{self.candidate.router})")

    def fleet_toml(self) -> str:
        """The fleet file of this shape, for `rt simulate --fleet` (router: --router)."""
        c = self.candidate
        pools = ([("both", self.replicas)] if c.pd_ratio is None else
                 [("prefill", self.replicas * c.pd_ratio[0]),
                  ("decode", self.replicas * c.pd_ratio[1])])
        run = f"rt simulate --fleet FILE --router {c.router}" + (
            " --pd-decider always" if c.pd_ratio else "")
        return (f"# rt plan's cheapest passing shape; run it with\n#   {run}\n"
                + "\n".join(self._pool(role, count) for role, count in pools))

    def _pool(self, role: str, count: int) -> str:
        c = self.candidate
        engine = "".join(f"{key} = {value}\n" for key, value in (
            ("max_num_batched_tokens", c.max_num_batched_tokens),
            ("max_num_seqs", c.max_num_seqs)) if value is not None)
        name = c.gpu if role == "both" else f"{c.gpu}-{role}"
        return (f'[[pool]]\nname = "{name}"\ncount = {count}\ngpu = "{c.gpu}"\n'
                f'model = "{c.model}"\ntensor_parallel_size = {c.tensor_parallel_size}\n'
                + (f'role = "{role}"\n' if role != "both" else "")
                + f"cost_per_hour = {self.gpu_cost_per_hour * c.tensor_parallel_size:g}\n"
                + (f"\n[pool.engine]\n{engine}" if engine else ""))


@dataclass
class Pruned:
    candidate: Candidate
    reason: str


def replica_bounds(candidate: Candidate, trace: Trace, max_gpus: int, seed: int = 0
                   ) -> tuple[SimSetup, int, int]:
    """The setup of one replica and [lo, hi] replicas to search. ValueError with the reason
    when the candidate cannot work (model does not fit, a request never fits, or the mean
    load needs more than `max_gpus`)."""
    setup = build_setup(candidate.engine_args, candidate.model, candidate.gpu, None, seed)
    longest = max(r.prompt_len + r.output_len for r in trace)
    if not can_ever_fit(setup.config, max(r.prompt_len for r in trace)) or \
            longest > setup.config.scheduler.max_model_len:
        raise ValueError(f"a request of {longest} tokens never fits one replica (KV pool "
                         f"{setup.config.cache.num_blocks} blocks of "
                         f"{setup.config.cache.block_size}, max_model_len "
                         f"{setup.config.scheduler.max_model_len})")
    hi = max_gpus // (candidate.tensor_parallel_size * candidate.unit)
    replicas = math.ceil(_mean_token_load(trace) / (_peak_tokens_per_s(setup)
                                                    * PEAK_THROUGHPUT_SLACK))
    lo = max(1, math.ceil(replicas / candidate.unit))
    if hi < 1 or lo > hi:
        raise ValueError(f"the trace's mean load needs at least {max(replicas, 1)} replicas "
                         f"of {candidate.tensor_parallel_size} GPUs"
                         + (f" in units of {candidate.unit}" if candidate.unit > 1 else "")
                         + f", more than --max-gpus {max_gpus} allows")
    return setup, lo, hi


def _mean_token_load(trace: Trace) -> float:
    """Tokens per second the trace asks for (prompt + output), over its arrival span; 0
    (no bound) when the requests arrive at one instant, or so nearly that the rate
    overflows (e.g. --target-rate 1e308)."""
    arrivals = [r.arrival_s for r in trace]
    span = max(arrivals) - min(arrivals)
    tokens = sum(r.prompt_len + r.output_len for r in trace)
    load = tokens / span if span > 0 else 0.0
    return load if math.isfinite(load) else 0.0


def _peak_tokens_per_s(setup: SimSetup) -> float:
    """Tokens per second of back-to-back prefill-only steps at the full token budget."""
    q = setup.config.scheduler.max_num_batched_tokens
    step = BatchFeatures(num_prefill_tokens=q, num_seqs=1, num_prefill_seqs=1,
                         prefill_attention_pairs=q * (q + 1) // 2, prefill_kv_tokens=q)
    return q / setup.cost_model.step_time(step)


@dataclass
class ReplicaSearch:
    """Bisection for the fewest replicas in [lo, hi] that pass (more never hurt): first hi
    (if it fails, nothing in range passes), then halving."""

    candidate: Candidate
    lo: int
    hi: int
    best: int | None = None
    tried: dict[int, bool] = field(default_factory=dict)

    def next_count(self) -> int | None:
        if self.hi not in self.tried:
            return self.hi
        if self.best is None or self.lo >= self.best:
            return None
        return (self.lo + self.best) // 2

    def record(self, count: int, ok: bool) -> None:
        self.tried[count] = ok
        if ok:
            self.best = count if self.best is None else min(self.best, count)
        else:
            self.lo = count + 1


Judge = Callable[[list[Shape]], list[bool]]  # simulate the shapes, say which pass


def search(candidates: Sequence[Candidate], trace: Trace, max_gpus: int,
           prices: dict[str, float], judge: Judge, seed: int = 0
           ) -> tuple[list[ReplicaSearch], list[Pruned]]:
    """Prune, then bisect every remaining candidate's replica count at once (one `judge`
    batch per round). Returns the searches (best = fewest passing replicas, or None) and the
    pruned candidates with their reasons."""
    searches, pruned = [], []
    for candidate in candidates:
        _check_names(candidate)
        if candidate.gpu not in prices:
            raise ValueError(f"--gpu-cost: no price for GPU {candidate.gpu!r}")
        try:
            _, lo, hi = replica_bounds(candidate, trace, max_gpus, seed)
        except ValueError as err:
            pruned.append(Pruned(candidate, str(err)))
            continue
        searches.append(ReplicaSearch(candidate, lo, hi))
    while batch := [(s, n) for s in searches if (n := s.next_count()) is not None]:
        shapes = [Shape(s.candidate, n, prices[s.candidate.gpu]) for s, n in batch]
        for (s, n), ok in zip(batch, judge(shapes), strict=True):
            s.record(n, ok)
    return searches, pruned


def _check_names(candidate: Candidate) -> None:
    """Unknown GPUs, models and routers are the user's error, not a pruned candidate."""
    resolve_gpu(candidate.gpu)
    resolve_model(candidate.model)
    if candidate.router not in policy_names():
        raise ValueError(f"--routers: unknown policy {candidate.router!r} (choose from "
                         f"{', '.join(policy_names())})")


def cheapest(searches: Sequence[ReplicaSearch], prices: dict[str, float]) -> list[Shape]:
    """Every candidate's fewest passing replicas as a shape, cheapest first (then fewer
    GPUs, then name)."""
    shapes = [Shape(s.candidate, s.best, prices[s.candidate.gpu]) for s in searches
              if s.best is not None]
    return sorted(shapes, key=lambda s: (s.cost_per_hour, s.gpus, s.name()))


def simulate_shape(shape: Shape, trace: Trace, seed: int) -> tuple[RunResult, SimSetup]:
    """One shape on the trace: one engine, the fleet behind its router, or (with a P:D
    ratio) prefill and decode pools; returns the records and the replicas' setup."""
    from runtime.router.registry import make_policy
    from sim.fleet import simulate_fleet
    from sim.pd import PDDecider, simulate_pd
    from sim.simulator import simulate

    c = shape.candidate
    setup = build_setup(c.engine_args, c.model, c.gpu, None, seed)
    fleet = [setup] * shape.num_replicas
    if c.pd_ratio is not None:
        return simulate_pd(trace, fleet, c.roles(shape.replicas), make_policy(c.router, [], seed),
                           make_policy(c.router, [], seed + 1), PDDecider("always")), setup
    if shape.num_replicas == 1:
        return simulate(trace, setup.config, setup.cost_model), setup
    return simulate_fleet(trace, fleet, make_policy(c.router, [], seed)), setup
