"""`rt fidelity TRACE --endpoint URL`: the out-of-sample fidelity loop against a server rt can
send traffic to but not instrument (a vLLM deployment, `rt serve`).

0. A warm-up (`sim.endpoint_warmup`: windows of resampled traces into root/warmup,
   root/warmup-2, ..., unused but reported) until the server's client ITL median is steady
   or `warmup_requests` were replayed: a server's first requests are slow (76 ms TTFT for
   the first on a fresh rt serve --simulate whose steady TTFT is 12 ms; a CPU torch engine's
   first ~100 requests ~25% slower than the ones after them).
1. Replays, in the order given (`analysis.fidelity.replay_order`: C R, R C, ... so a linear
   drift of the machine falls on calibration and real runs alike): a calibration replay
   (C) of a trace resampled from TRACE (other requests and arrivals, the same lengths and
   mean rate; seed + i + 1) and a real replay (R) of TRACE, each into its run directory by
   the injected `EndpointReplay` (sim/ cannot import the HTTP client in backends/). Each
   replay draws its prompts' token ids from its own seed (`token_seed` + its place in the
   order): the server's prefix cache outlives a replay, and prompts it has seen are served
   from it (a second real run of the same ids: TTFT p50 -30% on the loopback truth).
2. The server's configuration (`sim.endpoint_config`: what its run.json says the endpoint
   exported, else the engine flags) and a profile fitted on the calibration runs' chunk
   times (`sim.client_calibrate`; with `fit_on_replay`, on the real runs: in sample), or
   the given profile.
3. `sim_runs` simulations of TRACE under that configuration with the profile
   (`sim.fidelity.twin_simulations`), each written by the injected `Save`
   (`sim.fidelity_run.Save`: the CLI's `RunConsole.save`).

The caller then reports real (the mean of the real runs, their spread the noise floor)
against simulated (the mean of the simulations) with `analysis.fidelity`.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.config import EngineFlags
from sim.client_calibrate import profile_from_client_runs
from sim.client_steps import REQUIRED_COLUMNS, ClientRun, client_run
from sim.endpoint_config import ExportedConfig, endpoint_configs
from sim.endpoint_warmup import WARMUP_REQUESTS, Warmup, run_warmup
from sim.fidelity import FidelityFlags, twin_simulations
from sim.fidelity_run import FidelityDirs, Save, save_twins
from sim.profile import write_profile
from workloads import Trace, resample_like

# Replay the trace into this run directory, its prompts' token ids drawn from this seed.
EndpointReplay = Callable[[Trace, Path, int], None]


@dataclass(frozen=True, slots=True)
class EndpointFidelityPlan:
    """What to run.

    Attributes:
        order: the replays, ("calibration" or "real", repeat index), in the order to run.
        seed: the trace's seed (calibration trace i is resampled with seed + i + 1) and the
            first simulation's step-noise seed.
        token_seed: the token-id seed of the first replay (the warm-up's first window), the
            next ones' count up from it; a fresh one for each invocation against a
            long-lived server, whose prefix cache still holds the prompts of earlier ones.
        model: the simulated model (a preset or config dir: vocabulary and shape only; the
            step times come from the profile).
        profile: a given profile (then `order` should hold no calibration replays), or None
            to fit one.
        fit_on_replay: fit on the real runs instead of calibration runs (in sample).
        step_noise: draw the simulations' step times from the profile's scatter.
        sim_runs: simulations of the trace (1 when the steps are deterministic).
        warmup_requests: the warm-up's bound in requests (0: none).
        rt_version: what a fitted profile names as rt's version (cli.py's
            `analysis.rundir.rt_version`).
    """

    order: tuple[tuple[str, int], ...]
    seed: int
    model: str
    token_seed: int = 0
    profile: Path | None = None
    fit_on_replay: bool = False
    step_noise: bool = True
    sim_runs: int = 8
    warmup_requests: int = WARMUP_REQUESTS
    rt_version: str = "unknown"

    def __post_init__(self) -> None:
        calibrates = any(kind == "calibration" for kind, _ in self.order)
        if not any(kind == "real" for kind, _ in self.order):
            raise ValueError("rt fidelity --endpoint: no real replay in the plan")
        if self.profile is None and not (calibrates or self.fit_on_replay):
            raise ValueError("rt fidelity --endpoint: no profile and no calibration replay")
        if self.sim_runs < 1:
            raise ValueError(f"--sim-runs must be >= 1, got {self.sim_runs}")
        if self.warmup_requests < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {self.warmup_requests}")

    @classmethod
    def of(cls, how: FidelityFlags, order: Sequence[tuple[str, int]], seed: int,
           model: str | None, step_noise: bool, step_drift: bool, rt_version: str
           ) -> EndpointFidelityPlan:
        """`rt fidelity --endpoint`'s plan from its flags (ValueError on what an endpoint
        cannot honour: `check_endpoint_flags`), with a fresh token seed: the server's prefix
        cache outlives this invocation."""
        import secrets

        check_endpoint_flags(how.calibrate_on, step_drift)
        return cls(tuple(order), seed, model or "llama-3.1-8b", secrets.randbits(31),
                   how.profile, how.fit_on_replay, step_noise, how.sim_runs,
                   how.warmup_requests, rt_version)


@dataclass(frozen=True, slots=True)
class EndpointFidelity:
    """What ran: the real and calibration run directories (in repeat order), the profile
    simulated, the simulations' directories, the server's configuration's sources
    (`sim.endpoint_config`), lines for the user (the warm-up, the fit per term, notes) and
    the warm-up."""

    reals: list[Path]
    calibrations: list[Path]
    profile: Path
    sims: list[Path]
    sources: dict[str, str]
    lines: list[str]
    warmup: Warmup

    def dirs(self) -> FidelityDirs:
        """The run directories and profile to report, the warm-up in fidelity.json."""
        return FidelityDirs(self.reals, self.sims, self.profile, self.calibrations,
                            {"warmup": self.warmup.to_json_dict()})


def check_endpoint_flags(calibrate_on: str, step_drift: bool) -> None:
    """ValueError for `rt fidelity` flags an endpoint cannot honour."""
    if calibrate_on != "replay":
        raise ValueError(f"--calibrate-on {calibrate_on} with --endpoint: an endpoint is "
                         "calibrated on replays only (no designed grid of steps)")
    if step_drift:
        raise ValueError("--step-drift with --endpoint: the drift is fitted on measured "
                         "steps, and an endpoint's steps are only reconstructed")


def read_client_run(path: Path, trace: Trace) -> tuple[ClientRun, dict[str, Any]]:
    """The client-timed run in the run directory `path` (the replay of `trace`, whose token
    ids and prefix sharing it keeps) and its run.json; ValueError naming the run."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path / "requests.parquet")
        info = json.loads((path / "run.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable run directory ({err})") from None
    names = [c for c in (*REQUIRED_COLUMNS, "cached_tokens") if c in table.column_names]
    return client_run(str(path), table.select(names).to_pydict(), trace), info


def _replays(trace: Trace, replay: EndpointReplay, plan: EndpointFidelityPlan, root: Path
             ) -> tuple[dict[str, list[tuple[Path, Trace]]], Warmup]:
    """The warm-up, then the plan's replays; kind -> [(run directory, trace replayed)] in
    repeat order, and the warm-up."""
    warmup, token_seed = run_warmup(trace, plan.warmup_requests, plan.seed + len(plan.order) + 1,
                                    plan.token_seed, root, replay,
                                    lambda path, source: read_client_run(path, source)[0])
    done: dict[str, list[tuple[int, Path, Trace]]] = {"real": [], "calibration": []}
    for place, (kind, i) in enumerate(plan.order, start=1):
        source = trace if kind == "real" else resample_like(trace, plan.seed + i + 1)
        path = root / (kind + (f"-{i + 1}" if i else ""))
        replay(source, path, token_seed + place - 1)
        done[kind].append((i, path, source))
    return {kind: [(p, t) for _, p, t in sorted(runs, key=lambda r: r[0])]
            for kind, runs in done.items()}, warmup


def _fit(fit_runs: Sequence[ClientRun], all_runs: Sequence[ClientRun],
         infos: Sequence[dict[str, Any]], engine: EngineFlags, plan: EndpointFidelityPlan,
         root: Path) -> tuple[Path, Any, Any, dict[str, str], list[str]]:
    """The server's configs from `infos` and the flags (sized over `all_runs`), and the
    profile: the plan's, or one fitted on `fit_runs` written to root/profile.json."""
    scheduler, cache, sources = endpoint_configs(engine, all_runs,
                                                 ExportedConfig.from_run_infos(infos))
    if plan.profile is not None and not plan.fit_on_replay:
        return plan.profile, scheduler, cache, sources, []
    model = str((infos[0].get("model") or {}).get("name") or "unknown")
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    profile, fit = profile_from_client_runs(fit_runs, scheduler, cache, model=model, date=date,
                                            rt_version=plan.rt_version, sources=sources,
                                            seed=plan.seed)
    path = root / "profile.json"
    write_profile(profile, path)
    return path, scheduler, cache, sources, [*fit.lines(), f"wrote {path}"]


def endpoint_fidelity(trace: Trace, engine: EngineFlags, plan: EndpointFidelityPlan,
                      root: Path, replay: EndpointReplay, save: Save) -> EndpointFidelity:
    """The loop of the module docstring. ValueError (one line) when a run cannot be read
    or fitted."""
    root.mkdir(parents=True, exist_ok=True)
    replays, warmup = _replays(trace, replay, plan, root)
    read = {kind: [read_client_run(path, source) for path, source in runs]
            for kind, runs in replays.items()}
    fit_on = "real" if plan.fit_on_replay else "calibration"
    all_runs = [run for runs in read.values() for run, _ in runs]
    infos = [info for runs in read.values() for _, info in runs]
    profile, scheduler, cache, sources, lines = _fit(
        [run for run, _ in read[fit_on]], all_runs, infos, engine, plan, root)
    setup, twins, notes = twin_simulations(trace, scheduler, cache, plan.model, profile,
                                           plan.seed, plan.step_noise, plan.sim_runs)
    paths = save_twins(save, root, trace, setup, twins, server_config_from=sources)
    lines = warmup.lines() + lines + notes + [f"server configuration: {name} from {where}"
                      for name, where in sources.items()]
    return EndpointFidelity([p for p, _ in replays["real"]],
                            [p for p, _ in replays["calibration"]], profile,
                            paths, sources, lines, warmup)
