"""`build_engine` compiles the Triton kernels' variants once per process, before any step, on
scratch tensors (the engine's KV cache stays zero), and says so in run.json; with the torch
ops it does nothing. Without CUDA the Triton path runs under TRITON_INTERPRET=1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.engine import attention
from backends.engine.setup import RealEngineArgs, RealSetup, build_engine, max_kv_len
from backends.engine.tiny_model import build_tiny_llama
from runtime import CacheConfig

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if no engine had warmed the kernels in this process yet."""
    monkeypatch.setattr(attention, "_WARMED", set())


def _build(tiny_dir: Path, use_triton: bool) -> RealSetup:
    # 64 blocks of 16 tokens: a table spans at most 1024 keys (max_model_len is 2048).
    return build_engine(RealEngineArgs(model_dir=tiny_dir, device=DEVICE, dtype="float32",
                                       use_triton=use_triton, num_gpu_blocks_override=64))


def test_triton_engine_warms_every_variant_once(tiny_dir: Path, fresh_process: None) -> None:
    setup = _build(tiny_dir, use_triton=True)
    warmup = setup.describe()["kernel_warmup"]
    # Tiny Llama: 4 query heads on 2 KV heads (group 2), head_dim 32. Prefill 64x64; decode
    # 16x64 with 1, 2, 4 segments: 1024 keys // 256 = 4 caps the 132-SM device's wish.
    assert warmup["variants"] == ["64x64/1", "16x64/1", "16x64/2", "16x64/4"]
    assert warmup["already_warm"] is False
    assert isinstance(warmup["seconds"], float)
    cache = setup.runner.kv_cache
    assert not any(t.any() for t in cache.key_caches + cache.value_caches)  # still zero

    again = _build(tiny_dir, use_triton=True).describe()["kernel_warmup"]
    assert again == {"seconds": 0.0, "variants": [], "already_warm": True}


def test_torch_engine_has_nothing_to_warm(tiny_dir: Path, fresh_process: None) -> None:
    setup = _build(tiny_dir, use_triton=False)
    assert setup.attention == "torch"
    assert "kernel_warmup" not in setup.describe()
    assert attention._WARMED == set()


@pytest.mark.parametrize("max_model_len,num_blocks,expected", [
    (2048, 64, 1024),  # the pool holds fewer blocks than a sequence could
    (2048, 1000, 2048),
    (2049, 1000, 2064),  # a partial last block counts whole
])
def test_max_kv_len(max_model_len: int, num_blocks: int, expected: int) -> None:
    cache = CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=True)
    assert max_kv_len(max_model_len, cache) == expected
