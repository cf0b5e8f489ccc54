"""Every relative link in README.md, docs/*.md and the reports' index points to a file that exists, and every
#anchor to a heading of the file it names (GitHub's heading ids). Pure Python, no models: milliseconds."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "reports" / "README.md"]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or ![alt](target), the target up to whitespace or the closing parenthesis (an optional "title")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _lines(text: str, inline_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; inline_code=False drops `code` spans."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((number, line if inline_code else INLINE_CODE.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's id for a heading: its text lowercased, markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _lines(path.read_text(encoding="utf-8")):
        match = re.match(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    for name in re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text(encoding="utf-8")):
        out.add(name)
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code, a link's text may wrap onto the next line."""
    lines = _lines(path.read_text(encoding="utf-8"), inline_code=False)
    found = [(number, m.group(1)) for number, line in lines for m in [REFERENCE.match(line)] if m]
    for first, paragraph in _paragraphs(lines):
        for m in LINK.finditer(paragraph):
            found.append((first + paragraph.count("\n", 0, m.start()), m.group(1)))
    return sorted(found)


def _paragraphs(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Runs of consecutive lines joined by newlines, each with its first line's number."""
    out: list[tuple[int, str]] = []
    for number, line in lines:
        if out and number == out[-1][0] + out[-1][1].count("\n") + 1 and line.strip():
            out[-1] = (out[-1][0], out[-1][1] + "\n" + line)
        elif line.strip():
            out.append((number, line))
    return out


def broken(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for number, target in links(path):
        if EXTERNAL.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        where = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not where.exists():
            problems.append(f"{path.relative_to(root)}:{number}: {target} (no such file)")
        elif anchor and where.suffix == ".md" and unquote(anchor).lower() not in anchors(where):
            problems.append(f"{path.relative_to(root)}:{number}: {target} (no heading #{anchor} there)")
    return problems


def test_pages_exist():
    assert (ROOT / "README.md").exists()
    assert len(PAGES) > 2, "docs/ holds the guide"
    assert any(target.startswith("docs/") for _, target in links(ROOT / "README.md")), "README links the guide"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken(page) == []


def test_the_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading: `with code`, and more\n\n## Again\n## Again\n")
    page.write_text(
        "# Title\n[ok](there.md) [ok](there.md#a-heading-with-code-and-more) [ok](#title) [ok](there.md#again-1)\n"
        "[web](https://example.com/x) `[in code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
        "[missing](nowhere.md) [bad anchor](there.md#nope) [bad self](#nope) [a text that\nwraps](gone.md)\n"
    )
    assert sorted(p.split(": ", 1)[1] for p in broken(page, root=tmp_path)) == [
        "#nope (no heading #nope there)", "gone.md (no such file)", "nowhere.md (no such file)",
        "there.md#nope (no heading #nope there)"]
    assert len(links(page)) == 9  # the fenced and the inline-code ones are not links
