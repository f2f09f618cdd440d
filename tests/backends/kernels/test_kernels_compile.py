"""The kernels compile for the H200 (sm_90) without a GPU: the interpreter accepts code that
the compiler rejects, and it says nothing of registers or pipelining.

A subprocess (without TRITON_INTERPRET, which conftest sets for this process) compiles each
launch configuration the wrapper picks, with the 16-divisibility that Triton's JIT infers for
the real pointers and strides (none for the arguments the kernel does not specialise), runs
the bundled ptxas, and reports registers, spills and whether the K/V loads were pipelined
(cp.async).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# (name, dtype, group, head_dim, block_size, block_m, tile_n, segments, warps, stages)
ATTENTION_CASES = [
    ("decode default", "bf16", 4, 128, 16, 16, 64, 1, 4, 3),
    ("decode split", "bf16", 4, 128, 16, 16, 64, 16, 4, 3),
    ("prefill default", "bf16", 4, 128, 16, 64, 64, 1, 4, 2),
    ("fp32 ieee, head dim 32", "fp32", 2, 32, 8, 64, 64, 1, 4, 2),
    ("fp16 head dim 64", "fp16", 1, 64, 16, 64, 64, 1, 4, 2),
]


def _compile(fn: object, signature: dict[str, str], constants: dict[str, object],
             **options: int) -> dict[str, object]:
    """Compile `fn` for sm_90 and read ptxas' resource report."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    unspecialised = set(getattr(fn, "do_not_specialize", None)
                        or getattr(fn, "kwargs", {}).get("do_not_specialize") or ())
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
               if (name.endswith("_ptr") or name.startswith("stride"))
               and name not in unspecialised}
    kernel = triton.compile(ASTSource(fn, signature, constants, aligned),
                            target=GPUTarget("cuda", 90, 32), options=options)
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        info = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", ptx.name, "-o",
                               os.devnull], capture_output=True, text=True, check=True).stderr
    registers = int(info.split("Used ")[1].split(" registers")[0])
    spills = int(info.split("bytes spill stores")[0].split(",")[-1])
    return {"registers": registers, "spill_bytes": spills,
            "pipelined": "async_copy" in kernel.asm["ttgir"], "shared": kernel.metadata.shared}


def _probe() -> None:
    """Runs in the subprocess: prints one JSON object, case name -> compile report."""
    from backends.kernels import paged_attention as pa
    from backends.kernels import reshape_and_cache as rc

    report = {}
    for name, dtype, group, head_dim, block_size, block_m, tile_n, segs, warps, stages in (
            ATTENTION_CASES):
        strides = ("stride_ot", "stride_oh", "stride_qt", "stride_qh", "stride_cb",
                   "stride_cs", "stride_ch", "stride_bt")
        signature = {
            "out_ptr": f"*{dtype}", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
            "query_ptr": f"*{dtype}", "key_cache_ptr": f"*{dtype}",
            "value_cache_ptr": f"*{dtype}", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
            "query_start_loc_ptr": "*i32", "num_seqs": "i32", "num_q_heads": "i32",
            "scale_log2": "fp32", **dict.fromkeys(strides, "i32")}
        constants = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_SIZE": block_size,
                     "BLOCK_M": block_m, "BLOCK_Q": block_m // group, "TILE_N": tile_n,
                     "NUM_SEGMENTS": segs, "UPCAST": False,
                     "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32"}
        signature.update({key: "constexpr" for key in constants})
        report[name] = _compile(pa._attention_kernel, signature, constants,
                                num_warps=warps, num_stages=stages)
    report["reduce"] = _compile(
        pa._reduce_segments_kernel,
        {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
         "num_q_heads": "i32", "stride_ot": "i32", "stride_oh": "i32",
         "NUM_SEGMENTS": "constexpr", "HEAD_DIM": "constexpr"},
        {"NUM_SEGMENTS": 16, "HEAD_DIM": 128})
    report["reshape_and_cache"] = _compile(
        rc._reshape_and_cache_kernel,
        {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*bf16",
         "value_cache_ptr": "*bf16", "slot_mapping_ptr": "*i64", "stride_kt": "i32",
         "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32",
         "NUM_KV_HEADS": "constexpr", "HEADS_PADDED": "constexpr", "HEAD_DIM": "constexpr"},
        {"NUM_KV_HEADS": 8, "HEADS_PADDED": 8, "HEAD_DIM": 128})
    print(json.dumps(report))


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, object]]:
    import triton

    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import tests.backends.kernels.test_kernels_compile as m; m._probe()"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_every_configuration_compiles_for_sm90(compiled: dict[str, dict[str, object]]) -> None:
    assert set(compiled) == {case[0] for case in ATTENTION_CASES} | {
        "reduce", "reshape_and_cache"}


def test_attention_loads_are_pipelined_without_spills(
    compiled: dict[str, dict[str, object]]
) -> None:
    for name, dtype, *_ in ATTENTION_CASES:
        assert compiled[name]["pipelined"], name
        if dtype != "fp32":  # fp32 serves the CPU tests only; it may spill a little
            assert compiled[name]["spill_bytes"] == 0, (name, compiled[name])
        assert int(compiled[name]["shared"]) <= 228 * 1024  # type: ignore[call-overload]
