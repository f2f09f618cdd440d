"""Engine output tokens/s against transformers' `generate` with static batching, on the same
requests (the `engine_throughput` section of `rt bench gpu`; goal: at least 5x).

Both sides get the same requests: random prompt token ids from a seeded generator, prompt
lengths spread around `prompt_len`, exactly `output_len` new tokens each (EOS ignored),
greedy. rt runs them all at once through `build_engine` + `generate_offline` (prefix caching
off, a KV pool sized to hold every request, so no preemption); transformers runs them in
left-padded batches of a fixed size, one batch after another, on the same weights (the
engine's own `hf_model`), device and dtype. Each side is timed end to end after a warm-up,
with `torch.cuda.synchronize()` around the clock on CUDA. The first few requests' outputs
are compared as a sanity check (reported, never failed: bf16 greedy can diverge); where
they differ, the reference's logits at the first difference say whether it was a near-tie.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from backends.engine.offline import OfflineResult, generate_offline
from backends.engine.setup import RealEngineArgs, RealSetup, build_engine
from backends.engine.tiny_model import (
    DEFAULT_MODELS_DIR,
    LLAMA_3_2_1B,
    LLAMA_3_2_3B,
    build_random_llama,
    build_tiny_llama,
)
from runtime import Scheduler

GOAL_RATIO = 5.0  # rt output tokens/s over transformers' static batching
MIN_TOKEN_ID = 10  # random prompt ids avoid the low (special) ids
Report = dict[str, Any]
Prompts = dict[str, list[int]]

RANDOM_MODELS: dict[str, dict[str, Any]] = {"1b": LLAMA_3_2_1B, "3b": LLAMA_3_2_3B}


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """The requests and batch sizes of one comparison.

    Attributes:
        num_requests: requests, all submitted at once to rt.
        prompt_len: mean prompt length in tokens; lengths are uniform in
            [prompt_len * (1 - prompt_spread), prompt_len * (1 + prompt_spread)].
        output_len: new tokens per request (exactly; EOS ignored).
        hf_batch_size: sequences per transformers batch; None = as many as rt runs at once
            (min(num_requests, max_num_seqs)).
        max_num_seqs: rt's --max-num-seqs; None = the engine default for the device.
        num_compared: leading requests whose outputs are compared token by token.
    """

    num_requests: int = 64
    prompt_len: int = 512
    output_len: int = 128
    prompt_spread: float = 0.25
    seed: int = 0
    hf_batch_size: int | None = None
    max_num_seqs: int | None = None
    num_compared: int = 4

    def __post_init__(self) -> None:
        for name in ("num_requests", "prompt_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.prompt_spread < 1.0:
            raise ValueError(f"prompt_spread must be in [0, 1), got {self.prompt_spread}")
        if self.hf_batch_size is not None and self.hf_batch_size < 1:
            raise ValueError(f"hf_batch_size must be >= 1, got {self.hf_batch_size}")


GPU_PLAN = EnginePlan()  # ~64 x 512 prompt x 128 output on the 1B shape: ~1 minute on an H200


# %%
# Requests


def make_prompts(plan: EnginePlan, vocab_size: int) -> Prompts:
    """`plan.num_requests` random prompts (ids in [MIN_TOKEN_ID, vocab_size)), lengths
    spread uniformly around plan.prompt_len, from a generator seeded with plan.seed."""
    gen = torch.Generator().manual_seed(plan.seed)
    low = max(1, round(plan.prompt_len * (1 - plan.prompt_spread)))
    high = max(low, round(plan.prompt_len * (1 + plan.prompt_spread)))
    lengths = torch.randint(low, high + 1, (plan.num_requests,), generator=gen).tolist()
    return {f"req-{i}": torch.randint(MIN_TOKEN_ID, vocab_size, (n,), generator=gen).tolist()
            for i, n in enumerate(lengths)}


def blocks_needed(prompts: Prompts, output_len: int, block_size: int) -> int:
    """KV blocks that hold every request at full length at once, plus the null block."""
    return 1 + sum(-(-(len(p) + output_len) // block_size) for p in prompts.values())


# %%
# Timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """(fn's result, its wall-clock seconds), the device synchronised on both sides."""
    _sync(device)
    began = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - began


def _throughput(seconds: float, tokens: int) -> Report:
    return {"seconds": seconds, "output_tokens": tokens,
            "output_tokens_per_s": tokens / seconds if seconds > 0 else float("inf")}


# %%
# rt


def _run_engine(setup: RealSetup, prompts: Prompts, output_len: int,
                prefix: str) -> OfflineResult:
    """Every prompt through a fresh scheduler (empty block pool) on the setup's runner."""
    scheduler = Scheduler(setup.scheduler, setup.cache)
    named = {f"{prefix}{req_id}": prompt for req_id, prompt in prompts.items()}
    result = generate_offline(scheduler, setup.runner, named, output_len)
    outputs = {req_id.removeprefix(prefix): out for req_id, out in result.outputs.items()}
    return OfflineResult(outputs, result.num_steps, result.num_preemptions)


def time_engine(setup: RealSetup, prompts: Prompts, output_len: int
                ) -> tuple[Report, dict[str, list[int]]]:
    """rt end to end over all prompts after one full warm-up run (Triton compiles, CUDA
    allocator): (report with seconds and output tokens/s, outputs by request id)."""
    device = setup.runner.device
    _, warmup_s = _timed(lambda: _run_engine(setup, prompts, output_len, "warmup-"), device)
    result, seconds = _timed(lambda: _run_engine(setup, prompts, output_len, "timed-"),
                             device)
    tokens = sum(len(out) for out in result.outputs.values())
    return ({**_throughput(seconds, tokens), "warmup_s": warmup_s,
             "num_steps": result.num_steps, "num_preemptions": result.num_preemptions},
            result.outputs)


# %%
# transformers


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [B, longest] int64, padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _generate_batch(hf_model: Any, prompts: list[list[int]], output_len: int,
                    pad_id: int) -> list[list[int]]:
    """One static batch through `generate` (greedy, exactly output_len new tokens: no EOS
    stops it); the new tokens of each row."""
    device = next(hf_model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    with torch.inference_mode():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                max_new_tokens=output_len, min_new_tokens=output_len,
                                eos_token_id=None, pad_token_id=pad_id)
    new: list[list[int]] = out[:, ids.shape[1]:].tolist()  # hf_model is untyped (Any)
    if any(len(row) != output_len for row in new):
        raise RuntimeError(f"generate returned {len(new[0])} new tokens, not {output_len}")
    return new


def _generate_all(hf_model: Any, prompts: Prompts, output_len: int, batch_size: int,
                  pad_id: int) -> dict[str, list[int]]:
    ids = list(prompts)
    outputs: dict[str, list[int]] = {}
    for start in range(0, len(ids), batch_size):
        batch = ids[start:start + batch_size]
        rows = _generate_batch(hf_model, [prompts[i] for i in batch], output_len, pad_id)
        outputs.update(zip(batch, rows, strict=True))
    return outputs


def time_generate(hf_model: Any, prompts: Prompts, output_len: int, batch_size: int,
                  pad_id: int) -> tuple[Report, dict[str, list[int]]]:
    """transformers' static batching over all prompts, after a warm-up of the first batch
    with a few new tokens: (report with seconds and output tokens/s, outputs by id)."""
    device = next(hf_model.parameters()).device
    first = [prompts[i] for i in list(prompts)[:batch_size]]
    _, warmup_s = _timed(lambda: _generate_batch(hf_model, first, min(output_len, 4),
                                                 pad_id), device)
    outputs, seconds = _timed(lambda: _generate_all(hf_model, prompts, output_len,
                                                    batch_size, pad_id), device)
    tokens = sum(len(out) for out in outputs.values())
    return ({**_throughput(seconds, tokens), "warmup_s": warmup_s, "batch_size": batch_size,
             "num_batches": -(-len(prompts) // batch_size),
             "attn_implementation": getattr(hf_model.config, "_attn_implementation", None)},
            outputs)


# %%
# Agreement and the whole comparison


def compare_outputs(ours: dict[str, list[int]], theirs: dict[str, list[int]],
                    req_ids: list[str]) -> Report:
    """Token-by-token agreement of the given requests: per request, whether all tokens are
    equal and the index of the first difference (None when equal)."""
    rows = []
    for req_id in req_ids:
        a, b = ours[req_id], theirs[req_id]
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                     None if len(a) == len(b) else min(len(a), len(b)))
        rows.append({"request": req_id, "equal": first is None, "first_mismatch": first})
    return {"num_compared": len(rows), "all_equal": all(r["equal"] for r in rows),
            "requests": rows}


def mismatch_logits(hf_model: Any, prompt: list[int], ours: list[int], theirs: list[int],
                    first: int) -> Report:
    """What the reference model's next-token logits said where the two greedy outputs first
    differ (index `first`): one forward pass over the prompt and the `first` agreed tokens, in
    the model's own dtype. `gap`: logit(theirs) - logit(ours) >= 0 when transformers' pick is
    its own argmax; a gap within `resolution` (the logits' dtype spacing at that magnitude) is
    a near-tie that rounding alone can flip."""
    device = next(hf_model.parameters()).device
    ids = torch.tensor([prompt + ours[:first]], dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = hf_model(input_ids=ids).logits[0, -1]
    ours_logit, theirs_logit = float(logits[ours[first]]), float(logits[theirs[first]])
    top2 = torch.topk(logits.float(), 2).values.tolist()
    resolution = float(torch.finfo(logits.dtype).eps) * max(abs(top2[0]), 1e-30)
    return {"ours_logit": ours_logit, "theirs_logit": theirs_logit,
            "gap": theirs_logit - ours_logit, "top2_gap": top2[0] - top2[1],
            "resolution": resolution, "dtype": str(logits.dtype).removeprefix("torch.")}


def explain_mismatches(agreement: Report, hf_model: Any, prompts: Prompts,
                       ours: dict[str, list[int]], theirs: dict[str, list[int]]) -> Report:
    """`agreement` with each differing request's `mismatch_logits` at its first difference
    (none past the shorter output)."""
    rows = []
    for row in agreement["requests"]:
        first, req_id = row["first_mismatch"], row["request"]
        if first is not None and first < min(len(ours[req_id]), len(theirs[req_id])):
            row = {**row, "at_mismatch": mismatch_logits(
                hf_model, prompts[req_id], ours[req_id], theirs[req_id], first)}
        rows.append(row)
    return {**agreement, "requests": rows}


def _pad_id(config: Any) -> int:
    pad = getattr(config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def engine_vs_generate(model_dir: Path, device: str = "cuda", dtype: str = "auto",
                       plan: EnginePlan = GPU_PLAN, use_triton: bool | None = None) -> Report:
    """rt's output tokens/s against transformers' `generate` with static batching on the
    same requests, same weights, device and dtype. JSON-ready report: `rt` and
    `transformers` (seconds, output tokens, output tokens/s, warm-up seconds), `ratio`
    (rt / transformers), `goal_ratio`, `meets_goal`, `agreement` and `config`."""
    setup, prompts = _setup(model_dir, device, dtype, plan, use_triton)
    rt_report, rt_outputs = time_engine(setup, prompts, plan.output_len)
    batch_size = plan.hf_batch_size or min(plan.num_requests, setup.scheduler.max_num_seqs)
    hf_report, hf_outputs = time_generate(setup.model.hf_model, prompts, plan.output_len,
                                          batch_size, _pad_id(setup.model.config))
    ratio = rt_report["output_tokens_per_s"] / hf_report["output_tokens_per_s"]
    lengths = [len(p) for p in prompts.values()]
    return {
        "rt": rt_report, "transformers": hf_report, "ratio": ratio, "goal_ratio": GOAL_RATIO,
        "meets_goal": ratio >= GOAL_RATIO,
        "agreement": explain_mismatches(
            compare_outputs(rt_outputs, hf_outputs, list(prompts)[:plan.num_compared]),
            setup.model.hf_model, prompts, rt_outputs, hf_outputs),
        "config": {**asdict(plan), "hf_batch_size": batch_size,
                   "prompt_len_min": min(lengths), "prompt_len_max": max(lengths),
                   "prompt_tokens": sum(lengths), "engine": setup.describe()},
    }


def _setup(model_dir: Path, device: str, dtype: str, plan: EnginePlan,
           use_triton: bool | None) -> tuple[RealSetup, Prompts]:
    """The engine with a KV pool that holds every request (read from the model directory
    first for the vocabulary and block size), and the prompts."""
    from backends.engine.model import load_config

    vocab = int(load_config(Path(model_dir)).vocab_size)
    prompts = make_prompts(plan, vocab)
    longest = max(len(p) for p in prompts.values()) + plan.output_len
    args = RealEngineArgs(Path(model_dir), device=device, dtype=dtype,
                          max_num_seqs=plan.max_num_seqs, enable_prefix_caching=False,
                          use_triton=use_triton, seed=plan.seed, max_model_len=longest)
    blocks = blocks_needed(prompts, plan.output_len, args.block_size)
    return build_engine(replace(args, num_gpu_blocks_override=blocks)), prompts


# %%
# `rt bench gpu`


def bench_model_dir(name: str) -> Path:
    """A benchmark model directory: `1b`/`3b` (Llama-3.2 shapes, random bf16 weights, built
    once under ~/.cache/rt), `tiny` (the test model) or an existing local directory."""
    if name in RANDOM_MODELS:
        return build_random_llama(DEFAULT_MODELS_DIR / f"random-llama-3.2-{name}",
                                  RANDOM_MODELS[name])
    if name == "tiny":
        return build_tiny_llama()
    path = Path(name)
    if not path.is_dir():
        raise ValueError(f"--engine-model must be {', '.join(RANDOM_MODELS)}, tiny or a "
                         f"model directory; got {name!r}")
    return path


def engine_throughput_section(model: str = "1b", plan: EnginePlan = GPU_PLAN,
                              device: str = "cuda", dtype: str = "bfloat16"
                              ) -> Callable[[], Report]:
    """The `engine_throughput` callable of `run_gpu_bench`: builds the model, runs
    `engine_vs_generate`, and reports a failure as {"error": ...} so the run's other
    sections and its JSON stay intact."""

    def run() -> Report:
        began = time.perf_counter()
        try:
            model_dir = bench_model_dir(model)
            built_s = time.perf_counter() - began
            report = engine_vs_generate(model_dir, device, dtype, plan)
        except Exception as err:  # a benchmark cut short still reports the rest
            return {"model": model, "error": f"{type(err).__name__}: {err}",
                    "traceback": traceback.format_exc(limit=6)}
        return {"model": model, "model_build_s": built_s, **report,
                "wall_s": time.perf_counter() - began}

    return run
