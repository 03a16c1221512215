"""Every relative link in README.md and docs/*.md points at a file that exists, and every
#anchor at a heading of that file (GitHub's heading slugs), so the front door and the topic
pages cannot drift apart silently when a page or a heading is renamed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """The page without its fenced code blocks (a `[x](y)` inside code is not a link)."""
    out, in_code = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_code = not in_code
            continue
        if not in_code:
            out.append(line)
    return "\n".join(out)


def _slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page: its headings' slugs (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_slugs_follow_github() -> None:
    assert _slug("MLA's latent cache (DeepSeek-V2/V3)") == "mlas-latent-cache-deepseek-v2v3"
    assert _slug("Requests, limits and errors") == "requests-limits-and-errors"
    assert _slug("`tool_choice` and more") == "tool_choice-and-more"


def test_a_missing_file_and_a_missing_heading_are_reported(tmp_path: Path, monkeypatch) -> None:
    tmp_path = tmp_path.resolve()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Title\n\n[ok](a.md#title) [gone](b.md) [bad](a.md#nope)\n"
                                   "```\n[in code](c.md)\n```\n")
    assert broken_links(tmp_path / "a.md") == ["b.md: no file b.md", "a.md#nope: no heading #nope in a.md"]
