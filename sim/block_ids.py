"""Block identities of hash-id prompts from the trace's own coordinates, without SHA-256.

A hash-id prompt (Mooncake: 512-token blocks, Bailian: 16) is built by `workloads.tokens`
from pieces: piece i is the first min(H, prompt_len - i*H) tokens of stream `h:<id_i>`
(H = hash_block_size), and a stream's tokens depend only on (seed, key, position) and the
vocabulary. When the KV block size B divides H, KV block j of piece i (tokens
[j*B, (j+1)*B) of the piece, wholly inside it) therefore holds tokens fixed by
(vocab, seed, H, B, id_0..id_i, j), and the tokens of every block before it are fixed by
the same coordinates. The engine's chained block hash (`runtime.block_hash`) covers
exactly that prefix, so these coordinates name the same blocks:

    identity(block) = TAG || run || j      run = intern[(parent run, id_i)]
                                           root run = intern[(vocab, seed, H, B, cache salt)]

Two blocks get one identity iff they hold the same token prefix (up to stream collisions,
which SHA-256's chaining would not tell apart either: 16 equal pseudo-random tokens out of
32,000), so the prefix cache sees the same hits, registrations and evictions as with
SHA-256, a dict lookup per H tokens instead of one SHA-256 per B tokens. Only hash-id
prompts and only blocks inside a piece get one; the blocks after them (a partial last
piece, the request's own tail tokens, its outputs) chain on with SHA-256 from the last
identity (`Request(block_hashes=...)`, `prompt_block_hashes(known=...)`).

**A request's own blocks.** When every request of the trace is a plain prompt (stream
`u:<its id>`) or a hash-id prompt, no stream but the `h:` ones is shared: every block past a
request's named ones holds a token of its own prompt tail or output (`u:`/`o:<its id>`; with
B dividing H the blocks wholly inside `h:` pieces are all named). No other request can hold
an equal block, so those blocks are named `index || OWN_TAG || vocab, seed, B || request id`
(`Request.block_key`, `runtime.block_hash.own_block_names`): equal exactly when the request and
index are, as their hashes would be. A trace with segments (multi-turn prompts quote earlier
outputs) or explicit token ids keeps SHA-256 past the named blocks (`own_blocks=False`).

**One hash block size.** A run's root holds H, so the names are right only when every
hash-id prompt of the simulation has the same H: stream `h:<id>`'s first tokens are the same
under any H, and two prompts that start with one id under different H share their first
min(H) tokens, which SHA-256 would find and these names would not. A trace that mixes them
(none that one file loads: a format has one H) names nothing (`TraceBlockIds.of`).

Every engine and router of one simulation must use one `TraceBlockIds`: the identities are
numbered in the order runs are first seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from runtime.block_hash import BlockHash, own_block_names
from runtime.block_pieces import BlockPieces
from workloads import Trace, TraceRequest

if TYPE_CHECKING:
    from sim.simulator import SimConfig

_TAG = b"rt:trace-block\x00\x00"  # 16 bytes; with run and j: 32, as a SHA-256 digest
_OWN_TAG = b"rt:own-block\x00\x00\x00\x00"  # own names are 8 + 16 + 24 + id bytes: > 32


def one_hash_block_size(trace: Iterable[TraceRequest]) -> bool:
    """Whether the hash-id prompts (if any) all have one hash block size."""
    return len({req.hash_block_size for req in trace if req.hash_ids is not None}) <= 1


def own_streams_only(trace: Iterable[TraceRequest]) -> bool:
    """Whether every request's prompt is a plain or a hash-id prompt (no segments, no
    explicit token ids): the condition for naming requests' own blocks."""
    return all(req.segments is None and req.prompt_token_ids is None for req in trace)


