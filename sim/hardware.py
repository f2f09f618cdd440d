"""GPU datasheet numbers for the roofline cost model and the KV-pool sizing.

Every number carries its source; the sources are summarised in
`/work/shared/reference/models_and_gpus.md` §2 (datasheet table) and §3 (measurements).
Units: bytes, bytes per second (B/s), FLOP per second (FLOP/s). GB = 1e9 B, GiB = 2**30 B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 10**9
GIB = 2**30

# The highest price of a GPU-hour rt takes, US dollars (--gpu-cost-per-hour, --gpu-cost, a
# fleet pool's cost_per_hour per GPU): H100s and H200s rent at ~$2-10 an hour, so a price
# above this is a typo, and 1e308 printed costs of inf or 300 digits.
MAX_USD_PER_GPU_HOUR = 10_000.0


def _require_positive(owner: str, field: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{owner}.{field} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}.{field} must be a positive finite number, got {value!r}")


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator, dense bf16 numbers (no 2:4 sparsity).

    Attributes:
        name: display name.
        memory_bytes: datasheet memory capacity, bytes.
        mem_bandwidth_Bps: peak memory bandwidth, B/s.
        bf16_dense_flops: peak dense bf16 tensor-core throughput, FLOP/s.
        interconnect_Bps: GPU-to-GPU bandwidth per GPU and per direction, B/s (NVLink, or
            PCIe where the part has no NVLink); the tensor-parallel all-reduce uses it.
        visible_memory_bytes: the total the CUDA driver reports (vLLM's `total_gpu_memory`,
            which `gpu_memory_utilization` multiplies), bytes. It differs from the marketing
            capacity: "141 GB" H200s report 139.81 GiB. None: use `memory_bytes`.
    """

    name: str
    memory_bytes: int
    mem_bandwidth_Bps: float
    bf16_dense_flops: float
    interconnect_Bps: float
    visible_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"GpuSpec.name must be a non-empty string, got {self.name!r}")
        for field in ("memory_bytes", "mem_bandwidth_Bps", "bf16_dense_flops", "interconnect_Bps"):
            _require_positive("GpuSpec", field, getattr(self, field))
        if self.visible_memory_bytes is not None:
            _require_positive("GpuSpec", "visible_memory_bytes", self.visible_memory_bytes)

    @property
    def total_memory_bytes(self) -> int:
        """Memory the utilisation fraction applies to, bytes (visible if known)."""
        if self.visible_memory_bytes is not None:
            return self.visible_memory_bytes
        return self.memory_bytes

    @property
    def ridge_flops_per_byte(self) -> float:
        """Peak FLOP/s over peak B/s: the arithmetic intensity where compute takes over."""
        return self.bf16_dense_flops / self.mem_bandwidth_Bps


