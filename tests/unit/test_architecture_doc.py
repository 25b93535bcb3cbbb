"""docs/architecture.md has one row per module of the product, and no row for a module that is gone: the map a
newcomer reads is the code as it is."""

from __future__ import annotations

import re
import subprocess

from repo_files import REPO

PACKAGES = ("airlock/", "proxy/", "broker/", "dns/", "policy/", "audit/")
ROW = re.compile(r"^\| `([\w/.]+\.py)` \|", re.M)


def product_modules() -> set[str]:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    return {
        path
        for path in tracked.stdout.split()
        if path.startswith(PACKAGES) and not path.endswith("__init__.py") and (REPO / path).exists()
    }


def rows() -> set[str]:
    return set(ROW.findall((REPO / "docs" / "architecture.md").read_text(encoding="utf-8")))


def test_every_module_has_its_row() -> None:
    assert sorted(product_modules() - rows()) == []


def test_every_row_names_a_module_that_exists() -> None:
    assert sorted(path for path in rows() if not (REPO / path).exists()) == []
