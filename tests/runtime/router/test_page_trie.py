"""`PageTrie` keeps runs of pages as one node: its answers (`match`, `size`) and what
`evict_to` leaves must be those of the trie with a node per page (`ReferencePageTrie`),
page for page, serials included, on random prompts that share prefixes, end in short pages
and are evicted in part."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.router.prefix_index import PageTrie

from .page_trie_reference import ReferencePageTrie

Pages = dict[tuple[tuple[int, ...], ...], tuple[dict[int, float], int]]


def pages_of_runs(trie: PageTrie) -> Pages:
    """Every page's path of pages -> (tenants, serial)."""
    out: Pages = {}
    stack: list[tuple[Any, tuple[tuple[int, ...], ...]]] = [(trie._root, ())]
    step = trie.page_size
    while stack:
        run, path = stack.pop()
        for i, start in enumerate(range(0, len(run.key), step)):
            path = (*path, run.key[start:start + step])
            out[path] = (dict(run.tenants), run.first + i)
        stack.extend((child, path) for child in run.children.values())
    return out


def pages_of_nodes(trie: ReferencePageTrie) -> Pages:
    out: Pages = {}
    stack: list[tuple[Any, tuple[tuple[int, ...], ...]]] = [(trie._root, ())]
    while stack:
        node, path = stack.pop()
        if node is not trie._root:
            out[path] = (dict(node.tenants), node.serial)
        stack.extend((child, (*path, child.key)) for child in node.children.values())
    return out


PREFIXES = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9), (7,) * 12, (1, 2, 3)]
prompts = st.builds(lambda p, tail: PREFIXES[p] + tuple(tail),
                    st.integers(0, len(PREFIXES) - 1),
                    st.lists(st.integers(0, 3), max_size=10))
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), prompts, st.integers(0, 3)),
    st.tuples(st.just("match"), prompts, st.sets(st.integers(0, 3), min_size=1)),
    st.tuples(st.just("evict"), st.integers(0, 30), st.just(None)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(page_size=st.integers(1, 5), ops=ops)
def test_runs_answer_and_evict_as_a_node_per_page(page_size: int, ops: list[Any]) -> None:
    runs, nodes = PageTrie(page_size), ReferencePageTrie(page_size)
    for now, (kind, a, b) in enumerate(ops):
        if kind == "insert":
            runs.insert(a, b, float(now // 3))  # equal times: serials break eviction ties
            nodes.insert(a, b, float(now // 3))
        elif kind == "match":
            assert runs.match(a, b) == nodes.match(a, b)
        else:
            runs.evict_to(a)
            nodes.evict_to(a)
        assert [runs.size(r) for r in range(4)] == [nodes.size(r) for r in range(4)]
        assert pages_of_runs(runs) == pages_of_nodes(nodes)


def test_a_prompt_nobody_shares_is_one_node_split_where_another_leaves_it() -> None:
    trie = PageTrie(4)
    trie.insert(range(10), 0, 0.0)  # pages 0-3, 4-7, 8-9: one run
    assert [run.key for run in trie._root.children.values()] == [tuple(range(10))]
    trie.insert((0, 1, 2, 3, 4, 5, 6, 7, 50), 1, 1.0)  # leaves it after 2 pages
    (run,) = trie._root.children.values()
    assert run.key == tuple(range(8)) and run.tenants == {0: 0.0, 1: 1.0} and run.first == 1
    assert sorted((c.key, c.first, c.tenants) for c in run.children.values()) == [
        ((8, 9), 3, {0: 0.0}), ((50,), 4, {1: 1.0})]
    assert trie.match(range(10), [0, 1]) == (10, {0}) and trie.size(1) == 9
