"""The scheduler and KV pool of a server rt can send traffic to but not instrument (a vLLM
deployment, `rt serve`): what the server exports, else rt's engine flags, else defaults,
with where each value came from (for run.json and the profile's `fit.server_config.from`).

What a vLLM server exports: `max_model_len` in `GET /v1/models`, and the labels of the
`vllm:cache_config_info` gauge on `GET /metrics` (block_size, num_gpu_blocks,
enable_prefix_caching). `rt replay --endpoint` records both in its run.json's `endpoint`
section (`max_model_len`, `cache_config`). The token budget and `max_num_seqs` are not
exported: they come from the engine flags (the server's own flags), else vLLM's defaults.

Precedence: an engine flag the user set (`--max-model-len`, `--num-gpu-blocks-override`)
over the exported value; the exported block size and prefix caching over the flags'
defaults (those two flags always have a value, so the server's own report wins).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from runtime import CacheConfig, SchedulerConfig
from runtime.config import EngineFlags, default_batch_limits
from sim.client_steps import ClientRun

METRICS = "endpoint /metrics (vllm:cache_config_info)"
MODELS = "endpoint /v1/models"


@dataclass(frozen=True, slots=True)
class ExportedConfig:
    """What the server exported (None: not exported). `num_gpu_blocks` counts vLLM's null
    block, as rt's `CacheConfig.num_blocks` does."""

    max_model_len: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    enable_prefix_caching: bool | None = None

    @classmethod
    def from_run_infos(cls, infos: Sequence[Mapping[str, Any]]) -> ExportedConfig:
        """The first value of each field found in the runs' run.json `endpoint` sections
        (`max_model_len`, and `cache_config` as scraped from /metrics)."""
        found: dict[str, Any] = {}
        for info in infos:
            endpoint = info.get("endpoint") or {}
            values = {"max_model_len": endpoint.get("max_model_len"),
                      **(endpoint.get("cache_config") or {})}
            for f in fields(cls):
                if found.get(f.name) is None and values.get(f.name) is not None:
                    found[f.name] = values[f.name]
        return cls(**found)


def _scheduler(engine: EngineFlags, runs: Sequence[ClientRun], exported: ExportedConfig,
               sources: dict[str, str]) -> SchedulerConfig:
    batched, seqs = default_batch_limits(None)
    longest = max(r.prompt_len + r.output_len for run in runs for r in run.trace)
    if engine.max_model_len:
        model_len, sources["max_model_len"] = engine.max_model_len, "flag"
    elif exported.max_model_len:
        model_len, sources["max_model_len"] = exported.max_model_len, MODELS
    else:
        model_len, sources["max_model_len"] = longest, "the longest request"
    for name, default in (("max_num_batched_tokens", batched), ("max_num_seqs", seqs)):
        sources[name] = "flag" if getattr(engine, name) is not None else \
            f"vLLM's default for an unknown device ({default}; not exported: give the flag)"
    return SchedulerConfig(
        max_num_batched_tokens=engine.max_num_batched_tokens or max(batched, seqs),
        max_num_seqs=engine.max_num_seqs or seqs, max_model_len=model_len,
        long_prefill_token_threshold=engine.long_prefill_token_threshold,
        enable_chunked_prefill=engine.enable_chunked_prefill,
        # ignore: the flag is a str; SchedulerConfig refuses one not a `Policy` literal
        policy=engine.policy)  # type: ignore[arg-type]


def _cache(engine: EngineFlags, runs: Sequence[ClientRun], exported: ExportedConfig,
           sources: dict[str, str]) -> CacheConfig:
    block_size = exported.block_size or engine.block_size
    sources["block_size"] = METRICS if exported.block_size else "flag (default 16)"
    caching = (exported.enable_prefix_caching if exported.enable_prefix_caching is not None
               else engine.enable_prefix_caching)
    sources["enable_prefix_caching"] = (METRICS if exported.enable_prefix_caching is not None
                                        else "flag (default on)")
    blocks = engine.num_gpu_blocks_override or exported.num_gpu_blocks
    sources["num_blocks"] = ("flag" if engine.num_gpu_blocks_override else METRICS
                             if exported.num_gpu_blocks else
                             "every request at once (KV never binds; not exported)")
    if blocks is None:
        blocks = 1 + max(sum(-(-(r.prompt_len + r.output_len) // block_size) for r in run.trace)
                         for run in runs)
    return CacheConfig(block_size=block_size, num_blocks=blocks,
                       enable_prefix_caching=caching)


def endpoint_configs(engine: EngineFlags, runs: Sequence[ClientRun],
                     exported: ExportedConfig = ExportedConfig()
                     ) -> tuple[SchedulerConfig, CacheConfig, dict[str, str]]:
    """The server's scheduler and KV pool (module docstring's precedence); without an
    exported or flagged value: vLLM's batch limits for an unknown device, max_model_len the
    longest request of `runs`, a KV pool holding every request of a run at once. Returns
    the configs and where each value came from."""
    sources: dict[str, str] = {}
    scheduler = _scheduler(engine, runs, exported, sources)
    return scheduler, _cache(engine, runs, exported, sources), sources
