"""Keys for a router's prompt blocks from the trace's structure, without hashing tokens.

A prefix-aware router (llm-d's approximate index) cuts the prompt into blocks of B tokens
(B = `PromptBlocking.block_size`, the first `max_blocks` blocks, a partial tail block
included) and chains a hash over them: block k's hash is equal for two prompts exactly when
their tokens [0, end of block k) are (64-bit collisions aside). The index only compares
hashes for equality, so any key with that equality structure routes the same.

When every prompt of the trace is a plain or a hash-id prompt (`sim.block_ids.
own_streams_only`), the trace says which prefixes are equal (`workloads.tokens`: piece i of a
hash-id prompt is the first min(H, prompt_len - i*H) tokens of stream `h:<id_i>`, the tokens
past the pieces and a plain prompt's come from the request's own stream `u:<id>`). Two
prompts' tokens can only part where a stream starts (a piece's start, the end of the pieces,
token 0), all multiples of B when B divides H, so:

- a whole block inside the hash-id pieces (in one piece i) holds the tokens fixed by (ids
  0..i, its place j in piece i): keyed by the interned run of ids 0..i and j;
- a partial tail block ending inside piece i but not starting it holds tokens fixed by the
  run and its end t in the piece: keyed by both (equal ids and equal lengths share it);
- any other whole block holds a token of the request's own stream after the parting point,
  and so does a tail whose parent (the block before it) does: keyed by the request's own
  number (interned by request id) and the block's index;
- a tail starting where a stream starts (a piece's start, the end of the pieces) is the
  first t < B tokens of that stream after a prefix others may share: keyed by its parent's
  key and its token ids, interned, exactly as the hash compares them.

    hash-id block:  3 * (run * S + j)                   j < H/B, or H/B + t for a tail (S = H/B + H)
    own block:      3 * (own * (max_blocks + 1) + k) + 1
    fresh tail:     3 * intern[(parent key, tail tokens)] + 2

The whole blocks are then equal as their hashes are up to B pseudo-random tokens of
different streams agreeing, which `router_keys_for` requires to be no likelier than a
64-bit hash collision ((vocab - 10)^B >= 2^64; `sim.block_ids` assumes the same of the
engines' blocks). The keys do not depend on the cache salt (it changes the engines' block
hashes only, not the tokens the router hashes), and need one H for every hash-id prompt
(pieces of another H can share tokens across the run structure: a 16-token piece of `h:5`
is a prefix of a 512-token one).
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.router import PrefixKeys, PromptBlocking, RouterPolicy
from sim.block_ids import own_streams_only
from sim.simulator import SimConfig
from workloads import RESERVED_TOKEN_IDS, TraceRequest, stream_token_ids
from workloads.tokens import HASH_BLOCK_PREFIX

_ROOT = -1  # the run before a prompt's first piece


class RouterKeys:
    """`PrefixKeys` for the requests of one run, with the module docstring's scheme: every
    request of the run gets its keys from one `RouterKeys` (asked again, the same keys);
    the requests' hash-id pieces, when any, are `hash_block_size` tokens (ValueError
    otherwise), and the token ids are those of (`vocab_size`, `seed`)."""

    def __init__(self, blocking: PromptBlocking, hash_block_size: int | None,
                 vocab_size: int, seed: int) -> None:
        block = blocking.block_size
        if hash_block_size is not None and hash_block_size % block:
            raise ValueError(f"router block_size {block} does not divide hash_block_size "
                             f"{hash_block_size}")
        self.blocking = blocking
        self.vocab_size, self.seed = vocab_size, seed
        self._hash_block = hash_block_size or block  # H (B when no prompt has hash ids)
        self._per_piece = self._hash_block // block  # whole blocks in a piece
        self._run_stride = self._per_piece + self._hash_block  # S: keys of one run
        self._own_stride = blocking.max_blocks + 1  # block indices 0..max_blocks
        self._runs: dict[tuple[int, int], int] = {}  # (parent run, hash id) -> run
        self._tails: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent, tokens) -> n
        self._owners: dict[str, int] = {}  # request id -> its own-block number

    def keys(self, req: TraceRequest) -> PrefixKeys:
        """The prompt's block keys, as many as `prompt_block_hashes` makes hashes."""
        block, max_blocks = self.blocking.block_size, self.blocking.max_blocks
        if req.prompt_len < block:
            return PrefixKeys(self.blocking, [])
        if req.hash_ids is not None and req.hash_block_size != self._hash_block:
            raise ValueError(f"request {req.request_id!r} has hash_block_size "
                             f"{req.hash_block_size}, these keys {self._hash_block}")
        end = min(req.prompt_len, max_blocks * block)  # tokens hashed
        full, tail = divmod(end, block)
        covered = req.hash_covered_len  # tokens in hash-id pieces (0 without)
        named = min(full, covered // block)  # whole blocks inside the pieces
        start = full * block  # the tail's first token (if any tail)
        # the pieces the keys read: those of the named blocks, and the tail's if inside one
        read = end if tail and start < covered else named * block
        ids = req.hash_ids or ()
        keys, run = self._piece_keys(ids, -(-read // self._hash_block), named)
        if named < full:  # whole blocks of the request's own
            keys += self._own_keys(req.request_id, named, full)
        if not tail:
            return PrefixKeys(self.blocking, keys)
        if start < covered and start % self._hash_block:  # inside its piece: run and end
            in_piece = end - (start // self._hash_block) * self._hash_block
            keys.append(3 * (run * self._run_stride + self._per_piece + in_piece))
        elif named < full:  # after own blocks: its own
            keys.append(keys[-1] + 3)  # own block index `full` (the own keys step by 3)
        else:  # a stream's first tokens after a shared prefix
            stream = (f"{HASH_BLOCK_PREFIX}{ids[start // self._hash_block]}"
                      if start < covered else req.unique_key)
            keys.append(self._fresh_tail_key(keys[-1], stream, end - start))
        return PrefixKeys(self.blocking, keys)

    def _piece_keys(self, ids: Sequence[int], pieces: int, named: int) -> tuple[list[int], int]:
        """Keys of the first `named` whole blocks (inside the first `pieces` hash-id
        pieces), and the run of the last of those pieces (`_ROOT` if none)."""
        per_piece, stride = self._per_piece, self._run_stride
        keys: list[int] = []
        runs = self._runs
        run = _ROOT
        for i in range(pieces):
            step = (run, ids[i])
            found = runs.get(step)
            run = runs.setdefault(step, len(runs)) if found is None else found
            count = min(per_piece, named - i * per_piece)
            if count > 0:
                base = 3 * run * stride
                keys += range(base, base + 3 * count, 3)
        return keys, run

    def _own_keys(self, request_id: str, first: int, end: int) -> range:
        """Keys of the request's own blocks `first`..`end - 1`."""
        owners = self._owners
        owner = owners.setdefault(request_id, len(owners))
        base = 3 * owner * self._own_stride + 1
        return range(base + 3 * first, base + 3 * end, 3)

    def _fresh_tail_key(self, parent: int, stream: str, length: int) -> int:
        """The key of a tail that is the first `length` tokens of `stream` after the block
        keyed `parent`: equal exactly when the parent and the tokens are."""
        tokens = tuple(stream_token_ids(stream, length, self.vocab_size, self.seed))
        tails = self._tails
        return 3 * tails.setdefault((parent, tokens), len(tails)) + 2


def router_keys_for(trace: Sequence[TraceRequest], policies: Sequence[RouterPolicy],
                    first: SimConfig) -> RouterKeys | None:
    """The run's `RouterKeys`, or None (the routers hash token ids, the whole run). None
    unless: some policy has a `prompt_blocking`, every such policy the same one; the first
    replica (whose token ids the routers read) has `trace_block_ids` on (the keys do not
    depend on the engines' names: the flag is the one switch that turns both off) and its
    vocabulary makes a chance repeat of a block's B tokens no
    likelier than a 64-bit hash collision; every prompt is a plain or a hash-id one; all
    hash-id prompts have one hash block size H, which the router's block size divides."""
    blockings = {p.prompt_blocking for p in policies} - {None}
    if len(blockings) != 1 or not first.trace_block_ids or not own_streams_only(trace):
        return None
    (blocking,) = blockings
    assert blocking is not None
    if (first.vocab_size - RESERVED_TOKEN_IDS) ** blocking.block_size < 1 << 64:
        return None
    sizes = {req.hash_block_size for req in trace if req.hash_ids}
    if len(sizes) > 1:
        return None
    hash_block = sizes.pop() if sizes else None
    if hash_block is not None and hash_block % blocking.block_size:
        return None
    return RouterKeys(blocking, hash_block, first.vocab_size, first.seed)
