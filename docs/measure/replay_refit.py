"""Re-fit a recorded `rt fidelity` run of the real engine offline: fit the profile on its
calibration replays with this checkout's code (as `rt fidelity` does after replaying), run the
twin simulations of its trace and print the fidelity table against its real replays. What a
change to the fit does to a GPU run, on a machine without a GPU (docs/results.md, "On an
H200").

    PYTHONPATH=$PWD python docs/measure/replay_refit.py RESULT_DIR TRACE OUT [--sim-runs 8]

RESULT_DIR holds calibration*, real* and sim/run.json (`bash .ci/gpu fidelity` leaves it in
/tmp/rt-gpu-fidelity, the trace in /tmp/rt-gpu-trace.jsonl); the engine's configs come from
real/run.json, the simulator's model preset and seed from sim/run.json. OUT receives the
profile, the simulations and fidelity.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from analysis.fidelity import report_fidelity_dirs
from analysis.rundir import rt_version, write_result
from runtime.config import CacheConfig, SchedulerConfig
from sim.calibrate import replay_api_cost
from sim.calibrate_run import save_profile, steps_profile
from sim.fidelity import twin_simulations
from sim.fidelity_run import predicted_steps, save_twins
from workloads.loaders import load_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result_dir", type=Path)
    parser.add_argument("trace", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--sim-runs", type=int, default=8)
    args = parser.parse_args()
    root: Path = args.result_dir
    calibrations = sorted(root.glob("calibration*"))
    reals = sorted(root.glob("real*"))
    for what, found in (("calibration* replay", calibrations), ("real* replay", reals),
                        ("sim/run.json", [root / "sim" / "run.json"])):
        if not found or not all(path.exists() for path in found):
            raise SystemExit(f"replay_refit: {root} has no {what}")
    if not args.trace.is_file():
        raise SystemExit(f"replay_refit: TRACE {args.trace}: no such file")
    fitted, notes = steps_profile(calibrations, "wall", rt_version(),
                                  replay_api_cost(calibrations))
    profile = save_profile(fitted, args.out / "profile.json", print)
    real = json.loads((reals[0] / "run.json").read_text())
    sim = json.loads((root / "sim" / "run.json").read_text())
    trace = load_trace(args.trace).trace
    setup, twins, more = twin_simulations(
        trace, SchedulerConfig(**real["scheduler_config"]), CacheConfig(**real["cache_config"]),
        str(sim["model"]["name"]), profile, int(sim["seed"]), True,
        args.sim_runs)
    sims = save_twins(write_result, args.out, trace, setup, twins)
    for line in notes + more:
        print(line)
    report_fidelity_dirs(reals, sims, lambda steps: predicted_steps(profile, steps).tolist(),
                         args.out, False, None, print, print, calibrations)


if __name__ == "__main__":
    main()
