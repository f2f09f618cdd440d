"""`rt calibrate`'s sources besides the grid (import-light, so the CLI can declare them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.flags import flag
from sim.fidelity import CALIBRATION_PANEL

SIMULATED = "simulate"  # run.json "kind" of `rt simulate`'s runs (analysis.run_json.KINDS)

# `rt calibrate --help`'s description of the command, beside its flags.
CALIBRATE_HELP = """\
Fit the simulator's `profile` cost model to the real backend: a designed grid of
prefill, decode and mixed batches (warm-up, repeats, medians), the API-server costs, a
non-negative least-squares fit of the six coefficients, its held-out error. Writes a
profile for `rt simulate --profile`.
"""


@dataclass(frozen=True, slots=True)
class CalibrationSources:
    """What `rt calibrate` fits on besides (or instead of) the grid."""

    from_steps: list[Path] | None = flag(
        None, "--from-steps", "steps.parquet (or run directory) of an earlier `rt replay`: "
        "training data. Alone: fit on these steps only; with --model: added to the grid.",
        CALIBRATION_PANEL)
    target: str = flag(
        "wall", "--target", "Step time to fit from --from-steps alone: wall (end - start, what "
        "the simulator must reproduce) or execute (the runner's measurement).",
        CALIBRATION_PANEL)
    from_run: list[Path] | None = flag(
        None, "--from-run", "A client-timed run (`rt replay --endpoint` directory, or a `vllm "
        "bench serve --save-detailed` JSON): fit the step costs and the front end's to its "
        "chunk times, under the server's engine flags (docs/calibration.md).",
        CALIBRATION_PANEL)

    def mode(self, with_model: bool, step_drift: bool) -> str:
        """"runs" (client-timed), "steps" (replay steps alone) or "grid"; ValueError on a
        combination that does not fit together."""
        steps_alone = bool(self.from_steps) and not with_model
        if step_drift and not steps_alone:
            raise ValueError("--step-drift needs --from-steps alone (a grid has no step-time "
                             "scatter)")
        if self.from_run:
            if self.from_steps or with_model:
                raise ValueError("--from-run fits client timings alone: without --from-steps "
                                 "or --model")
            return "runs"
        return "steps" if steps_alone else "grid"

    def check_measured(self, run_info: Callable[[Path], Mapping[str, Any] | None]) -> None:
        """ValueError naming the flag and the path of a source `rt simulate` wrote (run.json
        kind "simulate"; `rt fidelity`'s twin runs too): its step and token times are a cost
        model's own, so a profile fitted to them is the cost model fitted to itself (once
        accepted without a word). `run_info(path)`: the source's run.json, None where it
        has none (a bare steps.parquet, a vLLM bench file; a client-timed replay of
        `rt serve --simulate` is an endpoint's run, accepted: measured at the client)."""
        for option, paths, wanted in (
                ("--from-steps", self.from_steps, "a real engine's replay (`rt replay`)"),
                ("--from-run", self.from_run, "a client-timed run (`rt replay --endpoint`, "
                                              "or a vLLM bench file)")):
            for path in paths or []:
                info = run_info(path)
                if info is not None and info.get("kind") == SIMULATED:
                    raise ValueError(
                        f"{option} {path}: a simulated run (run.json kind {SIMULATED!r}): a "
                        f"profile fitted to a cost model's own times is circular; give "
                        f"{wanted}")
