"""Offline generation: every prompt submitted at once, stepped to completion, no clock.

The simplest driver of the real engine (tests compare it with transformers' `generate`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from backends.engine.model_runner import ModelRunner
from backends.engine.sampling_options import SamplingOptions
from runtime import Request, SamplingParams, Scheduler


@dataclass(frozen=True, slots=True)
class OfflineResult:
    outputs: dict[str, list[int]]  # request id -> its output tokens
    num_steps: int
    num_preemptions: int  # preemption events over the run


def generate_offline(scheduler: Scheduler, runner: ModelRunner,
                     prompts: Mapping[str, Sequence[int]], max_tokens: int,
                     options: SamplingOptions | None = None,
                     check_invariants: bool = False) -> OfflineResult:
    """Generate `max_tokens` tokens (EOS ignored) for each prompt, all added at once."""
    outputs: dict[str, list[int]] = {}
    for req_id, prompt in prompts.items():
        scheduler.add_request(Request(req_id, list(prompt),
                                      SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        if options is not None:
            runner.register(req_id, options)
    steps = preemptions = 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        preemptions += len(output.preempted_req_ids)
        result = runner.execute(output)
        for request in scheduler.update_from_output(output, result.sampled):
            outputs[request.request_id] = request.output_token_ids
        if check_invariants:
            scheduler.check_invariants()
        steps += 1
    return OfflineResult(outputs, steps, preemptions)