class TraceBlockIds:
    """The identities of hash-id prompts' blocks for one simulation (module docstring)."""

    def __init__(self, own_blocks: bool = False, pieces: bool = True) -> None:
        """`own_blocks`: name requests' own blocks too (only if `own_streams_only` holds
        for every request any engine of the simulation will take); `pieces`: name the
        hash-id pieces' blocks (only if `one_hash_block_size` holds for them); without it
        nothing is named (own names follow the pieces')."""
        self.pieces = pieces
        self.own_blocks = own_blocks and pieces
        self._runs: dict[tuple[object, ...], int] = {}  # (parent run, hash id) or root key
        self._suffixes: list[bytes] = []  # j as 8 bytes, j = 0..H/B - 1
        self._bases: list[bytes] = []  # run -> TAG || run
        # (vocab, seed, B) -> OWN_TAG || their bytes: the own names' prefix
        self._own_prefixes: dict[tuple[int, int, int], bytes] = {}

    @classmethod
    def of(cls, trace: Trace | Sequence[TraceRequest]) -> TraceBlockIds:
        """The names for a simulation of `trace`: its pieces' blocks when its hash-id
        prompts share one hash block size, and its requests' own blocks when, moreover,
        every prompt is plain or hash-id."""
        if not one_hash_block_size(trace):
            return cls(own_blocks=False, pieces=False)
        return cls(own_streams_only(trace))

    def __len__(self) -> int:
        """Runs interned so far (roots included)."""
        return len(self._runs)

    def prompt_ids(self, req: TraceRequest, block_size: int, vocab_size: int,
                   seed: int) -> list[BlockHash]:
        """Identities of the prompt's leading full KV blocks: those inside its hash-id
        pieces, then (with `own_blocks`) every other full prompt block by its own name."""
        named = self.piece_ids(req, block_size, vocab_size, seed)
        key = self.own_key(req, block_size, vocab_size, seed)
        if key is not None:
            named += own_block_names(key, len(named), req.prompt_len // block_size)
        return named

    def own_key(self, req: TraceRequest, block_size: int, vocab_size: int,
                seed: int) -> bytes | None:
        """The request's `Request.block_key` (None: its blocks past the named ones are
        hashed): with `own_blocks`, unless its hash-id pieces are not whole blocks."""
        if not self.own_blocks or (req.hash_block_size or block_size) % block_size:
            return None
        prefix = self._own_prefixes.get((vocab_size, seed, block_size))
        if prefix is None:  # once per simulation: an engine asks ~3 times per request
            coordinates = (v.to_bytes(8, "little") for v in (vocab_size, seed, block_size))
            prefix = _OWN_TAG + b"".join(coordinates)
            self._own_prefixes[(vocab_size, seed, block_size)] = prefix
        return prefix + req.request_id.encode()

    def given_names(self, req: TraceRequest, block_size: int, vocab_size: int, seed: int,
                    known: Sequence[BlockHash] | None = None
                    ) -> tuple[Sequence[BlockHash], bytes | None, BlockPieces | None]:
        """The block names an engine takes as given for `req`, its own-name key (`own_key`)
        and the pieces of the leading names (`block_pieces`). Without a key: `known` (names
        computed earlier) or `prompt_ids`. With one: only the hash-id pieces' names
        (`known` cut to them): the scheduler's hasher makes the own names past them,
        marked own (`Request.own_from`)."""
        key = self.own_key(req, block_size, vocab_size, seed)
        pieces = self.block_pieces(req, block_size, vocab_size, seed)
        if known is None:  # `prompt_ids` without a key
            return self._piece_names(pieces), key, pieces
        if key is None:
            return known, None, pieces
        return known[:0 if pieces is None else pieces.num_blocks], key, pieces

    @staticmethod
    def num_piece_ids(req: TraceRequest, block_size: int) -> int:
        """`len(piece_ids(req, block_size, ...))`, without making them: the full KV blocks
        inside the prompt's hash-id pieces (a block never straddles two: B divides H)."""
        ids, hash_block = req.hash_ids, req.hash_block_size
        if ids is None or hash_block is None or hash_block % block_size:
            return 0
        return min(req.prompt_len, len(ids) * hash_block) // block_size

    def piece_ids(self, req: TraceRequest, block_size: int, vocab_size: int,
                  seed: int) -> list[BlockHash]:
        """Identities of the prompt's leading full KV blocks that lie inside its hash-id
        pieces, in order; [] for a prompt without hash ids or whose hash block is not a
        multiple of `block_size` (the engine then hashes every block)."""
        return self._piece_names(self.block_pieces(req, block_size, vocab_size, seed))

    def _piece_names(self, pieces: BlockPieces | None) -> list[BlockHash]:
        """The names of the blocks in `pieces`: block j of a piece is `base || j`."""
        if pieces is None:
            return []
        self._grow(pieces.per_piece)
        suffixes = self._suffixes[:pieces.per_piece]
        out: list[BlockHash] = []
        for base in pieces.bases:
            out += [base + suffix for suffix in suffixes]
        del out[pieces.num_blocks:]  # the last piece, partial: its whole blocks only
        return out

    def block_pieces(self, req: TraceRequest, block_size: int, vocab_size: int,
                     seed: int) -> BlockPieces | None:
        """The pieces of `piece_ids` (`Request.block_pieces`): block j of a piece is named
        `base || j` (module docstring); None where there is no piece id."""
        ids, hash_block = req.hash_ids, req.hash_block_size
        if ids is None or hash_block is None or hash_block % block_size or not self.pieces:
            return None
        runs = self._runs
        run = self._intern(("root", vocab_size, seed, hash_block, block_size, req.cache_salt))
        bases: list[bytes] = []
        for index, hash_id in enumerate(ids):
            key = (run, hash_id)
            found = runs.get(key)
            run = self._intern(key) if found is None else found
            piece_len = min(hash_block, req.prompt_len - index * hash_block)
            if piece_len >= block_size:
                bases.append(self._bases[run])
            if piece_len < hash_block:  # the last piece, partial: nothing after it
                break
        num_blocks = self.num_piece_ids(req, block_size)
        return BlockPieces(bases, hash_block // block_size, num_blocks) if num_blocks else None

    def given_pieces(self, req: TraceRequest, config: SimConfig) -> BlockPieces | None:
        """`block_pieces` for an engine of `config`: None where it takes no names as given
        (`EngineProcess.known_hashes`: prefix caching or `trace_block_ids` off)."""
        if not (config.trace_block_ids and config.cache.enable_prefix_caching):
            return None
        return self.block_pieces(req, config.cache.block_size, config.vocab_size, config.seed)

    def _intern(self, key: tuple[object, ...]) -> int:
        run = self._runs.setdefault(key, len(self._runs))
        if run == len(self._bases):
            self._bases.append(_TAG + run.to_bytes(8, "little"))
        return run

    def _grow(self, count: int) -> None:
        suffixes = self._suffixes
        while len(suffixes) < count:
            suffixes.append(len(suffixes).to_bytes(8, "little"))
