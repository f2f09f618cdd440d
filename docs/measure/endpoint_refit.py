"""Re-fit a recorded `rt fidelity --endpoint` run offline: fit the profile on some of its
replays with this checkout's code, simulate the calibration traces and the trace, and print
p50 / p90 TTFT and ITL of each against the replays of it (what changed in the fit, without
a server; docs/calibration.md, "p90 ITL against vLLM").

    PYTHONPATH=$PWD python docs/measure/endpoint_refit.py RESULT_DIR TRACE [--fit cal|real]
        [--sims 8] [--seed 0] [--max-num-batched-tokens 2048 --max-num-seqs 128]

RESULT_DIR holds calibration, real, real-2, calibration-2 (`--repeats 2`); TRACE is the
trace `rt fidelity` was given, and `--seed` its `--seed` (calibration trace i is
`resample_like(TRACE, seed + i + 1)`). `--fit cal` fits on the calibration replays (out of
sample for the trace, as `rt fidelity`), `--fit real` on the real ones (in sample).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from runtime.config import EngineFlags
from sim.client_calibrate import profile_from_client_runs
from sim.client_steps import ClientRun
from sim.endpoint_config import ExportedConfig, endpoint_configs
from sim.endpoint_fidelity import read_client_run
from sim.fidelity import twin_simulations
from sim.profile import write_profile
from workloads import read_rt_jsonl, resample_like

NAMES = ("calibration", "real", "real-2", "calibration-2")
FIT = {"cal": ("calibration", "calibration-2"), "real": ("real", "real-2")}


def percentiles(ttft_s: list[float], itl_s: list[float]) -> np.ndarray:
    """p50 / p90 TTFT, p50 / p90 ITL in ms."""
    return np.concatenate([np.percentile(ttft_s, [50, 90]), np.percentile(itl_s, [50, 90])]) * 1e3


def replay_metrics(run: ClientRun) -> np.ndarray:
    """A replay's percentiles (client chunk times)."""
    times = run.token_times_s
    return percentiles([times[r.request_id][0] - r.arrival_s for r in run.trace],
                       [b - a for t in times.values() for a, b in zip(t, t[1:], strict=False)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--fit", choices=sorted(FIT), default="cal")
    parser.add_argument("--sims", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    args = parser.parse_args()
    trace = read_rt_jsonl(args.trace)
    sources = {"calibration": resample_like(trace, args.seed + 1),
               "calibration-2": resample_like(trace, args.seed + 2),
               "real": trace, "real-2": trace}
    read = {name: read_client_run(args.result / name, sources[name]) for name in NAMES}
    engine = EngineFlags(max_num_batched_tokens=args.max_num_batched_tokens,
                         max_num_seqs=args.max_num_seqs)
    scheduler, cache, _ = endpoint_configs(engine, [read[n][0] for n in NAMES],
                                           ExportedConfig.from_run_infos(
                                               [read[n][1] for n in NAMES]))
    profile, _ = profile_from_client_runs([read[n][0] for n in FIT[args.fit]], scheduler,
                                          cache, model="refit", date="offline", seed=args.seed)
    path = Path(tempfile.mkdtemp()) / "profile.json"
    write_profile(profile, path)
    print(f"{args.result.name}, fitted on {args.fit}: p50 / p90 TTFT, p50 / p90 ITL (ms)")
    for label, replays in (("calibration", ("calibration",)),
                           ("calibration-2", ("calibration-2",)), ("real", ("real", "real-2"))):
        _, twins, _ = twin_simulations(sources[label], scheduler, cache, "llama-3.1-8b", path,
                                       args.seed, True, args.sims)
        sim = np.mean([percentiles(
            [r.first_token_s - r.arrival_s for r in t.result.requests],
            [b - a for r in t.result.requests
             for a, b in zip(r.token_times_s, r.token_times_s[1:], strict=False)])
            for t in twins], axis=0)
        real = np.mean([replay_metrics(read[n][0]) for n in replays], axis=0)
        print(f"  {label:<14} measured " + " ".join(f"{v:7.3f}" for v in real) + "  sim "
              + " ".join(f"{v:7.3f}" for v in sim) + "  error "
              + " ".join(f"{s / r - 1:+6.1%}" for r, s in zip(real, sim, strict=True)))


if __name__ == "__main__":
    main()
