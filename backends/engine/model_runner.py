"""The executor: a `SchedulerOutput` in, one sampled token per finishing sequence out.

Per step: update the runner's own per-request state (token lists, block tables) from the
scheduler output, flatten the scheduled tokens into input ids, positions, slot mapping,
block tables, seq lens and query offsets, run the model, sample the rows whose sequence is
complete, and return `{req_id: [token]}` for `Scheduler.update_from_output`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from backends.engine.kv_cache import KVCache
from backends.engine.logits_ops import apply_logit_bias, apply_penalties
from backends.engine.model import AttentionMetadata, PagedModel
from backends.engine.sampling_options import GREEDY, SamplingOptions
from runtime.outputs import SchedulerOutput


@dataclass(slots=True)
class _RequestState:
    """The runner's copy of a scheduled request: its tokens and its block table."""

    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class StepInputs:
    """The flattened step. T tokens, S sequences, N sampling rows.

    Attributes:
        input_ids, positions: [T] int64.
        meta: slot mapping, block tables, seq lens, query offsets.
        logits_indices: [N] int64, the last row of each sequence that samples.
        sampling_req_ids: the N requests that sample, in row order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_req_ids: list[str]


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled: dict[str, list[int]]  # request id -> its one new token
    duration_s: float  # prepare + forward + sample, measured (CUDA events / perf_counter)


@dataclass(slots=True)
class _HostBatch:
    """Host-side lists of the flattened step, before they become tensors."""

    input_ids: list[np.ndarray] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)
    slots: list[np.ndarray] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    logits_indices: list[int] = field(default_factory=list)
    sampling_req_ids: list[str] = field(default_factory=list)


class ModelRunner:
    """Runs scheduler outputs on a `PagedModel` over a `KVCache`."""

    def __init__(self, model: PagedModel, kv_cache: KVCache, seed: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.spec.block_size
        self.device = model.device
        self.states: dict[str, _RequestState] = {}
        self.options: dict[str, SamplingOptions] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def register(self, req_id: str, options: SamplingOptions) -> None:
        """Sampling options of a request (before it is scheduled); default greedy."""
        self.options[req_id] = options
        if options.seed is not None:
            self._generators[req_id] = torch.Generator(device=self.device).manual_seed(
                options.seed)

    # ---- state -------------------------------------------------------------------------

    def update_states(self, output: SchedulerOutput) -> None:
        """Drop finished and preempted requests, add admitted ones (whole block tables;
        resumed ones with all their tokens), extend running ones' block tables."""
        for req_id in output.finished_req_ids:
            self.states.pop(req_id, None)
            self.options.pop(req_id, None)
            self._generators.pop(req_id, None)
        for req_id in output.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            tokens = new.prefill_token_ids if new.prefill_token_ids is not None \
                else new.prompt_token_ids
            self.states[new.req_id] = _RequestState(list(tokens), len(new.prompt_token_ids),
                                                    list(new.block_ids))
        cached = output.scheduled_cached_reqs
        for req_id, block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            self.states[req_id].block_ids.extend(block_ids)

    def computed_tokens(self, output: SchedulerOutput) -> dict[str, int]:
        """Each scheduled request's computed tokens before this step."""
        computed = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return computed

    # ---- inputs ------------------------------------------------------------------------

    def prepare_inputs(self, output: SchedulerOutput) -> StepInputs:
        """Flatten the step (after `update_states`), requests in num_scheduled_tokens order."""
        computed = self.computed_tokens(output)
        host = _HostBatch()
        for req_id, count in output.num_scheduled_tokens.items():
            self._add_sequence(host, req_id, computed[req_id], count)
        return self._to_device(host)

    def _add_sequence(self, host: _HostBatch, req_id: str, start: int, count: int) -> None:
        state = self.states[req_id]
        end = start + count
        positions = np.arange(start, end, dtype=np.int64)
        blocks = np.asarray(state.block_ids, dtype=np.int64)
        host.input_ids.append(np.asarray(state.token_ids[start:end], dtype=np.int64))
        host.positions.append(positions)
        host.slots.append(blocks[positions // self.block_size] * self.block_size +
                          positions % self.block_size)
        host.tables.append(state.block_ids)
        host.seq_lens.append(end)
        host.query_start_loc.append(host.query_start_loc[-1] + count)
        if end >= len(state.token_ids):  # the sequence is complete: it samples
            host.logits_indices.append(host.query_start_loc[-1] - 1)
            host.sampling_req_ids.append(req_id)

    def _to_device(self, host: _HostBatch) -> StepInputs:
        width = max((len(table) for table in host.tables), default=0)
        tables = np.zeros((len(host.tables), max(width, 1)), dtype=np.int32)
        for row, table in enumerate(host.tables):
            tables[row, :len(table)] = table

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=tensor(np.concatenate(host.slots)),
            block_tables=tensor(tables),
            seq_lens=tensor(np.asarray(host.seq_lens, dtype=np.int32)),
            query_start_loc=tensor(np.asarray(host.query_start_loc, dtype=np.int32)),
        )
        return StepInputs(
            input_ids=tensor(np.concatenate(host.input_ids)),
            positions=tensor(np.concatenate(host.positions)),
            meta=meta,
            logits_indices=tensor(np.asarray(host.logits_indices, dtype=np.int64)),
            sampling_req_ids=host.sampling_req_ids,
        )

    # ---- execution -----------------------------------------------------------------------

    def execute(self, output: SchedulerOutput) -> StepResult:
        """Run one step; the sampled tokens are appended to the runner's token lists."""
        timer = _StepTimer(self.device)
        self.update_states(output)
        if not output.num_scheduled_tokens:
            return StepResult({}, timer.stop())
        inputs = self.prepare_inputs(output)
        logits = self.model.forward(inputs.input_ids, inputs.positions, inputs.meta,
                                    self.kv_cache, inputs.logits_indices)  # [N, vocab]
        sampled: dict[str, list[int]] = {}
        if inputs.sampling_req_ids:  # else only non-final prefill chunks: N = 0
            tokens = self.sample(logits, inputs.sampling_req_ids)
            for req_id, token in zip(inputs.sampling_req_ids, tokens, strict=True):
                self.states[req_id].token_ids.append(token)
                sampled[req_id] = [token]
        return StepResult(sampled, timer.stop())

    def sample(self, logits: torch.Tensor, req_ids: list[str]) -> list[int]:
        """logits [N, vocab] fp32 -> one token per row (vLLM's order: the min_tokens mask,
        logit_bias, the penalties, then greedy or the draw; `logits_ops`)."""
        options = [self.options.get(req_id, GREEDY) for req_id in req_ids]
        logits = self._mask_min_tokens(logits, req_ids, options)
        logits = self._bias_and_penalize(logits, req_ids, options)
        if all(opt.greedy for opt in options):
            return logits.argmax(dim=-1).tolist()
        return [self._sample_row(logits[row], opt, self._generators.get(req_id,
                                                                        self.generator))
                for row, (req_id, opt) in enumerate(zip(req_ids, options, strict=True))]

    def _mask_min_tokens(self, logits: torch.Tensor, req_ids: list[str],
                         options: list[SamplingOptions]) -> torch.Tensor:
        """Stop tokens get -inf while a request has fewer than min_tokens outputs."""
        masked = logits
        for row, (req_id, opt) in enumerate(zip(req_ids, options, strict=True)):
            state = self.states[req_id]
            num_outputs = len(state.token_ids) - state.num_prompt_tokens
            if opt.stop_token_ids and num_outputs < opt.min_tokens:
                if masked is logits:
                    masked = logits.clone()
                masked[row, list(opt.stop_token_ids)] = float("-inf")
        return masked

    def _bias_and_penalize(self, logits: torch.Tensor, req_ids: list[str],
                           options: list[SamplingOptions]) -> torch.Tensor:
        """logit_bias, then the penalties, on the rows of requests that set them."""
        changed = logits
        for row, (req_id, opt) in enumerate(zip(req_ids, options, strict=True)):
            if not opt.logit_bias and not opt.has_penalties:
                continue
            if changed is logits:
                changed = logits.clone()
            state = self.states[req_id]
            tokens, num_prompt = state.token_ids, state.num_prompt_tokens
            changed[row] = apply_penalties(apply_logit_bias(logits[row], opt.logit_bias),
                                           tokens[:num_prompt], tokens[num_prompt:], opt)
        return changed

    @staticmethod
    def _sample_row(row: torch.Tensor, opt: SamplingOptions,
                    generator: torch.Generator) -> int:
        """row [vocab] fp32 -> a token: temperature, top-k, top-p, then a seeded draw."""
        if opt.greedy:
            return int(row.argmax())
        # A temperature past the dtype's max would divide by inf (-inf / inf = nan).
        row = row / min(opt.temperature, torch.finfo(row.dtype).max)
        if not torch.isfinite(row.max()):
            # +inf or nan logits (a repetition_penalty that is 0 in float32 multiplies a
            # positive logit by 1/0; 0 * inf is nan) or none finite: softmax gives nan and
            # torch.multinomial raises, which killed the engine process. vLLM's CPU sampler
            # takes the argmax of logits plus finite Gumbel noise: the first nan, else the
            # first +inf (else the first token); so does this.
            return int(row.argmax())
        if 0 < opt.top_k < row.shape[0]:
            threshold = torch.topk(row, opt.top_k).values[-1]
            row = row.masked_fill(row < threshold, float("-inf"))
        if opt.top_p < 1.0:
            row = _top_p_filter(row, opt.top_p)
        probs = torch.softmax(row, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))


def _top_p_filter(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose cumulative probability first reaches top_p."""
    sorted_logits, order = torch.sort(row, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before
    drop_sorted[0] = False  # the most likely token always stays (a rounding error or a
    # subnormal top_p would otherwise drop every token: softmax of all -inf is nan)
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return row.masked_fill(drop, float("-inf"))


class _StepTimer:
    """Step time: CUDA events on a GPU, perf_counter on the CPU. Seconds."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record()
        else:
            self.started = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.end_event.record()
            self.end_event.synchronize()
            return float(self.start_event.elapsed_time(self.end_event)) / 1000.0
        return time.perf_counter() - self.started

