"""The fenced code blocks of README.md and docs/*.md, with the marker each carries.

A block a user would run is preceded by ``<!-- test: NAME -->`` (a test runs it, found by that
name with ``block``) or ``<!-- not tested: REASON -->`` (what CI lacks to run it). Blocks that
share a name hold the same text: the README and a docs page may show one recipe, run once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND_LANGUAGES = ("bash", "sh", "shell", "console", "python", "py")
_FENCE = re.compile(r"^ {0,3}```(\w*)\s*$")
_MARKER = re.compile(r"^<!-- (test|not tested): (.+?) -->$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, from 1
    language: str
    text: str
    test: str | None  # the name after "test:", if marked so
    not_tested: str | None  # the reason after "not tested:", if marked so

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, language = i, m.group(1)
        i += 1
        while i < len(lines) and not _FENCE.match(lines[i]):
            i += 1
        text = "\n".join(lines[start + 1:i]) + "\n"
        before = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        marker = _MARKER.match(before)
        kind, value = marker.groups() if marker else (None, None)
        out.append(Block(str(path.relative_to(ROOT)), start + 1, language, text,
                         value if kind == "test" else None, value if kind == "not tested" else None))
        i += 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in page_blocks(page)]


def block(name: str) -> str:
    """The text of the block(s) marked ``test: name``, wherever they are; all copies must agree."""
    found = [b for b in all_blocks() if b.test == name]
    assert found, f"no block in README.md or docs/ is marked 'test: {name}'"
    texts = {b.text for b in found}
    assert len(texts) == 1, f"the blocks marked 'test: {name}' differ: {', '.join(b.where for b in found)}"
    return found[0].text
