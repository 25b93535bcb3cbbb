"""docs/architecture.md has one row per module of the product, and no row for a module that is gone, and its
picture of the floors is the layers contract the imports are checked against: the map a newcomer reads is the code
as it is."""

from __future__ import annotations

import re
import subprocess
import tomllib

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


def drawn_floors() -> list[str]:
    """The floors of the picture under "## The floors", top to bottom, as import-linter's layers name them."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    picture = text.split("## The floors", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    floors = []
    for line in picture.splitlines():
        folders = re.findall(r"(?:^|\s)(?:airlock/)?(\w+)(?:/|\.py)(?=\s)", line[:24])
        if folders:
            floors.append(" : ".join(folders))
    return floors


def test_the_pictured_floors_are_the_layers_contract() -> None:
    """The picture is the contract `scripts/importcheck` holds the code to: the same floors in the same order."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    assert drawn_floors() == layers
