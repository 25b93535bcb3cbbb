"""The repository's own files that unit tests read (configs, docs, the e2e helpers), found from here wherever a test
module sits below tests/unit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
EXAMPLE_POLICY = CONFIGS / "policy.example.yaml"
E2E = REPO / "tests" / "e2e"
AUDIT_SCHEMA: dict[str, Any] = json.loads((REPO / "docs" / "audit-record.schema.json").read_text(encoding="utf-8"))
