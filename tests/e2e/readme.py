"""The walk-throughs of README.md and docs/*.md as their tests type them: each fenced block that follows a
`<!-- walkthrough: NAME -->` line, exactly as printed, wherever its topic's page is."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^<!-- walkthrough: (?P<name>[\w/-]+) -->\n```\w*\n(?P<text>.*?)^```$", re.MULTILINE | re.DOTALL)


def pages() -> list[Path]:
    """The pages a reader follows: the README and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def walkthroughs() -> dict[str, str]:
    """Every marked block of the pages, by name; a name is marked once in all of them."""
    found: dict[str, str] = {}
    for page in pages():
        for match in _BLOCK.finditer(page.read_text(encoding="utf-8")):
            assert match["name"] not in found, f"two walk-through blocks named {match['name']} ({page.name})"
            found[match["name"]] = match["text"]
    return found


def walkthrough(name: str) -> str:
    """One marked block: what the reader types (or writes into the file the text names)."""
    blocks = walkthroughs()
    assert name in blocks, f"no page has a block marked <!-- walkthrough: {name} --> (they have {sorted(blocks)})"
    return blocks[name]
