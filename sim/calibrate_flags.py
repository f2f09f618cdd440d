"""`rt calibrate`'s sources besides the grid (import-light, so the CLI can declare them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.flags import flag
from sim.fidelity import CALIBRATION_PANEL

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
