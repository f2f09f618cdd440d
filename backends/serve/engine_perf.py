"""The engine loop's MFU estimate (rt serve --enable-mfu-metrics): vLLM's FLOPs and bytes
per GPU for each step (`runtime.perf`), and for the empty step vLLM takes when it goes idle.

vLLM steps once more when nothing is left to run but requests finished since its last
schedule (its `has_requests` counts them until a schedule reports them to the workers): an
empty batch, whose estimate is the weights read once (a lone 44-token request on the tiny
Llama, vLLM 0.32 CPU: 7,878,656 read bytes, 6,436,864 without it). rt's core does not take
that step (its records are the steps that run the model); its estimate is counted once per
idle spell instead, with the step that emptied the engine (or alone, after an abort).
"""

from __future__ import annotations

from runtime.outputs import SchedulerOutput
from runtime.perf import BatchContext, PerfShape, StepPerf, batch_perf, step_perf


class PerfEstimate:
    """Per-step estimates for one engine; `idle_counted`: this idle spell's empty step is
    counted (reset by every step)."""

    def __init__(self, shape: PerfShape) -> None:
        self.shape = shape
        self.idle_counted = False

    def step(self, output: SchedulerOutput) -> StepPerf:
        """A scheduled step's estimate."""
        self.idle_counted = False
        return step_perf(self.shape, output)

    def idle(self) -> StepPerf:
        """The empty step's estimate (the weights read once), counted once per idle spell."""
        self.idle_counted = True
        return batch_perf(self.shape, BatchContext())

    def with_idle(self, perf: StepPerf) -> StepPerf:
        """`perf` (the step that emptied the engine) plus the empty step's."""
        return perf + self.idle()
