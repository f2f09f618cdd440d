"""`rt bench serve --soak SECONDS`: hold a fixed number of streams against `rt serve` for a
bounded time, on loopback, and report what a long-running server must not do: fail
requests, miscount tokens, grow its memory, leak file descriptors, or keep KV blocks after
the last request.

Each of `concurrency` workers sends one streamed completion after another on its own
keep-alive connection (the lean client, `sse_client`) until the deadline: random prompt
token ids of `input_len`, `max_tokens` = `output_len` with `ignore_eos`, so every answer
must carry exactly `output_len` tokens. Resident memory (VmRSS) and open descriptors of the
API-server and engine processes are read from /proc (Linux) before the load, after the
warm-up (`start`, the baseline of the growth: a quarter of the run, at most 60 s), each second
(the peak; about 20 samples of RSS are kept as `rss_mib_series`) and at the end.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.bench.sse_client import Connection, Streamed, run_client
from backends.replay.endpoint_probe import own_get

MAX_SOAK_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class SoakConfig:
    duration_s: float
    concurrency: int
    input_len: int
    output_len: int
    vocab_size: int
    seed: int = 0
    warmup_s: float | None = None  # default: a quarter of the duration, at most 60 s
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.duration_s <= MAX_SOAK_S:
            raise ValueError(f"--soak must be in (0, {MAX_SOAK_S:g}] seconds, got "
                             f"{self.duration_s}")

    @property
    def warmup(self) -> float:
        # The baseline of the growth comes after the warm-up: the prefix cache's block-hash
        # map fills up to the pool's size first (57,429 blocks: ~70 s at 500 streams).
        return self.warmup_s if self.warmup_s is not None else min(60.0, self.duration_s / 4)


def process_stats(pid: int) -> dict[str, float]:
    """Resident memory (MiB) and open file descriptors of a process (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines()
                   if line.startswith("VmRSS:"))
    return {"rss_mib": round(rss_kib / 1024, 1),
            "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))}


@dataclass(slots=True)
class _Tally:
    completed: int = 0
    errors: int = 0
    mismatches: int = 0
    tokens: int = 0
    first_errors: dict[str, int] | None = None

    def add(self, out: Streamed, wanted: int) -> None:
        if out.error is not None:
            self.errors += 1
            self.first_errors = self.first_errors or {}
            if len(self.first_errors) < 5 or out.error in self.first_errors:
                self.first_errors[out.error] = self.first_errors.get(out.error, 0) + 1
            return
        self.completed += 1
        self.tokens += out.completion_tokens or 0
        # A chunk may carry several tokens (a stream that fell behind catches up, as vLLM's)
        if out.completion_tokens != wanted or not 0 < len(out.event_times_s) <= wanted:
            self.mismatches += 1


def run_soak(url: str, pids: dict[str, int], config: SoakConfig,
             engines: Sequence[str] = ()) -> dict[str, Any]:
    """Run the soak against the server at `url` (`http://127.0.0.1:PORT`); `pids` names
    its processes (api_server, engine). `engines`: the servers whose KV blocks are read
    after (summed; default `url`; a router's backends). The report as a dict."""
    return run_client(_soak(url, pids, config, tuple(engines) or (url,)))


async def _soak(url: str, pids: dict[str, int], config: SoakConfig, engines: tuple[str, ...]
                ) -> dict[str, Any]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    tally = _Tally()
    idle = {name: process_stats(pid) for name, pid in pids.items()}
    start = time.monotonic()
    deadline = start + config.duration_s
    peak = dict(idle)

    async def worker(index: int) -> None:
        rng = random.Random(config.seed * 100003 + index)
        conn = Connection(host, int(port))
        while time.monotonic() < deadline:
            body = {"prompt": [rng.randrange(10, config.vocab_size)
                               for _ in range(config.input_len)],
                    "max_tokens": config.output_len, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            try:
                async with asyncio.timeout(config.request_timeout_s):
                    out = await conn.post_stream("/v1/completions", body)
            except TimeoutError:
                out = Streamed(time.perf_counter(), error="timed out")
                await conn.close()
            tally.add(out, config.output_len)
        await conn.close()

    series: list[dict[str, float]] = []  # RSS (MiB) about 20 times over the soak

    async def sampler() -> dict[str, dict[str, float]]:
        await asyncio.sleep(config.warmup)
        baseline = {name: process_stats(pid) for name, pid in pids.items()}
        every = max(1, round(config.duration_s / 20))
        tick = 0
        while time.monotonic() < deadline:
            stats = {name: process_stats(pid) for name, pid in pids.items()}
            for name, now in stats.items():
                peak[name] = {k: max(v, now[k]) for k, v in peak[name].items()}
            if tick % every == 0:
                series.append({"t_s": round(time.monotonic() - start),
                               **{name: now["rss_mib"] for name, now in stats.items()}})
            tick += 1
            await asyncio.sleep(1.0)
        return baseline

    sampling = asyncio.create_task(sampler())
    await asyncio.gather(*(worker(i) for i in range(config.concurrency)))
    baseline = await sampling
    wall = time.monotonic() - start
    kv = await asyncio.to_thread(_kv_after_all, engines)
    end = {name: process_stats(pid) for name, pid in pids.items()}
    processes = {name: _process_report(idle[name], baseline[name], peak[name], end[name])
                 for name in pids}
    return {
        "soak_s": config.duration_s, "wall_s": round(wall, 1), "concurrency": config.concurrency,
        "random_input_len": config.input_len, "random_output_len": config.output_len,
        "completed": tally.completed, "errors": tally.errors,
        "error_messages": tally.first_errors or {},
        "token_count_mismatches": tally.mismatches,
        "output_tokens_per_s": round(tally.tokens / wall, 1),
        "processes": processes, "rss_mib_series": series, **kv,
    }


def _process_report(idle: dict[str, float], start: dict[str, float], peak: dict[str, float],
                    end: dict[str, float]) -> dict[str, Any]:
    """One process's figures: RSS growth from the soak's start (after the warm-up) to its
    end, file descriptors from idle to end (no client connection open at either)."""
    return {"idle": idle, "start": start, "peak": peak, "end": end,
            "rss_growth_pct": round(100 * (end["rss_mib"] / start["rss_mib"] - 1), 1),
            "fds_growth": end["fds"] - idle["fds"]}


def _kv_after_all(urls: tuple[str, ...]) -> dict[str, Any]:
    """`_kv_after` summed over servers."""
    each = [_kv_after(url) for url in urls]
    return {key: sum(kv[key] for kv in each) for key in each[0]}


def _kv_after(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """KV blocks in use once the server is idle (it reports usage after each step)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while True:
        text = own_get(f"{url}/metrics").text
        values, blocks = {}, 0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = sample.value
                if sample.name == "vllm:cache_config_info":
                    blocks = int(sample.labels["num_gpu_blocks"])
        usage = values.get("vllm:kv_cache_usage_perc", 0.0)
        running = values.get("vllm:num_requests_running", 0.0)
        if (usage == 0 and running == 0) or time.monotonic() > deadline:
            return {"requests_running_after": int(running),
                    "kv_blocks_in_use_after": round(usage * blocks),
                    "kv_blocks_total": blocks}
        time.sleep(0.1)
