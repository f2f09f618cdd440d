"""Relative links and #anchors between the README and docs/*.md resolve, as GitHub renders them.

A link is `[text](target)` or `![alt](target)` outside code; `http(s):`/`mailto:` targets are
not fetched. A target's file must exist (relative to the page), and its `#anchor`, when the
target is a Markdown page, must be one of that page's heading slugs: GitHub's rule (lower
case; everything but letters, digits, `_`, `-` and spaces dropped; spaces to `-`; the n-th
repeat of a slug gets `-n`). Pure text, no rendering: milliseconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)
INLINE_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _blank(match: re.Match[str]) -> str:
    """The match replaced by spaces, newlines kept: offsets and line numbers stay valid."""
    return re.sub(r"[^\n]", " ", match.group(0))


def prose(text: str) -> str:
    """The page with fenced blocks and inline code blanked out (links there are not links)."""
    return CODE_SPAN.sub(_blank, FENCE.sub(_blank, text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = INLINE_LINK.sub(r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page, repeats numbered as GitHub numbers them."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in HEADING.finditer(FENCE.sub(_blank, text)):
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, text: str) -> list[str]:
    """`page:line: target (why)` for each relative link of `text` that does not resolve."""
    broken = []
    body = prose(text)
    for match in LINK.finditer(body):
        target = match.group(1)
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        line = body.count("\n", 0, match.start()) + 1
        where = f"{page.name}:{line}: {target}"
        resolved = (page.parent / path).resolve()
        if path and not resolved.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and (not path or resolved.suffix == ".md") and \
                anchor not in anchors(resolved.read_text() if path else text):
            broken.append(f"{where} (no heading with that anchor)")
    return broken


def test_slug_follows_github() -> None:
    assert slug("Fleet: routers on shared traces (`rt simulate --replicas 4 --router ...`)") \
        == "fleet-routers-on-shared-traces-rt-simulate---replicas-4---router-"
    assert slug("Live at the merge, 2026-12-02 21:00-21:04 UTC (main at 9a101d1)") \
        == "live-at-the-merge-2026-12-02-2100-2104-utc-main-at-9a101d1"
    assert slug("[rt route](route.md): the_router's **overhead**") \
        == "rt-route-the_routers-overhead"
    assert anchors("# A\n\n## A\n\n```\n# not a heading\n```\n### A\n") == {"a", "a-1", "a-2"}


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    text = ("# Page\n\n[ok](other.md#a-section) [self](#page) [web](https://x.org/#nope)\n"
            "[gone](missing.md) and [bad anchor](other.md#b-section)\n"
            "![img](other.md) `[code](missing.md)`\n\n```\n[fenced](missing.md)\n```\n"
            "[own](#nowhere)\n")
    assert broken_links(page, text) == [
        "page.md:4: missing.md (no such file)",
        "page.md:4: other.md#b-section (no heading with that anchor)",
        "page.md:10: #nowhere (no heading with that anchor)",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_links_resolve(page: Path) -> None:
    assert broken_links(page, page.read_text()) == []
