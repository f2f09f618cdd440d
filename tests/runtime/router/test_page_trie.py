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


@settings(max_examples=300, deadline=None)
@given(page_size=st.integers(1, 4), data=st.data())
def test_prompts_cut_from_and_grown_out_of_earlier_ones(page_size: int, data: Any) -> None:
    """Prompts that are earlier ones, or an earlier one's prefix (cut anywhere: mid-page,
    at a page's start, whole) and new pages over a small alphabet of pages: they equal
    earlier prompts or their prefixes, leave a run in its middle and come back to pages
    the run's children hold. Each is matched, then maybe inserted (access times out of
    order and tied) or an eviction runs (targets span the sizes held)."""
    runs, nodes = PageTrie(page_size), ReferencePageTrie(page_size)
    seen: list[tuple[int, ...]] = [()]
    for _ in range(data.draw(st.integers(1, 30))):
        prompt = data.draw(st.sampled_from(seen))
        if data.draw(st.booleans()):
            cut = data.draw(st.integers(0, len(prompt)))
            if data.draw(st.booleans()):  # at a page's start
                cut -= cut % page_size
            pages = data.draw(st.lists(st.integers(0, 2), max_size=3))  # page i: i repeated
            end = data.draw(st.lists(st.integers(0, 2), max_size=page_size))
            prompt = prompt[:cut] + tuple(i for i in pages for _ in range(page_size)) + tuple(end)
            prompt = prompt[:5 * page_size + page_size // 2]  # 5 pages and a short one at most
        candidates = data.draw(st.sets(st.integers(0, 4), min_size=1))
        assert runs.match(prompt, candidates) == nodes.match(prompt, candidates)
        kind = data.draw(st.sampled_from(["insert", "insert", "evict", "none"]))
        if kind == "insert":
            replica, now = data.draw(st.integers(0, 3)), float(data.draw(st.integers(0, 3)))
            runs.insert(prompt, replica, now)
            nodes.insert(prompt, replica, now)
            seen.append(prompt)
        elif kind == "evict":
            target = data.draw(st.integers(0, max(nodes.size(r) for r in range(4)) + 1))
            runs.evict_to(target)
            nodes.evict_to(target)
        assert [runs.size(r) for r in range(4)] == [nodes.size(r) for r in range(4)]
        assert pages_of_runs(runs) == pages_of_nodes(nodes)
    candidates = data.draw(st.sets(st.integers(0, 4), min_size=1))
    for probe in probes(seen, page_size):  # the tries are equal: ask them everything
        assert runs.match(probe, candidates) == nodes.match(probe, candidates), probe


def probes(prompts: list[tuple[int, ...]], page_size: int) -> set[tuple[int, ...]]:
    """Every prefix of `prompts`, and each of them with one page changed: prompts that end
    mid-page, mid-run, and that leave a run and come back to its children's pages."""
    out: set[tuple[int, ...]] = set()
    for prompt in prompts:
        out.update(prompt[:cut] for cut in range(len(prompt) + 1))
        for start in range(0, len(prompt), page_size):
            page = tuple((t + 1) % 3 for t in prompt[start:start + page_size])
            out.add(prompt[:start] + page + prompt[start + page_size:])
    return out


def test_eviction_takes_the_pages_it_needs_off_a_run_at_once() -> None:
    """Replica 0 evicts 5 of a shared run's 10 pages: one split, the 5 pages left to
    replica 1 stay one run (page by page they made 5 runs, and evicting all n pages of a
    run copied its key n times: O(n^2) tokens at page_size 1)."""
    trie = PageTrie(2)
    trie.insert(range(20), 0, 0.0)
    trie.insert(range(20), 1, 0.0)
    trie.insert(range(100, 110), 0, 1.0)  # replica 0: 30 tokens, its oldest leaf the run's
    trie.evict_to(20)
    shared = trie._root.children[(0, 1)]
    assert (shared.key, shared.tenants, shared.first) == (tuple(range(10)), {0: 0.0, 1: 0.0}, 1)
    assert [(c.key, c.tenants, c.first, c.children) for c in shared.children.values()] == [
        (tuple(range(10, 20)), {1: 0.0}, 6, {})]
    assert [trie.size(r) for r in (0, 1)] == [20, 20]
    trie.evict_to(3)  # each: its oldest run whole, then all but one page of the next
    assert [(run.key, run.tenants, run.children) for run in trie._root.children.values()] == [
        ((0, 1), {1: 0.0}, {}), ((100, 101), {0: 1.0}, {})]
    assert [trie.size(r) for r in (0, 1)] == [2, 2]


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
