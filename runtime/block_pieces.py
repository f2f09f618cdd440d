"""Block names that come in pieces: the prefix-cache map keyed by a piece, not a block.

A driver may know that a request's leading block names come in runs (the simulator's
hash-id prompts, `sim.block_ids`: block j of piece k is named `base_k || j`): `BlockPieces`
gives the runs' bases, so the pool files such a block in its piece's `PieceEntry` at j
(one dict operation per piece instead of one per block, ~0.5-0.8 µs a block on a cold
map). The names themselves stay on the request and on the blocks (KV events, chained
hashes after them).

Contract: two piece names are equal exactly when their (base, j) are, and no piece name
equals a name that is not one; every request of an engine whose given names include
piece names says so with `BlockPieces` (else a lookup of such a name would miss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from runtime.free_block_queue import KVCacheBlock


@dataclass(frozen=True, slots=True)
class BlockPieces:
    """A request's leading `num_blocks` block names, in pieces of `per_piece` blocks:
    block i is block i % per_piece of the piece whose base is `bases[i // per_piece]`
    (the last piece may hold fewer)."""

    bases: list[bytes]  # one per piece, in order (not copied)
    per_piece: int  # blocks per whole piece, > 0
    num_blocks: int  # named blocks in all, within the pieces

    def __post_init__(self) -> None:
        if self.per_piece <= 0:
            raise ValueError(f"BlockPieces: per_piece must be > 0, got {self.per_piece}")
        whole = len(self.bases) * self.per_piece
        if not max(whole - self.per_piece + 1, 0) <= self.num_blocks <= whole:
            raise ValueError(f"BlockPieces: {self.num_blocks} blocks do not fill "
                             f"{len(self.bases)} pieces of {self.per_piece}")


def within_given(pieces: BlockPieces | None, num_given: int) -> BlockPieces | None:
    """`pieces`, or ValueError when they name more blocks than the `num_given` given names."""
    if pieces is not None and pieces.num_blocks > num_given:
        raise ValueError(f"{pieces.num_blocks} piece names, {num_given} given")
    return pieces


class PieceEntry:
    """The cached blocks of one piece: `blocks[j]` is the block a lookup of name j hits
    (the first registered still cached, later ones wait in the pool's duplicates map) or
    None; `held` counts the slots not None (the entry leaves the map at 0)."""

    __slots__ = ("base", "blocks", "held")

    def __init__(self, base: bytes, per_piece: int) -> None:
        self.base = base
        self.blocks: list[KVCacheBlock | None] = [None] * per_piece
        self.held = 0

    def __repr__(self) -> str:
        return f"PieceEntry({self.base!r}, held={self.held})"


def register_pieces(entries: dict[bytes, PieceEntry],
                    duplicates: dict[bytes, dict[int, KVCacheBlock]],
                    blocks: Sequence[KVCacheBlock], names: Sequence[bytes],
                    pieces: BlockPieces, first: int, null_block: KVCacheBlock,
                    fresh: bool = False) -> None:
    """Register `blocks` (at table positions `first..`, all < `pieces.num_blocks`) under
    `names`, in order, as `BlockPool.cache_blocks` would: one entry lookup per piece, each
    block at its j, or, where j holds a block already, in `duplicates` (the pool's map of
    later registrations under a name). Blocks already cached and the null block are
    skipped. `fresh`: the caller vouches that none is (blocks just popped, uncached)."""
    per_piece = pieces.per_piece
    done = 0
    while done < len(blocks):
        index, j = divmod(first + done, per_piece)
        base = pieces.bases[index]
        entry = entries.get(base)
        if entry is None:
            entry = entries[base] = PieceEntry(base, per_piece)
        slots = entry.blocks
        if len(slots) != per_piece:
            raise ValueError(f"piece {base!r} of {len(slots)} blocks given as {per_piece}")
        stop = min(len(blocks), done + per_piece - j)
        if fresh and not entry.held:  # a new entry: no test per block
            _fill_empty(entry, blocks[done:stop], names[done:stop], j)
            done = stop
            continue
        for block, name in zip(blocks[done:stop], names[done:stop], strict=True):
            if block.block_hash is None and block is not null_block:
                block.block_hash = name
                block.piece = entry
                block.j = j
                if slots[j] is None:
                    slots[j] = block
                    entry.held += 1
                else:
                    duplicates.setdefault(name, {})[block.block_id] = block
            j += 1
        if not entry.held:  # every block was cached already (never in practice)
            del entries[base]
        done = stop


def _fill_empty(entry: PieceEntry, blocks: Sequence[KVCacheBlock], names: Sequence[bytes],
                j: int) -> None:
    """`register_pieces`' loop for uncached blocks into an entry that holds none (all its
    slots empty): every block takes its slot, from slot j on."""
    stop = j + len(blocks)
    entry.blocks[j:stop] = blocks
    entry.held = len(blocks)
    for block, name, slot in zip(blocks, names, range(j, stop), strict=True):
        block.block_hash = name
        block.piece = entry
        block.j = slot


def piece_hits(entries: dict[bytes, PieceEntry], pieces: BlockPieces,
               stop: int) -> list[KVCacheBlock]:
    """The blocks a lookup of a request's first `stop` piece names hits, up to the first
    miss: piece by piece, one entry lookup each."""
    hits: list[KVCacheBlock] = []
    per_piece = pieces.per_piece
    lookup = entries.get
    for base in pieces.bases:
        if stop <= 0:
            break
        entry = lookup(base)
        if entry is None:
            break
        slots = entry.blocks[:stop] if stop < per_piece else entry.blocks
        if None in slots:  # a miss inside the piece
            hits += cast("list[KVCacheBlock]", slots[:slots.index(None)])
            break
        hits += cast("list[KVCacheBlock]", slots)
        stop -= per_piece
    return hits
