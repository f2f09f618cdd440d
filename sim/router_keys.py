"""Keys for a router's prompt blocks from the trace's structure, without hashing tokens.

A prefix-aware router (llm-d's approximate index) cuts the prompt into blocks of B tokens
(B = `PromptBlocking.block_size`, the first `max_blocks` blocks, a partial tail block
included) and chains a hash over them: block k's hash is equal for two prompts exactly when
their tokens [0, end of block k) are (64-bit collisions aside). The index only compares
hashes for equality, so any key with that equality structure routes the same.

When every prompt of the trace is a plain or a hash-id prompt (`sim.block_ids.
own_streams_only`), the trace says which prefixes are equal (`workloads.tokens`: piece i of a
hash-id prompt is the first min(H, prompt_len - i*H) tokens of stream `h:<id_i>`, the tokens
past the pieces and a plain prompt's come from the request's own stream `u:<id>`):

- a block ending inside the hash-id pieces (B divides H, so it lies in one piece i) holds
  the tokens fixed by (ids 0..i, its end in piece i): the key is the interned run of ids
  0..i and the block's place in the piece. A partial tail block ending there is named by
  the run and its token count in the piece: two prompts with the same ids up to it and the
  same length share it, as their hashes would;
- a block holding any token of the request's own stream is the request's alone: the key is
  a number unique to the request (one per `keys` call) and the block's index.

    hash-id block:  2 * (run * S + j)          j < H/B: whole block j of the piece,
                                               j = H/B + t: a tail of t tokens (0 < t < H)
    own block:      2 * (own * (max_blocks + 1) + k) + 1        (S = H/B + H)

Tokens of different streams differ (up to collisions of pseudo-random tokens, which the
engines' block names in `sim.block_ids` assume away too). The keys do not depend on the
vocabulary, seed or cache salt: the router hashes the first replica's token ids, and a salt
changes the engines' block hashes only. One H for every hash-id prompt: pieces of another H
can share tokens across the run structure (a 16-token piece of `h:5` is a prefix of a
512-token one).
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.router import PrefixKeys, PromptBlocking, RouterPolicy
from sim.block_ids import own_streams_only
from workloads import TraceRequest

_ROOT = -1  # the run before a prompt's first piece


class RouterKeys:
    """`PrefixKeys` for the requests of one run, with the module docstring's scheme. Every
    request routed once gets keys from one `RouterKeys` (its own blocks' number is drawn
    per call); the requests' hash-id pieces, when any, are `hash_block_size` tokens."""

    def __init__(self, blocking: PromptBlocking, hash_block_size: int | None) -> None:
        block = blocking.block_size
        if hash_block_size is not None and hash_block_size % block:
            raise ValueError(f"router block_size {block} does not divide hash_block_size "
                             f"{hash_block_size}")
        self.blocking = blocking
        self._hash_block = hash_block_size or block  # H (B when no prompt has hash ids)
        self._per_piece = self._hash_block // block  # whole blocks in a piece
        self._run_stride = self._per_piece + self._hash_block  # S: keys of one run
        self._own_stride = blocking.max_blocks + 1  # block indices 0..max_blocks
        self._runs: dict[tuple[int, int], int] = {}  # (parent run, hash id) -> run
        self._owners = 0  # own-block numbers drawn

    def keys(self, req: TraceRequest) -> PrefixKeys:
        """The prompt's block keys, as many as `prompt_block_hashes` makes hashes."""
        block, max_blocks = self.blocking.block_size, self.blocking.max_blocks
        if req.prompt_len < block:
            return PrefixKeys(self.blocking, [])
        end = min(req.prompt_len, max_blocks * block)  # tokens hashed
        full, tail = divmod(end, block)
        covered = req.hash_covered_len  # tokens in hash-id pieces (0 without)
        named = min(full, covered // block)  # whole blocks ending inside the pieces
        keys = self._piece_keys(req.hash_ids or (), named, end if tail and end <= covered
                                else None)
        own_end = full + (1 if tail and end > covered else 0)  # own blocks: [named, own_end)
        if named < own_end:
            base = 2 * self._owners * self._own_stride + 1
            self._owners += 1
            keys += range(base + 2 * named, base + 2 * own_end, 2)
        return PrefixKeys(self.blocking, keys)

    def _piece_keys(self, ids: Sequence[int], named: int, tail_end: int | None) -> list[int]:
        """Keys of the first `named` whole blocks, all inside hash-id pieces, then of the
        partial tail block if it ends inside them, at token `tail_end`."""
        per_piece, stride = self._per_piece, self._run_stride
        pieces = -(-named // per_piece)
        if tail_end is not None:
            pieces = tail_end // self._hash_block + 1  # the tail's piece (B divides H)
        keys: list[int] = []
        runs = self._runs
        run = _ROOT
        for i in range(pieces):
            step = (run, ids[i])
            found = runs.get(step)
            run = runs.setdefault(step, len(runs)) if found is None else found
            count = min(per_piece, named - i * per_piece)
            if count > 0:
                base = 2 * run * stride
                keys += range(base, base + 2 * count, 2)
        if tail_end is not None:
            in_piece = tail_end - (pieces - 1) * self._hash_block  # 0 < t < H
            keys.append(2 * (run * stride + per_piece + in_piece))
        return keys


def router_keys_for(trace: Sequence[TraceRequest], policies: Sequence[RouterPolicy],
                    trace_block_ids: bool) -> RouterKeys | None:
    """The run's `RouterKeys`, or None (the routers hash token ids, the whole run): None
    unless some policy has a `prompt_blocking`, every such policy the same one, the first
    replica names blocks by the trace (`trace_block_ids`), every prompt is a plain or a
    hash-id one, all hash-id prompts have one hash block size H and the router's block
    size divides it."""
    blockings = {p.prompt_blocking for p in policies} - {None}
    if len(blockings) != 1 or not trace_block_ids or not own_streams_only(trace):
        return None
    (blocking,) = blockings
    assert blocking is not None
    sizes = {req.hash_block_size for req in trace if req.hash_ids}
    if len(sizes) > 1:
        return None
    hash_block = sizes.pop() if sizes else None
    if hash_block is not None and hash_block % blocking.block_size:
        return None
    return RouterKeys(blocking, hash_block)
