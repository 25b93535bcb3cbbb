"""The README's walk-throughs as their tests type them: each fenced block that follows a
`<!-- walkthrough: NAME -->` line, exactly as printed."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"^<!-- walkthrough: (?P<name>[\w/-]+) -->\n```\w*\n(?P<text>.*?)^```$", re.MULTILINE | re.DOTALL)


def walkthroughs(text: str | None = None) -> dict[str, str]:
    """Every marked block of the README (or of `text`), by name."""
    found: dict[str, str] = {}
    for match in _BLOCK.finditer(README.read_text(encoding="utf-8") if text is None else text):
        assert match["name"] not in found, f"two walk-through blocks named {match['name']}"
        found[match["name"]] = match["text"]
    return found


def walkthrough(name: str) -> str:
    """One marked block: what the reader types (or writes into the file the text names)."""
    blocks = walkthroughs()
    assert name in blocks, f"README.md has no block marked <!-- walkthrough: {name} --> (it has {sorted(blocks)})"
    return blocks[name]
