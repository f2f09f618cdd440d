"""Re-fit a recorded `rt fidelity --endpoint` run offline: fit the profile on some of its
replays with this checkout's code, simulate the calibration traces and the trace, and print
p50 / p90 TTFT and ITL of each against the replays of it (what changed in the fit, without
a server; docs/calibration.md, "p90 ITL against vLLM").

    PYTHONPATH=$PWD python docs/measure/endpoint_refit.py RESULT_DIR TRACE [--fit cal|real]

RESULT_DIR holds calibration, real, real-2, calibration-2 (`--repeats 2`), sim/run.json and
fidelity.json; TRACE is the trace `rt fidelity` was given. The run's settings are taken from
RESULT_DIR: the seed, the model preset and the engine flags from sim/run.json, the number of
simulations from fidelity.json (calibration trace i is `resample_like(TRACE, seed + i + 1)`).
`--fit cal` fits on the calibration replays (out of sample for the trace, as `rt fidelity`),
`--fit real` on the real ones (in sample). Each row: the mean over the replays of their
p50 / p90 and the mean over the simulations of theirs (as `rt fidelity`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.config import EngineFlags
from sim.client_calibrate import _percentiles, profile_from_client_runs
from sim.client_steps import ClientRun
from sim.endpoint_config import ExportedConfig, endpoint_configs
from sim.endpoint_fidelity import read_client_run
from sim.fidelity import twin_simulations
from sim.profile import write_profile
from sim.simulator import SimResult
from workloads import read_rt_jsonl, resample_like

NAMES = ("calibration", "real", "real-2", "calibration-2")
FIT = {"cal": ("calibration", "calibration-2"), "real": ("real", "real-2")}
KEYS = ("p50_ttft", "p90_ttft", "p50_itl", "p90_itl")


@dataclass(frozen=True, slots=True)
class RunSettings:
    """What the recorded run was simulated with (its sim/run.json and fidelity.json)."""

    seed: int
    model: str  # the model preset, lower case (llama-3.1-8b)
    engine: EngineFlags
    sims: int


def run_settings(result: Path) -> RunSettings:
    """The recorded run's settings; ValueError naming the file."""
    try:
        info = json.loads((result / "sim" / "run.json").read_text())
        sims = int(json.loads((result / "fidelity.json").read_text())["sim_runs"])
        flags = info["engine_args"]
        return RunSettings(int(info["seed"]), str(info["model"]["name"]).lower(),
                           EngineFlags(max_num_batched_tokens=int(flags["max_num_batched_tokens"]),
                                       max_num_seqs=int(flags["max_num_seqs"])), sims)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{result}: no readable sim/run.json and fidelity.json ({err!r})") \
            from None


def simulated(run: ClientRun, sim: SimResult) -> np.ndarray:
    """A simulation's p50 / p90 TTFT and ITL (ms), by `sim.client_calibrate._percentiles`
    (`run`: a replay of the same trace, for the request ids)."""
    found = _percentiles([run], [sim], [frozenset()])
    return np.asarray([found[k]["simulated"] for k in KEYS])


def observed(run: ClientRun) -> np.ndarray:
    """A replay's p50 / p90 TTFT and ITL (ms) from its client chunk times. Not by
    `_percentiles`: its observed TTFT counts from the simulation's arrivals, a replay's
    TTFT from when its client sent the request (as `rt fidelity`)."""
    times = run.token_times_s
    ttft = [times[r.request_id][0] - r.arrival_s for r in run.trace]
    itl = [b - a for t in times.values() for a, b in zip(t, t[1:], strict=False)]
    return np.asarray([*np.percentile(ttft, [50, 90]), *np.percentile(itl, [50, 90])]) * 1e3


def refit(result: Path, trace_path: Path, fit: str) -> list[str]:
    """The report's lines (module docstring)."""
    settings = run_settings(result)
    trace = read_rt_jsonl(trace_path)
    sources = {"calibration": resample_like(trace, settings.seed + 1),
               "calibration-2": resample_like(trace, settings.seed + 2),
               "real": trace, "real-2": trace}
    read = {name: read_client_run(result / name, sources[name]) for name in NAMES}
    scheduler, cache, _ = endpoint_configs(settings.engine, [read[n][0] for n in NAMES],
                                           ExportedConfig.from_run_infos(
                                               [read[n][1] for n in NAMES]))
    profile, _ = profile_from_client_runs([read[n][0] for n in FIT[fit]], scheduler, cache,
                                          model="refit", date="offline", seed=settings.seed)
    out = [f"{result.name}, fitted on {fit}: p50 / p90 TTFT, p50 / p90 ITL (ms)"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        write_profile(profile, path)
        for label, replays in (("calibration", ("calibration",)),
                               ("calibration-2", ("calibration-2",)),
                               ("real", ("real", "real-2"))):
            _, twins, _ = twin_simulations(sources[label], scheduler, cache, settings.model,
                                           path, settings.seed, True, settings.sims)
            sim = np.mean([simulated(read[replays[0]][0], t.result) for t in twins], axis=0)
            real = np.mean([observed(read[n][0]) for n in replays], axis=0)
            out.append(f"  {label:<14} measured " + " ".join(f"{v:7.3f}" for v in real)
                       + "  sim " + " ".join(f"{v:7.3f}" for v in sim) + "  error "
                       + " ".join(f"{s / r - 1:+6.1%}" for r, s in zip(real, sim, strict=True)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--fit", choices=sorted(FIT), default="cal")
    args = parser.parse_args()
    try:
        lines = refit(args.result, args.trace, args.fit)
    except (OSError, ValueError) as err:
        print(f"endpoint_refit: {err}", file=sys.stderr)
        sys.exit(2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
