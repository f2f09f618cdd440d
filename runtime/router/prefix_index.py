"""Prefix indexes a router keeps: approximate ones it fills from its own decisions, and a
precise one fed by the engines' KV events.

- `BlockLRUIndex`: llm-d's approximate prefix index (llm-d-inference-scheduler
  `requestcontrol/dataproducer/approximateprefix/{hashing,indexer,plugin}.go`): the prompt is
  cut into blocks of `block_size` tokens (llm-d cuts characters, 4 per token), hashes are
  chained and the partial tail block is hashed too; each replica has an LRU of hashes
  (capacity: its KV pool in blocks under autoTune, else 31,250) and a reverse map hash ->
  replicas. Matching counts, block by block from the first, every replica holding the block,
  and stops at the first block no replica holds.
- `PageTrie`: a trie over pages of tokens whose nodes record which replicas ("tenants") hold
  them and when they last did: SGLang router's approximate radix tree (`sgl-router/src/
  policies/tree.rs`; characters there, tokens here, pages of `page_size`) with its LRU-leaf
  eviction by tenant size, and production-stack's `HashTrie` (`src/vllm_router/prefix/
  hashtrie.py`; 128-character chunks there, no eviction).
- `PreciseIndex`: the blocks each engine reported as cached through KV events (llm-d's
  precise-prefix-cache scorer, Dynamo's KV indexer, LMCache's lookup in production-stack's
  kv-aware router); overlap = leading blocks of the request present on the replica.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from runtime.block_hash import BlockHash
from runtime.router.state import KvEvent

RouterHash = int  # 64-bit, from blake2b (or a driver's `PrefixKeys`); unrelated to the engine's
_BIG_ENDIAN = array("H", [1]).tobytes() == b"\x00\x01"  # this machine's array byte order


def prompt_block_hashes(
    token_ids: Sequence[int] | None, block_size: int, max_blocks: int
) -> list[RouterHash]:
    """llm-d's `hashPrompt` over tokens: chained hashes of `block_size`-token blocks of the
    first `max_blocks * block_size` tokens, the partial tail block included; [] when the
    prompt is unknown or shorter than one block. Hash i is the first 8 bytes, little endian,
    of blake2b(digest i-1 + block i's tokens as 8-byte signed integers), digest -1 being
    b"rt-router-root"."""
    if token_ids is None or len(token_ids) < block_size:
        return []
    packed = array("q", token_ids[: max_blocks * block_size]).tobytes()
    block_bytes = 8 * block_size
    blake2b = hashlib.blake2b
    digests: list[bytes] = []
    append = digests.append
    parent = b"rt-router-root"
    for start in range(0, len(packed), block_bytes):
        parent = blake2b(parent + packed[start : start + block_bytes], digest_size=8).digest()
        append(parent)
    # the digests as integers at once (one `int.from_bytes` per block cost ~10% of this)
    hashes = array("Q", b"".join(digests))
    if _BIG_ENDIAN:
        hashes.byteswap()
    return hashes.tolist()


@dataclass(slots=True, eq=False)
class _TouchLog:
    """One replica's LRU of block hashes as the log of its touches, oldest first: a hash's
    place is its last touch, and `stale[h]` counts its touches before that one (absent: 0).
    A touch is an append (no node per hash, as an OrderedDict makes); the log is compacted
    when stale touches outnumber the held hashes."""

    limit: int  # blocks held at most
    held: int = 0  # distinct hashes held
    log: deque[RouterHash] = field(default_factory=deque)
    stale: dict[RouterHash, int] = field(default_factory=dict)

    def pop_oldest(self) -> RouterHash:
        """Forget the least recently touched hash and return it."""
        log, stale = self.log, self.stale
        while True:
            h = log.popleft()
            count = stale.get(h)
            if not count:
                self.held -= 1
                return h
            if count == 1:
                del stale[h]
            else:
                stale[h] = count - 1

    def compact(self) -> None:
        """Drop the stale touches from the log (the same order of held hashes)."""
        self.log = deque(self.order())
        self.stale = {}

    def order(self) -> list[RouterHash]:
        """The held hashes, least recently touched first."""
        skip = dict(self.stale)
        order = []
        for h in self.log:
            count = skip.get(h)
            if count:
                skip[h] = count - 1
            else:
                order.append(h)
        return order


class BlockLRUIndex:
    """llm-d's approximate prefix index: per-replica LRUs of block hashes + reverse map.

    The reverse map holds each hash's replicas as a bit mask (bit r: replica r), which also
    answers whether a replica holds a hash; each replica's LRU is a `_TouchLog`. Adding a
    block is then one lookup and one store in the map and one append, where sets per hash
    and OrderedDicts per replica cost twice that (`add` was 14% of a 16-replica fleet's CPU
    on the default trace)."""

    def __init__(self) -> None:
        self._owners: dict[RouterHash, int] = {}  # hash -> mask of the replicas holding it
        self._lru: dict[int, _TouchLog] = {}

    def add(self, hashes: Sequence[RouterHash], replica: int, capacity: int) -> None:
        """Record that `replica` now holds `hashes`; the capacity is fixed on first add
        (llm-d creates a replica's LRU once). Adding in prompt order makes the first blocks
        the least recent, so they are evicted first, as in llm-d: hash by hash, a held one
        becomes the most recent, a new one is added as the most recent and, past the
        capacity, the least recent is evicted."""
        lru = self._lru.get(replica)
        if lru is None:
            if replica < 0:
                raise ValueError(f"replica must be >= 0, got {replica}")
            lru = self._lru[replica] = _TouchLog(capacity)
        owners_of = self._owners
        get = owners_of.get
        bit = 1 << replica
        stale, touch = lru.stale, lru.log.append
        for h in hashes:
            owners = get(h, 0)
            touch(h)
            if owners & bit:
                stale[h] = stale.get(h, 0) + 1
            else:
                owners_of[h] = owners | bit
                lru.held += 1
                if lru.held > lru.limit:  # h itself when the capacity is 0
                    self._evict(bit, lru.pop_oldest())
        if len(lru.log) > 2 * lru.held + 64:  # stale touches are most of it
            lru.compact()

    def _evict(self, bit: int, h: RouterHash) -> None:
        """The replica of mask `bit` no longer holds `h`."""
        owners = self._owners[h] & ~bit
        if owners:
            self._owners[h] = owners
        else:
            del self._owners[h]

    def match(self, hashes: Sequence[RouterHash]) -> dict[int, int]:
        """Matched blocks per replica, llm-d's greedy count (replicas absent = 0)."""
        get = self._owners.get
        runs: dict[int, int] = {}  # owner mask -> matched blocks with exactly those owners
        for h in hashes:
            owners = get(h)
            if not owners:
                break
            runs[owners] = runs.get(owners, 0) + 1
        matched: dict[int, int] = {}
        for owners, blocks in runs.items():
            while owners:
                low = owners & -owners
                replica = low.bit_length() - 1
                matched[replica] = matched.get(replica, 0) + blocks
                owners ^= low
        return matched

    def held(self, replica: int) -> list[RouterHash]:
        """The hashes `replica` holds, least recently added or touched first."""
        lru = self._lru.get(replica)
        return [] if lru is None else lru.order()

    def size(self, replica: int) -> int:
        lru = self._lru.get(replica)
        return 0 if lru is None else lru.held


@dataclass(slots=True, eq=False)
class _Run:
    """A run of pages on one path of the trie, held as one node: `key` is the pages'
    tokens back to back (pages of the trie's `page_size`; a short page only last, and then
    the run has no children), `first` the serial of its first page (page i's is first + i:
    a run's pages are made together). Every page of a run has the run's tenants, and each
    page but the last has the next as its only child; the last page's children are the
    run's, keyed by their first page."""

    parent: _Run | None
    key: tuple[int, ...]
    first: int
    children: dict[tuple[int, ...], _Run] = field(default_factory=dict)
    tenants: dict[int, float] = field(default_factory=dict)  # replica -> last access, s


class PageTrie:
    """A trie over pages of `page_size` tokens with per-replica ownership and access times.

    What it answers (`match`, `size`, `evict_to`) is that of a trie with a node per page,
    each numbered in creation order (the serial that breaks eviction ties), which is how
    the routers it mirrors keep theirs. It stores runs of pages that share their tenants
    and access times as one node (`_Run`), split where a later prompt leaves the run or
    eviction takes its trailing pages: a prompt nobody shares is one node, not one per page
    (an Azure prompt: 1 against ~75; 16 replicas behind sglang-cache-aware on the fleet
    bench made 1.46M page nodes).

    Invariant: `size(r)` is the total tokens of the pages r owns, and a replica owning a
    page owns all its ancestors (inserting a prompt marks its whole path).
    """

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._root = _Run(None, (), 0)
        self._size: dict[int, int] = {}
        self._num_pages = 0  # pages ever made: the last page's serial

    def _pages(self, run: _Run) -> int:
        return -(-len(run.key) // self.page_size)

    def _matching_pages(self, run: _Run, tokens: tuple[int, ...], pos: int) -> int:
        """How many leading pages of `run` equal the pages of `tokens` from `pos` (at
        least its first: the caller found it by that key)."""
        key, step = run.key, self.page_size
        n = len(key)
        if tokens[pos:pos + n] == key:  # every token: a short last page must end the prompt too
            return self._pages(run) - (n % step != 0 and len(tokens) - pos != n)
        count = 0
        for start in range(0, n, step):
            if tokens[pos + start:pos + start + step] != key[start:start + step]:
                break
            count += 1
        return count

    def _split(self, run: _Run, pages: int) -> _Run:
        """Keep `run`'s first `pages` pages in it; the rest becomes its only child (the
        same tenants, times and serials), which is returned."""
        cut = pages * self.page_size
        tail = _Run(run, run.key[cut:], run.first + pages, run.children, dict(run.tenants))
        for child in tail.children.values():
            child.parent = tail
        run.key = run.key[:cut]
        run.children = {tail.key[:self.page_size]: tail}
        return tail

    def insert(self, tokens: Sequence[int], replica: int, now_s: float) -> None:
        """Mark every page of `tokens` as held by `replica`, accessed at `now_s`."""
        tokens = tuple(tokens)
        step, total = self.page_size, len(tokens)
        node, pos = self._root, 0
        self._size.setdefault(replica, 0)
        while pos < total:
            child = node.children.get(tokens[pos:pos + step])
            if child is None:  # the rest of the prompt: new pages, one run
                child = _Run(node, tokens[pos:], self._num_pages + 1, tenants={replica: now_s})
                node.children[tokens[pos:pos + step]] = child
                self._num_pages += self._pages(child)
                self._size[replica] += total - pos
                return
            pages = self._matching_pages(child, tokens, pos)
            if pages < self._pages(child):
                self._split(child, pages)
            if replica not in child.tenants:
                self._size[replica] += len(child.key)
            child.tenants[replica] = now_s
            node, pos = child, pos + len(child.key)

    def match(self, tokens: Sequence[int], candidates: Iterable[int]) -> tuple[int, set[int]]:
        """Longest prefix held by some candidate: (matched tokens, the candidates holding
        all of it). With no page matched: (0, all candidates). This is production-stack's
        `longest_prefix_match`; SGLang's `prefix_match` returns one tenant of the deepest
        node reached, which is one of these."""
        tokens = tuple(tokens)
        step = self.page_size
        alive = set(candidates)
        node, matched, pos = self._root, 0, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos:pos + step])
            if child is None:
                break
            holders = alive.intersection(child.tenants)
            if not holders:
                break
            pages = self._matching_pages(child, tokens, pos)
            alive, matched = holders, matched + min(pages * step, len(child.key))
            if pages < self._pages(child):
                break
            node, pos = child, pos + len(child.key)
        return matched, alive

    def size(self, replica: int) -> int:
        """Tokens held by `replica` (SGLang's per-tenant char count)."""
        return self._size.get(replica, 0)

    def evict_to(self, max_size: int) -> None:
        """SGLang's `evict_tenant_by_size`: for each replica holding more than `max_size`
        tokens, drop its least recently accessed leaf pages until it holds at most that
        (ties: the page made first)."""
        for replica, size in list(self._size.items()):
            if size > max_size:
                self._evict_replica(replica, max_size)

    def _leaf_entry(self, run: _Run, replica: int) -> tuple[float, int, _Run]:
        """The heap entry of `run`'s last page: (access time, serial, run)."""
        return run.tenants[replica], run.first + self._pages(run) - 1, run

    def _evict_replica(self, replica: int, max_size: int) -> None:
        heap = [self._leaf_entry(run, replica) for run in self._owned_leaves(replica)]
        heapq.heapify(heap)
        while heap and self._size[replica] > max_size:
            _, _, run = heapq.heappop(heap)
            # A run's pages would pop one after another (same time, serials descending, all
            # below the rest of the heap): take at once the fewest trailing pages that cover
            # the excess (all of them if too few), one split instead of one per page.
            keep = max(0, (len(run.key) - (self._size[replica] - max_size)) // self.page_size)
            leaf = self._split(run, keep) if keep else run
            del leaf.tenants[replica]
            self._size[replica] -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None, "the root is never owned"
            if not leaf.tenants and not leaf.children:
                del parent.children[leaf.key[:self.page_size]]
            if parent is not self._root and self._is_leaf_of(parent, replica):
                heapq.heappush(heap, self._leaf_entry(parent, replica))

    def _owned_leaves(self, replica: int) -> list[_Run]:
        """The runs whose last page is a leaf of `replica`'s (owned, no owned child)."""
        leaves, stack = [], list(self._root.children.values())
        while stack:
            run = stack.pop()
            if replica not in run.tenants:
                continue
            if self._is_leaf_of(run, replica):
                leaves.append(run)
            stack.extend(run.children.values())
        return leaves

    @staticmethod
    def _is_leaf_of(run: _Run, replica: int) -> bool:
        return replica in run.tenants and not any(
            replica in child.tenants for child in run.children.values()
        )


class PreciseIndex:
    """Blocks each engine reported cached, from KV events (as delayed as the queue was).

    A hash is held by a replica while its stored events outnumber its removed ones (an
    engine may hold one hash in several blocks, each stored and removed on its own).
    """

    def __init__(self) -> None:
        self._owners: dict[BlockHash, set[int]] = {}
        self._held: dict[int, dict[BlockHash, int]] = {}  # replica -> hash -> blocks

    def apply(self, events: Iterable[KvEvent]) -> None:
        owners_of = self._owners
        for event in events:
            held = self._held.setdefault(event.replica_id, {})
            if event.kind == "stored":
                replica = event.replica_id
                for h in event.block_hashes:
                    count = held.get(h)
                    if count:
                        held[h] = count + 1
                        continue
                    held[h] = 1
                    owners = owners_of.get(h)
                    if owners is None:
                        owners_of[h] = {replica}
                    else:
                        owners.add(replica)
            elif event.kind == "removed":
                for h in event.block_hashes:
                    self._drop(event.replica_id, h, held)
            else:  # cleared
                for h in list(held):
                    held[h] = 1
                    self._drop(event.replica_id, h, held)

    def _drop(self, replica: int, h: BlockHash, held: dict[BlockHash, int]) -> None:
        count = held.get(h, 0)
        if count > 1:
            held[h] = count - 1
            return
        if not count:
            return
        del held[h]
        owners = self._owners[h]
        owners.discard(replica)
        if not owners:
            del self._owners[h]

    def overlap_blocks(self, block_hashes: Sequence[BlockHash]) -> dict[int, int]:
        """Per replica, how many leading blocks of the request it holds (absent = 0)."""
        overlap: dict[int, int] = {}
        alive: set[int] | None = None
        for depth, h in enumerate(block_hashes, start=1):
            owners = self._owners.get(h)
            if not owners:
                break
            alive = set(owners) if alive is None else alive & owners
            if not alive:
                break
            for replica in alive:
                overlap[replica] = depth
        return overlap

    def num_blocks(self, replica: int) -> int:
        """Distinct hashes `replica` holds."""
        return len(self._held.get(replica, ()))

    def hashes(self, replica: int) -> set[BlockHash]:
        """The hashes `replica` holds (a copy)."""
        return set(self._held.get(replica, ()))