# Dense bf16 FLOP/s: stas00/ml-engineering compute/accelerator/README.md, "TFLOPS comparison
# table (w/o sparsity)" (reference §2). NVLink figures are totals over both directions; a
# ring all-reduce streams one direction per link, so the per-direction half is used.
GPU_PRESETS: dict[str, GpuSpec] = {
    "a100-80gb": GpuSpec(
        name="A100-SXM4-80GB",
        memory_bytes=80 * GB,  # NVIDIA A100 datasheet via glennklockwood.com (ref §2)
        mem_bandwidth_Bps=2.039e12,  # 2.039 TB/s, same source
        bf16_dense_flops=312e12,  # 312 TF dense bf16, ml-engineering table
        interconnect_Bps=300e9,  # NVLink3 600 GB/s bidirectional (thundercompute A100 guide)
        # FLAG: vLLM profiling logs on 80 GB parts print total_gpu_memory 79.14-79.15 GiB;
        # those logs do not name the part, so this is an assumption for the A100.
        visible_memory_bytes=84_986_665_370,  # 79.15 GiB
    ),
    "h100-sxm": GpuSpec(
        name="H100-SXM5-80GB",
        memory_bytes=80 * GB,  # NVIDIA Hopper table mirror, archive-lib.hpctech.co.jp (ref §2)
        mem_bandwidth_Bps=3.35e12,  # 3,350 GB/s, same source
        bf16_dense_flops=989.4e12,  # glennklockwood H100 page: 989.4 dense bf16
        interconnect_Bps=450e9,  # NVLink4 900 GB/s bidirectional (Hopper table)
        visible_memory_bytes=84_986_665_370,  # 79.15 GiB, vLLM logs on 80 GB parts (FLAG above)
    ),
    "h200": GpuSpec(
        name="H200-SXM-141GB",
        memory_bytes=141 * GB,  # MLCommons inference_results_v4.1 H200-SXM-141GBx8 system JSON
        mem_bandwidth_Bps=4.8e12,  # 4.8 TB/s, ml-engineering memory table
        bf16_dense_flops=989e12,  # same compute as H100 (ml-engineering table)
        interconnect_Bps=450e9,  # "18x 4th Gen NVLink, 900GB/s" (MLCommons system JSON)
        # vLLM's profiling log on an H200: "total_gpu_memory (139.81GiB)"; nvidia-smi shows
        # 143771MiB. 139.81 is rounded to 0.01 GiB (±5 MiB).
        visible_memory_bytes=150_119_844_413,
    ),
    "b200": GpuSpec(
        name="B200-HGX-180GB",
        memory_bytes=180 * GB,  # ml-engineering: 180 GB per NVIDIA HGX docs (192 physical)
        mem_bandwidth_Bps=8.0e12,  # glennklockwood B200 page; FLAG pytorch/ao #4002 says 7.67
        bf16_dense_flops=2250e12,  # glennklockwood B200 page, HGX at 1000 W: 2,250 dense
        interconnect_Bps=900e9,  # NVLink5 1.8 TB/s bidirectional (glennklockwood: 2x900 GB/s)
        # pytorch/ao PR #4002 device query: 178.35 visible. FLAG: read as GiB, the unit under
        # which it sits just below nvidia-smi's total, as on H100 and H200.
        visible_memory_bytes=191_501_854_310,
    ),
    "l40s": GpuSpec(
        name="L40S-48GB",
        memory_bytes=48 * GB,  # NVIDIA L40S datasheet table mirrored at mullet.se (ref §2)
        mem_bandwidth_Bps=864e9,  # 864 GB/s, same source
        bf16_dense_flops=362.05e12,  # 362.05 TF dense bf16, same source
        interconnect_Bps=32e9,  # no NVLink: PCIe Gen4 x16, 64 GB/s bidirectional
        visible_memory_bytes=47_663_399_567,  # vLLM log: "total_gpu_memory (44.39GiB)"
    ),
}

GPU_ALIASES: dict[str, str] = {
    "a100": "a100-80gb",
    "a100-sxm4-80gb": "a100-80gb",
    "a100-sxm-80gb": "a100-80gb",
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "h100-sxm5-80gb": "h100-sxm",
    "h200-sxm": "h200",
    "h200-141gb": "h200",
    "h200-sxm-141gb": "h200",
    "b200-180gb": "b200",
    "l40s-48gb": "l40s",
}


def gpu_key(name: str) -> str:
    """The preset key `name` spells (case-insensitive, aliases accepted: "H200-SXM" ->
    "h200"); ValueError if unknown."""
    key = name.strip().lower()
    key = GPU_ALIASES.get(key, key)
    if key not in GPU_PRESETS:
        known = ", ".join(sorted(GPU_PRESETS))
        raise ValueError(f"unknown GPU {name!r}; known GPUs: {known}")
    return key


def resolve_gpu(name: str) -> GpuSpec:
    """The preset for `name` (case-insensitive, aliases accepted); ValueError if unknown."""
    return GPU_PRESETS[gpu_key(name)]
