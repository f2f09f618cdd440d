"""The bulk paths for decode steps make exactly the decisions of the one-by-one paths:
`Scheduler._schedule_decodes` vs the general running loop, and the cycle-skipping
free-block limit of a decode run vs walking every step."""

from __future__ import annotations

import random

import pytest

import runtime.scheduler
from runtime import Scheduler
from runtime.decode_run import _steps_with_free_blocks
from runtime.native import is_compiled
from tests.runtime.helpers import make_request, make_scheduler, step


def _steps_with_free_blocks_walked(s: Scheduler, limit: int) -> int:
    """The definition: walk the steps, taking each step's new blocks."""
    block_size, free, used = s.block_size, s.kv_cache_manager.block_pool.num_free_blocks, 0
    for k in range(limit):
        need = sum(1 for r in s.running if r.num_computed_tokens % block_size == -k % block_size)
        if used + need > free:
            return k
        used += need
    return limit


def _decoding_scheduler(seed: int, num_blocks: int) -> Scheduler:
    rng = random.Random(seed)
    s = make_scheduler(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=256,
                       max_num_seqs=16, max_model_len=256)
    for i in range(rng.randint(1, 8)):
        s.add_request(make_request(f"r{i}", rng.randint(1, 30), rng.randint(2, 100)))
    for _ in range(rng.randint(1, 12)):
        step(s)
    return s


@pytest.mark.parametrize("seed", range(40))
def test_free_block_limit_equals_walking_every_step(seed: int) -> None:
    s = _decoding_scheduler(seed, num_blocks=random.Random(seed).choice([40, 80, 400]))
    if not s.running:
        return
    for limit in (-1, 0, 1, 3, 4, 5, 17, 64, 300):
        assert _steps_with_free_blocks(s, limit) == _steps_with_free_blocks_walked(s, limit)


@pytest.mark.skipif(is_compiled(runtime.scheduler),
                    reason="a compiled Scheduler's methods cannot be replaced on an instance")
@pytest.mark.parametrize("seed", range(40))
def test_bulk_decode_step_equals_the_general_loop(seed: int) -> None:
    """Two identical schedulers step on; in one the bulk path is disabled. Outputs, block
    tables, the free queue and the prefix-cache map stay identical."""
    num_blocks = random.Random(seed).choice([12, 20, 60])
    bulk, general = _decoding_scheduler(seed, num_blocks), _decoding_scheduler(seed, num_blocks)
    general._schedule_decodes = lambda step, start=0: False  # type: ignore[method-assign]
    for _ in range(40):
        a, b = step(bulk), step(general)
        assert a.output == b.output
        assert a.sampled == b.sampled and a.finished == b.finished
        for s in (bulk, general):
            s.release(list(s.requests))
        kv_a, kv_b = bulk.kv_cache_manager, general.kv_cache_manager
        assert {k: [x.block_id for x in t] for k, t in kv_a.req_to_blocks.items()} == \
            {k: [x.block_id for x in t] for k, t in kv_b.req_to_blocks.items()}
        assert kv_a.block_pool.free_block_ids() == kv_b.block_pool.free_block_ids()
        assert kv_a.block_pool.cached_block_ids() == kv_b.block_pool.cached_block_ids()
        if not bulk.has_unfinished_requests():
            break
