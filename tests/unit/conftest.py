"""Helpers shared by unit tests live next to them (e.g. addon_env.py); the repo root stays off sys.path because
its dns/ would shadow dnspython."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
