"""The README stays short and every relative link in the manual leads somewhere.

Checks ``README.md`` (under 300 lines) and every relative Markdown link in
``README.md`` and ``docs/*.md``: the linked path, relative to the linking file,
must exist; a ``#fragment`` must name a heading of the linked Markdown file (or
of the linking file, for ``#fragment`` alone). External links (``http:``,
``https:``, ``mailto:``) are not followed. No network, no model.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300

# [text](target) and ![alt](target); the target stops at whitespace or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def doc_files() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks (links in code are not links)."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(line)
    return lines


def links(text: str) -> list[str]:
    """Relative link targets of a Markdown text, in order (code spans and blocks skipped)."""
    out = []
    for line in prose_lines(text):
        line = re.sub(r"`[^`]*`", "", line)
        out += [t for t in LINK.findall(line) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Anchors of every heading of a Markdown file."""
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            found.add(slug(m.group(1)))
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that lead nowhere, each as ``target: why``."""
    broken = []
    for target in links(page.read_text(encoding="utf-8")):
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.name}")
    return broken


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines (limit {README_MAX_LINES})"


def test_manual_pages_exist():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"structures.md", "api.md", "engine.md", "scheduler.md", "kvstore.md", "operations.md",
            "benchmarks.md"} <= names


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert page.exists()
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path):
    """The checker itself: a missing file and a missing heading are both reported."""
    (tmp_path / "other.md").write_text("# Title\n\n## Real section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#real-section) [gone](missing.md) [bad](other.md#nope)\n"
                    "[self](#page) `[code](nothere.md)` [web](https://example.com/x)\n\n"
                    "```\n[fenced](nothere.md)\n```\n", encoding="utf-8")
    assert broken_links(page) == ["missing.md: no such file", "other.md#nope: no heading #nope in other.md"]


def test_readme_links_reach_every_manual_page():
    readme_targets = {t.partition("#")[0] for t in links((ROOT / "README.md").read_text(encoding="utf-8"))}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= readme_targets, f"pages the README does not link: {sorted(pages - readme_targets)}"
