"""Every relative link in README.md and docs/**/*.md leads somewhere: the file exists and, where the link
names a section (``#anchor``), the file has a heading with that anchor (GitHub's rule: lower-cased, marks
other than letters, digits, ``_``, spaces and hyphens dropped, spaces made hyphens, ``-1``, ``-2`` for repeats).
Guides move their records to docs/archive/; a link left pointing at the old place fails here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading anchors on its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        found.update(_HTML_ID.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative link in a markdown file: inline, image and reference-style."""
    text = path.read_text(encoding="utf-8")
    out = []
    for number, line in prose_lines(text):
        line = _CODE_SPAN.sub("", line)  # a link written inside `code` is an example, not a link
        targets = _INLINE.findall(line)
        m = _REFERENCE.match(line)
        if m:
            targets.append(m.group(1))
        out.extend((number, t) for t in targets if not _EXTERNAL.match(t))
    return out


def broken(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: ({target})"
        if not dest.exists():
            problems.append(f"{where} no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where} {dest.name} has no heading with anchor #{anchor}")
    return problems


def test_every_relative_link_in_the_docs_resolves():
    problems = [p for doc in documents() for p in broken(doc)]
    assert not problems, "broken links (move the link to the section's new home):\n" + "\n".join(problems)


def test_the_check_finds_a_missing_file_and_a_missing_section(tmp_path, monkeypatch):
    """The check can fail: a link to a file that is not there and one to a heading the file lacks are both
    reported, a link to a heading it has is not."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "guide.md").write_text("# Guide\n\n## The hybrid (`hybrid:HEAD:γ`) ÷ head\n\n## Repeat\n\n## Repeat\n")
    doc = tmp_path / "README.md"
    doc.write_text(
        "[ok](guide.md#the-hybrid-hybridheadγ--head) [ok2](guide.md#repeat-1) [self](#top)\n"
        "[gone](archive/old.md) [no section](guide.md#moved-away) [web](https://example.com/x.md)\n"
        "`[in code](nowhere.md)`\n\n```\n[in a fence](nowhere.md)\n```\n\n# Top\n"
    )
    problems = broken(doc)
    assert len(problems) == 2, problems
    assert "no such file archive/old.md" in problems[0]
    assert "no heading with anchor #moved-away" in problems[1]
