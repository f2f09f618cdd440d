"""Chained SHA-256 hashes of full KV blocks, the keys of the prefix cache.

    hash_i = SHA-256(hash_{i-1} || len(block_i) || token ids of block i || extra keys of block i)

with hash_{-1} = NONE_HASH. Chaining makes a block's hash identify its whole prefix, so a lookup
can stop at the first miss. Extra keys separate caches that must not share KV: a LoRA adapter
tags every block with ("lora", name, path); a cache salt tags the first block only with
("cache_salt", salt), which chaining propagates. Keys are tagged tuples so that a salt equal to
an adapter name cannot collide with it. Only full blocks are hashed.

The byte layout is rt's own (fixed-width token ids instead of vLLM's pickle), so hashes are
stable across processes and runs but not equal to vLLM's; the sharing structure is the same.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.request import BlockHasher, Request

BlockHash = bytes  # 32 bytes (SHA-256); names a driver gives may differ (`Request.block_key`)

NONE_HASH: BlockHash = hashlib.sha256(b"rt-none-hash").digest()

ExtraKeys = tuple[tuple[str, ...], ...]


def hash_block_tokens(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
) -> BlockHash:
    """Hash one full block given its parent's hash, its tokens and its extra keys."""
    packed = len(token_ids).to_bytes(4, "little") + array("q", token_ids).tobytes()
    return _hash_packed(parent, packed, extra_keys)


def block_extra_keys(
    block_index: int,
    lora_name: str | None,
    lora_path: str | None,
    cache_salt: str | None,
) -> ExtraKeys | None:
    """Extra keys of block `block_index`, in vLLM's order: LoRA, then cache salt."""
    keys: list[tuple[str, ...]] = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_path or ""))
    if cache_salt is not None and block_index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def make_block_hasher(block_size: int) -> BlockHasher:
    """A hasher returning the hashes of a request's full blocks that are not yet hashed.

    Called when a request is added and whenever appended tokens complete a block. The
    tokens of all new blocks are packed once; each block then costs one SHA-256 call.
    """
    length_prefix = block_size.to_bytes(4, "little")
    block_bytes = 8 * block_size
    sha256 = hashlib.sha256

    def new_block_hashes(request: Request) -> list[BlockHash]:
        block_hashes = request.block_hashes
        first = len(block_hashes)
        last = request.num_tokens // block_size  # blocks [first, last) are new
        if last <= first:
            return []
        if request.block_key is not None:  # blocks no other request holds: named
            return own_block_names(request.block_key, first, last)
        data = request.token_ids(first * block_size, last * block_size).tobytes()
        parent = block_hashes[-1] if first else NONE_HASH
        if request.lora_name is None and request.cache_salt is None:  # no extra keys: most
            if last == first + 1:  # one block (a decode completing one): the loop run once
                return [sha256(parent + length_prefix + data).digest()]
            hashes: list[BlockHash] = []
            append = hashes.append
            for offset in range(0, len(data), block_bytes):
                parent = sha256(parent + length_prefix + data[offset : offset + block_bytes]
                                ).digest()
                append(parent)
            return hashes
        hashes = []
        for index in range(first, last):
            offset = (index - first) * block_bytes
            extra = block_extra_keys(index, request.lora_name, request.lora_path,
                                     request.cache_salt)
            parent = _hash_packed(parent, length_prefix + data[offset : offset + block_bytes],
                                  extra)
            hashes.append(parent)
        return hashes

    return new_block_hashes


_INDEX_BYTES: list[bytes] = []  # i.to_bytes(8, "little") at i: own names' prefixes, grown on demand


def _index_bytes(count: int) -> list[bytes]:
    """`_INDEX_BYTES`, at least `count` long (a request's own names share these prefixes:
    one allocation a name instead of two)."""
    table = _INDEX_BYTES
    if len(table) < count:
        table.extend(index.to_bytes(8, "little") for index in range(len(table), count))
    return table


def own_block_name(block_key: bytes, index: int) -> BlockHash:
    """Name of block `index` of a request whose blocks no other request can hold
    (`Request.block_key`): `index` as 8 little-endian bytes, then the key; equal exactly
    when the index is, within the request, as its hash would be (its tokens are fixed)."""
    table = _INDEX_BYTES
    if 0 <= index < len(table):
        return table[index] + block_key
    if index < 0:
        raise ValueError(f"own_block_name: index must be >= 0, got {index}")
    return _index_bytes(index + 1)[index] + block_key


def own_block_names(block_key: bytes, first: int, last: int) -> list[BlockHash]:
    """`own_block_name` of blocks [first, last)."""
    if first < 0 or last < 0:
        raise ValueError(f"own_block_names: first and last must be >= 0, got {first}, {last}")
    # a comprehension, not map(operator.add): compiled, it is a C loop (map was ~5% slower
    # on a whole compiled Azure run; pure, map saves ~25% of the bytecode per name)
    return [prefix + block_key for prefix in _index_bytes(last)[first:last]]


def _hash_packed(parent: BlockHash, packed: bytes, extra_keys: ExtraKeys | None) -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(packed)
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()
