"""`SimConfig`: everything a simulation run depends on besides the trace and the cost model.

Its own module, outside the compiled engine loop (`sim/simulator.py`, `RT_COMPILE=1`): a
frozen dataclass compiled by mypyc cannot be pickled or deep-copied (its state is restored
by assigning to frozen fields), and a config travels to sweep workers and Ray tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime import CacheConfig, SchedulerConfig
from sim.cost.api_server import ApiServerCost
from sim.step_noise import StepNoise


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything a simulation run depends on besides the trace and the cost model.

    Attributes:
        scheduler, cache: the engine core's configuration.
        api_server: tokenization cost of the API-server stage.
        vocab_size: token ids are drawn from [10, vocab_size).
        seed: seed of the synthetic token ids.
        check_invariants: run `Scheduler.check_invariants()` after every step (slow).
        fast_forward: advance runs of plain decode steps together (`runtime.decode_run`);
            the records are identical either way, only faster.
        step_noise: multiply the predicted time of step k, starting at t seconds, by
            `step_noise.factor(k, t)` and add its stall (`StepNoise.duration`; None: every
            step takes exactly the cost model's time).
        trace_block_ids: name the KV blocks of hash-id prompts by the trace's coordinates
            instead of SHA-256 (`sim.block_ids`); the records are identical either way.
    """

    scheduler: SchedulerConfig
    cache: CacheConfig
    api_server: ApiServerCost = field(default_factory=ApiServerCost)
    vocab_size: int = 32_000
    seed: int = 0
    check_invariants: bool = False
    fast_forward: bool = True
    step_noise: StepNoise | None = None
    trace_block_ids: bool = True

    def __post_init__(self) -> None:
        if self.vocab_size <= 10:
            raise ValueError(f"vocab_size must be > 10, got {self.vocab_size}")
