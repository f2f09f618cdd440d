"""Blocks under piece names (`Request.block_pieces`) are filed per piece (`PieceEntry`), not
per name in the hash map: the block ids, free-queue order, hits, evictions and KV events
are those of the same names given without pieces (registered in the map: the reference)."""

from __future__ import annotations

import random

import pytest

from runtime import CacheConfig, KVCacheManager, Request, SamplingParams, Scheduler
from runtime.block_hash import make_block_hasher
from runtime.block_pieces import BlockPieces
from runtime.kv_events import observe_kv_events
from tests.runtime.helpers import make_request, make_scheduler, steps_of

PER_PIECE = 2  # blocks of 4 tokens per piece


def base(path: tuple[int, ...]) -> bytes:
    """A piece's base, fixed by the piece ids up to it (as `sim.block_ids` chains runs)."""
    return b"piece:" + repr(path).encode() + b"|"


def pieced(req_id: str, length: int, max_tokens: int, path: tuple[int, ...],
           with_pieces: bool) -> Request:
    """A request whose leading blocks lie in the pieces `path` (names `base || j`), given
    with their pieces or as plain names (the reference)."""
    num_blocks = min(length // 4, len(path) * PER_PIECE)
    bases = [base(path[:k + 1]) for k in range(-(-num_blocks // PER_PIECE))]
    names = [b + bytes([j]) for b in bases for j in range(PER_PIECE)][:num_blocks]
    pieces = BlockPieces(bases, PER_PIECE, num_blocks) if with_pieces and bases else None
    return make_request(req_id, length, max_tokens, block_hashes=names, block_pieces=pieces)


def _manager(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=4, num_blocks=num_blocks), max_model_len=64,
                          watermark=0.0)


def _admit(kv: KVCacheManager, request: Request, lookup: bool = True) -> list[int]:
    request.set_block_hasher(make_block_hasher(4), 4)
    hits, num_hit = kv.get_computed_blocks(request) if lookup else ([], 0)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return kv.get_block_ids(request.request_id)


def _finish(kv: KVCacheManager, request: Request) -> None:
    request.status = request.status.FINISHED_LENGTH_CAPPED
    kv.free(request)


def _hit_ids(kv: KVCacheManager, request: Request) -> list[int]:
    return [block.block_id for block in kv.get_computed_blocks(request)[0]]


@pytest.mark.parametrize("with_pieces", [True, False])
def test_a_partial_eviction_gives_a_hit_ending_inside_a_piece(with_pieces: bool) -> None:
    kv = _manager(10)
    a = pieced("A", 17, 1, (7, 8), with_pieces)
    assert _admit(kv, a) == [1, 2, 3, 4, 5]
    _finish(kv, a)  # freed tail first: block 4 (piece 2, j = 1) is evicted first
    assert kv.block_pool.free_block_ids() == [5, 6, 7, 8, 9, 4, 3, 2, 1]
    assert [b.block_id for b in kv.block_pool.get_new_blocks(6)] == [5, 6, 7, 8, 9, 4]
    b = pieced("B", 17, 1, (7, 8), with_pieces)
    b.set_block_hasher(make_block_hasher(4), 4)
    assert _hit_ids(kv, b) == [1, 2, 3]  # piece 1 whole, piece 2 up to its j = 0
    assert _hit_ids(kv, pieced("C", 17, 1, (7, 9), with_pieces)) == [1, 2]
    kv.block_pool.check_invariants()
    if with_pieces:  # piece 2's entry holds its j = 0 only
        assert [blk is None for blk in kv.block_pool._pieces[base((7, 8))].blocks] == [
            False, True]


@pytest.mark.parametrize("with_pieces", [True, False])
def test_a_duplicate_registration_hits_the_first_then_the_next(with_pieces: bool) -> None:
    kv = _manager(17)
    pool = kv.block_pool
    a, b, e = (pieced(r, 17, 1, (7, 8), with_pieces) for r in "ABE")
    assert _admit(kv, a) == [1, 2, 3, 4, 5]
    assert _admit(kv, b, lookup=False) == [6, 7, 8, 9, 10]  # the same names again
    assert _admit(kv, e, lookup=False) == [11, 12, 13, 14, 15]  # and again
    names = a.block_hashes
    assert [pool.cached_block_ids()[name] for name in names[:4]] == [
        [1, 6, 11], [2, 7, 12], [3, 8, 13], [4, 9, 14]]
    assert _hit_ids(kv, pieced("C", 17, 1, (7, 8), with_pieces)) == [1, 2, 3, 4]
    _finish(kv, a)
    assert [b.block_id for b in pool.get_new_blocks(4)] == [5, 16, 4, 3]  # piece 2 of A
    assert _hit_ids(kv, pieced("D", 17, 1, (7, 8), with_pieces)) == [1, 2, 8, 9]
    assert pool.get_cached_block(names[2]) is pool.blocks[8]
    pool.check_invariants()


@pytest.mark.parametrize("with_pieces", [True, False])
def test_reset_prefix_cache_forgets_pieces(with_pieces: bool) -> None:
    kv = _manager(10)
    a = pieced("A", 17, 1, (7, 8), with_pieces)
    _admit(kv, a)
    _finish(kv, a)
    assert len(kv.block_pool.cached_block_ids()) == 4  # the 4 piece names
    assert kv.reset_prefix_cache()
    assert kv.block_pool.cached_block_ids() == {} and kv.block_pool._pieces == {}
    assert all(b.piece is None and b.block_hash is None for b in kv.block_pool.blocks)
    assert _hit_ids(kv, pieced("B", 17, 1, (7, 8), with_pieces)) == []
    assert _admit(kv, pieced("C", 17, 1, (7, 8), with_pieces)) == [5, 6, 7, 8, 9]
    assert _hit_ids(kv, pieced("D", 17, 1, (7, 8), with_pieces)) == [5, 6, 7, 8]
    kv.block_pool.check_invariants()


def test_pieces_must_cover_their_blocks() -> None:
    with pytest.raises(ValueError, match="do not fill"):
        BlockPieces([b"x", b"y"], 2, 2)  # the second piece holds none
    with pytest.raises(ValueError, match="do not fill"):
        BlockPieces([b"x"], 2, 3)
    with pytest.raises(ValueError, match="per_piece"):
        BlockPieces([b"x"], 0, 0)
    with pytest.raises(ValueError, match="piece names"):
        Request("r", [1] * 8, SamplingParams(max_tokens=1), block_hashes=[b"x0"],
                block_pieces=BlockPieces([b"x"], 2, 2))
    pool = _manager(10).block_pool
    pool.extend_table([], 2, 0, [b"x0", b"x1"], None, BlockPieces([b"x"], 2, 2))
    with pytest.raises(ValueError, match="given as 3"):  # one base, one piece length
        pool.extend_table([], 1, 0, [b"x0"], None, BlockPieces([b"x"], 3, 1))


def _run(seed: int, with_pieces: bool, observed: bool = True) -> list[object]:
    """A random workload over a small tree of pieces (shared prefixes, partial pieces,
    preemptions): every step's admissions with their hits, preemptions, free queue and
    tables, and the KV events (`observed`; unobserved, the pool pops and registers new
    blocks in one walk, pieces new to the map in one fill)."""
    rng = random.Random(seed)
    s: Scheduler = make_scheduler(num_blocks=rng.choice([12, 20, 40]), max_num_seqs=4,
                                  max_num_batched_tokens=rng.choice([8, 16, 64]),
                                  policy=rng.choice(["fcfs", "priority"]))
    events = observe_kv_events(s.kv_cache_manager.block_pool) if observed else None
    pending = []
    for i in range(rng.randint(10, 30)):
        path = tuple(rng.randint(0, 1) for _ in range(rng.randint(0, 3)))
        request = pieced(f"r{i}", rng.randint(1, 30), rng.randint(1, 12), path, with_pieces)
        request.priority = rng.randint(0, 2)
        pending.append((rng.randint(0, 20), request))
    trail: list[object] = []
    for st in steps_of(s, pending):
        s.kv_cache_manager.check_invariants()
        trail.append((st.new, st.output.preempted_req_ids, st.free,
                      [s.get_block_ids(r.request_id) for r in s.running],
                      events.take() if events is not None else []))
    return trail


@pytest.mark.parametrize("seed", range(16))
def test_pieces_give_the_block_ids_and_events_of_names_in_the_map(seed: int) -> None:
    assert _run(seed, with_pieces=True) == _run(seed, with_pieces=False)


@pytest.mark.parametrize("seed", range(16))
def test_unobserved_pieces_give_the_block_ids_of_names_in_the_map(seed: int) -> None:
    """The same without KV events: new blocks popped and registered in one walk, a piece new
    to the map filled at once (`block_pieces._fill_empty`), equal to the map's per name."""
    assert (_run(seed, with_pieces=True, observed=False)
            == _run(seed, with_pieces=False, observed=False))


@pytest.mark.parametrize("first", [0, 1, 3])
def test_a_fresh_fill_equals_the_checked_fill_from_any_slot(first: int) -> None:
    """`register_pieces(fresh=True)` (blocks just popped) files each block at its slot j, j
    counted from the table position `first` (inside a piece when first % per_piece != 0),
    exactly as the checked loop does."""
    from runtime.block_pieces import register_pieces
    from runtime.free_block_queue import KVCacheBlock

    pieces = BlockPieces([base((0,)), base((0, 1)), base((0, 1, 2))], 2, 6)
    names = [b + bytes([j]) for b in pieces.bases for j in range(2)]
    filed = []
    for fresh in (True, False):
        entries: dict = {}
        blocks = [KVCacheBlock(i) for i in range(10, 10 + 6 - first)]
        register_pieces(entries, {}, blocks, names[first:], pieces, first, KVCacheBlock(0),
                        fresh=fresh)
        filed.append(({b: ([None if s is None else s.block_id for s in e.blocks], e.held)
                       for b, e in entries.items()},
                      [(blk.block_hash, blk.j, blk.piece.base) for blk in blocks]))
    assert filed[0] == filed[1]
    slots, tagged = filed[0]
    assert tagged[0] == (names[first], first % 2, pieces.bases[first // 2])
    assert slots[pieces.bases[first // 2]] == (
        [None, 10] if first % 2 else [10, 11], 1 if first % 2 else 2)
