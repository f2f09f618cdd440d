"""An engine that cannot start: its process exits, and `rt serve` says why in one line and
exits 2. Before, the engine process hung in ZeroMQ's `context.term()` (its inbox still open,
SIGTERM ignored), so the server waited for it at exit, after uvicorn's traceback, and a
supervisor's kill left it orphaned. Every wait here is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.serve.engine_client import EngineClient
from tests.backends.serve.test_serve import _free_port

ROOT = Path(__file__).resolve().parents[3]
NO_CUDA = "--device cuda: no CUDA device is available"


def _failing_factory() -> None:
    """An executor factory that fails as the real engine's does on a machine without CUDA."""
    raise ValueError(NO_CUDA)


def _hanging_factory() -> None:
    """An executor factory that never returns (an engine stuck loading)."""
    time.sleep(3600)


_EXIT_WITHOUT_SHUTDOWN = """
import asyncio
from backends.serve.engine_client import EngineClient
from tests.backends.serve.test_engine_start import _hanging_factory

async def main():
    client = EngineClient()
    try:
        await client.start(_hanging_factory, {}, 1.0)
    except RuntimeError:
        print(client.process.pid, flush=True)  # then exit, never calling shutdown

asyncio.run(main())
"""


def test_an_exit_that_skips_shutdown_kills_the_engine_and_does_not_hang() -> None:
    """review23: multiprocessing's exit hook SIGTERMs daemon children and joins them with no
    timeout; the engine ignores SIGTERM, so a server leaving by a path that skipped
    `EngineClient.shutdown` hung at exit. Before the fix this ran into its 60 s timeout."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_SHUTDOWN], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=60, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    engine_pid = int(proc.stdout.split()[-1])
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)


def test_an_engine_that_fails_to_start_reports_why_and_exits() -> None:
    async def start() -> tuple[str, int | None]:
        client = EngineClient()
        try:
            with pytest.raises(RuntimeError) as err:
                await client.start(_failing_factory, {}, 60.0)
            assert client.process is not None
            client.process.join(20)  # it sent "failed": it must be on its way out
            return str(err.value), client.process.exitcode
        finally:
            await client.shutdown()

    message, exitcode = asyncio.run(start())
    assert message == f"the engine failed to start: ValueError: {NO_CUDA}"
    assert exitcode == 1


def test_rt_serve_on_an_engine_that_cannot_start_is_one_line_and_exit_2() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: --device cuda starts")
    returncode, output = _rt_serve_exit(["--device", "cuda"], 120.0)
    assert returncode == 2, output
    assert output.splitlines()[-1] == \
        f"rt: error: the engine failed to start: ValueError: {NO_CUDA}", output
    assert "Traceback" not in output


def _rt_serve_exit(args: list[str], timeout_s: float) -> tuple[int, str]:
    """`rt serve ARGS --port P`'s exit code and output (stdout and stderr), once it exited
    within `timeout_s`; asserts that no process of its group (its engine) outlived it by
    10 s. Its group is SIGKILLed after, whatever happened."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", *args, "--port", str(_free_port())],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        left = _group_lingers(proc.pid, 10.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert not left, f"a process of rt serve's group outlived it: {output}"
    return proc.returncode, output


def _group_lingers(pgid: int, timeout_s: float) -> bool:
    """Whether a process of group `pgid` is still alive `timeout_s` after the leader exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    return True


def test_rt_serve_on_a_tokenizer_it_cannot_load_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """The engine starts (--simulate reads only config.json), then the API server's own
    tokenizer load fails: a ValueError, not the engine's RuntimeError. Before, that escaped
    the lifespan as uvicorn's traceback, the engine was never stopped, and the server hung at
    exit joining it (multiprocessing's exit hook sends SIGTERM, which the engine ignores)."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(_LLAMA_CONFIG))
    (tmp_path / "tokenizer.json").write_text("{")
    returncode, output = _rt_serve_exit(["--simulate", "--model", str(tmp_path)], 60.0)
    assert returncode == 2, output
    assert output.splitlines()[-1].startswith(
        f"rt: error: --model {tmp_path}: cannot load its tokenizer: "), output
    assert "Traceback" not in output


# A small Llama's config.json: all `rt serve --simulate --model DIR` reads of DIR.
_LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                 "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
                 "max_position_embeddings": 2048, "torch_dtype": "bfloat16",
                 "rms_norm_eps": 1e-5}
