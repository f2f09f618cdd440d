"""The page trie with a node per page, as `runtime.router.prefix_index.PageTrie` was before
it kept runs of pages as one node: the reference its answers and eviction order are checked
against (tests/runtime/router/test_page_trie.py)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class _Node:
    parent: _Node | None
    key: tuple[int, ...]  # this node's page of tokens (the last one may be short)
    serial: int  # creation order: breaks eviction ties deterministically
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    tenants: dict[int, float] = field(default_factory=dict)  # replica -> last access, s


class ReferencePageTrie:
    """`runtime.router.prefix_index.PageTrie` as it was before it stored runs of pages as
    one node: a node per page (as of 6c15d36, kept to check the runs against).

    Invariant: `size(r)` is the total tokens of the nodes r owns, and a replica owning a
    node owns all its ancestors (inserting a prompt marks its whole path).
    """

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._root = _Node(None, (), 0)
        self._size: dict[int, int] = {}
        self._num_nodes = 0

    def _pages(self, tokens: Sequence[int]) -> Iterable[tuple[int, ...]]:
        step = self.page_size
        return (tuple(tokens[i : i + step]) for i in range(0, len(tokens), step))

    def insert(self, tokens: Sequence[int], replica: int, now_s: float) -> None:
        """Mark every page of `tokens` as held by `replica`, accessed at `now_s`."""
        node = self._root
        self._size.setdefault(replica, 0)
        for page in self._pages(tokens):
            child = node.children.get(page)
            if child is None:
                self._num_nodes += 1
                child = node.children[page] = _Node(node, page, self._num_nodes)
            if replica not in child.tenants:
                self._size[replica] += len(page)
            child.tenants[replica] = now_s
            node = child

    def match(self, tokens: Sequence[int], candidates: Iterable[int]) -> tuple[int, set[int]]:
        """Longest prefix held by some candidate: (matched tokens, the candidates holding
        all of it). With no page matched: (0, all candidates). This is production-stack's
        `longest_prefix_match`; SGLang's `prefix_match` returns one tenant of the deepest
        node reached, which is one of these."""
        alive = set(candidates)
        node, matched = self._root, 0
        for page in self._pages(tokens):
            child = node.children.get(page)
            if child is None:
                break
            holders = alive.intersection(child.tenants)
            if not holders:
                break
            alive, node, matched = holders, child, matched + len(page)
        return matched, alive

    def size(self, replica: int) -> int:
        """Tokens held by `replica` (SGLang's per-tenant char count)."""
        return self._size.get(replica, 0)

    def evict_to(self, max_size: int) -> None:
        """SGLang's `evict_tenant_by_size`: for each replica holding more than `max_size`
        tokens, drop its least recently accessed leaves until it holds at most that."""
        for replica, size in list(self._size.items()):
            if size > max_size:
                self._evict_replica(replica, max_size)

    def _evict_replica(self, replica: int, max_size: int) -> None:
        heap = [(n.tenants[replica], n.serial, n) for n in self._owned_leaves(replica)]
        heapq.heapify(heap)
        while heap and self._size[replica] > max_size:
            _, _, node = heapq.heappop(heap)
            del node.tenants[replica]
            self._size[replica] -= len(node.key)
            parent = node.parent
            assert parent is not None, "the root is never owned"
            if not node.tenants and not node.children:
                del parent.children[node.key]
            if parent is not self._root and self._is_leaf_of(parent, replica):
                heapq.heappush(heap, (parent.tenants[replica], parent.serial, parent))

    def _owned_leaves(self, replica: int) -> list[_Node]:
        leaves, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if replica not in node.tenants:
                continue
            if self._is_leaf_of(node, replica):
                leaves.append(node)
            stack.extend(node.children.values())
        return leaves

    @staticmethod
    def _is_leaf_of(node: _Node, replica: int) -> bool:
        return replica in node.tenants and not any(
            replica in child.tenants for child in node.children.values()
        )
