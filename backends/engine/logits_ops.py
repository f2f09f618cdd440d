"""What a request's options do to its logits row before the draw, as vLLM V1's `Sampler`
(vllm/v1/sample/sampler.py) orders it: the min_tokens mask (`ModelRunner`), `logit_bias`,
then the penalties (repetition, frequency, presence; model_executor/layers/utils.py
`apply_penalties`), then greedy argmax, or temperature, top-k, top-p and the draw. So
penalties and biases change greedy output, and apply before the temperature divides.

Rows are [vocab] fp32; each function returns a new row and leaves its input as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backends.engine.sampling_options import SamplingOptions


def apply_logit_bias(row: torch.Tensor, logit_bias: Sequence[tuple[int, float]]
                     ) -> torch.Tensor:
    """row[id] + bias for each (id, bias) pair (ids distinct, inside the vocabulary)."""
    if not logit_bias:
        return row
    ids = torch.tensor([token for token, _ in logit_bias], device=row.device)
    biases = torch.tensor([bias for _, bias in logit_bias], dtype=row.dtype, device=row.device)
    return row.index_add(0, ids, biases)


def apply_penalties(row: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int],
                    opt: SamplingOptions) -> torch.Tensor:
    """vLLM's three penalties, in its order:

    repetition  a token of the prompt or the output: logit > 0 -> logit / p, else
                logit * p (on CUDA divided, as vLLM's kernel; elsewhere times 1 / p, as
                vLLM's torch path: the two round apart, so greedy output can differ)
    frequency   logit - f * (the token's count in the output)
    presence    logit - p * (1 if the token is in the output)

    The prompt counts for the repetition penalty only (OpenAI's definition of the other
    two: https://platform.openai.com/docs/api-reference/parameter-details)."""
    if not opt.has_penalties:
        return row
    vocab = row.shape[0]
    counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.int64),
                            minlength=vocab).to(row.device)
    in_output = counts > 0
    if opt.repetition_penalty != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        in_prompt[torch.tensor(list(prompt_ids), dtype=torch.int64, device=row.device)] = True
        penalties = torch.where(in_prompt | in_output,
                                torch.tensor(opt.repetition_penalty, dtype=row.dtype,
                                             device=row.device), 1.0)
        row = _repetition(row, penalties)
    if opt.frequency_penalty != 0.0:
        row = row - opt.frequency_penalty * counts.to(row.dtype)
    if opt.presence_penalty != 0.0:
        row = row - opt.presence_penalty * in_output.to(row.dtype)
    return row


def _repetition(row: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """vLLM's repetition penalty, rounded as vLLM rounds it on the row's device: its CUDA
    kernel (csrc/sampler.cu) divides a positive logit by the penalty; its torch fallback
    (CPU and the rest) multiplies by the reciprocal (`_custom_ops.py`)."""
    if row.is_cuda:
        return torch.where(row > 0, row / penalties, row * penalties)
    return row * torch.where(row > 0, 1.0 / penalties, penalties)
