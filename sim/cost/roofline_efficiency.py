"""`RooflineEfficiency`: the fractions of the datasheet peaks a real step achieves, and the
costs no roofline sees (`sim.cost.roofline`).

Its own module, outside the compiled roofline model (`RT_COMPILE=1`): a frozen dataclass
compiled by mypyc cannot be pickled or deep-copied (its state is restored by assigning to
frozen fields), and a cost model travels to sweep workers and Ray tasks.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.cost.base import _check_number


@dataclass(frozen=True, slots=True)
class RooflineEfficiency:
    """Fractions of the datasheet peaks a real step achieves, and the costs no roofline sees.

    Attributes:
        flops_efficiency: η_F, achieved / peak dense FLOP/s for matmuls and attention.
            0.8: a square 8192³ bf16 matmul on the target H200 ran at 769-798 TFLOP/s, 78-81%
            of 989 (ref §3a); the ml-engineering MAMF table gives 80.3% on H100 SXM (§3b).
        memory_efficiency: η_B, achieved / peak memory bandwidth for streaming reads and
            writes (weights, KV). 0.9: device-to-device copy on the H200 reached ~4.3 of
            4.8 TB/s (§3a); vLLM's FP8-KV blog's ITL slopes per context token put decode KV
            reads at 90% of peak on H100 and 91% on B200 (§3c).
        step_overhead_s: fixed time per step beyond the roofline terms, seconds (scheduling,
            input preparation, sampling, launch gaps). 1.5 ms: the vLLM FP8-KV blog fits
            Llama-3.1-8B on H100 (vLLM 0.19.1, concurrency 1, BF16 KV) to ITL = 6.44 ms +
            4.37e-5 ms/token (§3c); its weight read at η_B is 15.01e9 B / (0.9 · 3.35e12 B/s)
            = 4.98 ms, leaving 1.46 ms. The same fit on B200 leaves 3.93 - 2.08 = 1.85 ms.
        per_seq_overhead_s: CPU time per scheduled request, seconds. 1.1 µs: vLLM V1's
            `Scheduler.update_from_output()` takes 0.287 ms at 256 requests (PR #46112, §3d).
        allreduce_latency_s: fixed latency α of one tensor-parallel all-reduce, seconds.
            25 µs: Vidur's H100 DGX profile at TP8 gives 23-37 µs at 2,048 fp16 elements and
            34-39 µs at 1-2M elements, whose ring traffic at 450 GB/s is 8-16 µs (§3e).
    """

    flops_efficiency: float = 0.8
    memory_efficiency: float = 0.9
    step_overhead_s: float = 1.5e-3
    per_seq_overhead_s: float = 1.1e-6
    allreduce_latency_s: float = 25e-6

    def __post_init__(self) -> None:
        for name in ("flops_efficiency", "memory_efficiency"):
            _check_number("RooflineEfficiency", name, getattr(self, name), positive=True)
            if getattr(self, name) > 1:
                raise ValueError(
                    f"RooflineEfficiency.{name} must be at most 1, got {getattr(self, name)!r}"
                )
        for name in ("step_overhead_s", "per_seq_overhead_s", "allreduce_latency_s"):
            _check_number("RooflineEfficiency", name, getattr(self, name), positive=False)


DEFAULT_EFFICIENCY = RooflineEfficiency()
