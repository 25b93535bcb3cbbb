"""Stable ids: a rule is named by its `name:` or by a hash of what it says, never by its line; a policy by the hash
of its content, never of its layout."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from airlock.cli import main
from airlock.policy import PolicyError, parse_policy
from airlock.policy.model import Rule

POLICY = """\
version: 1
profiles:
  default:
    allow:
      - host: pypi.org
      - host: files.example
        ports: [443, 8443]
        name: files
    deny:
      - host: gist.example
"""


def _ids(text: str) -> list[str]:
    profile = parse_policy(text, "p.yaml").profile()
    return [rule.id for rule in (*profile.allow, *profile.deny)]


def test_a_rule_is_named_by_its_name_else_by_a_hash_of_its_content() -> None:
    pypi, files, gist = _ids(POLICY)
    assert files == "files"
    assert re.fullmatch(r"sha256:[0-9a-f]{12}", pypi) and re.fullmatch(r"sha256:[0-9a-f]{12}", gist)
    assert pypi != gist


def test_a_rule_keeps_its_id_when_lines_above_it_change() -> None:
    moved = POLICY.replace("    allow:\n", "    # a comment\n    allow:\n      - host: new.example\n")
    before, after = parse_policy(POLICY, "p.yaml").profile().allow[0], parse_policy(moved, "p.yaml").profile().allow[1]
    assert (before.source, after.source) == ("p.yaml:5", "p.yaml:7")
    assert _ids(moved)[1:] == _ids(POLICY)


def test_a_rule_gets_another_id_when_what_it_says_changes() -> None:
    assert _ids(POLICY.replace("pypi.org", "pypi.org\n        ports: [443, 80]"))[0] != _ids(POLICY)[0]


@pytest.mark.parametrize("name", ["1st", "has space", "a:b", "é", "x" * 65, "sha256:0123456789ab"])
def test_a_rule_name_must_be_a_simple_identifier(name: str) -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(POLICY.replace("name: files", f'name: "{name}"'), "p.yaml")
    assert e.value.errors[0].startswith("p.yaml:8: name ")


def test_a_rule_name_is_unique_in_the_file() -> None:
    text = POLICY + "  other:\n    allow:\n      - host: b.example\n        name: files\n"
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    assert e.value.errors == ["p.yaml:14: name 'files' is already the name of the rule at p.yaml:6"]


def test_the_policy_hash_is_of_its_content_not_its_layout() -> None:
    original = parse_policy(POLICY, "a.yaml").hash
    relaid = POLICY.replace("version: 1\n", "# reviewed\nversion: 1\n")
    relaid = relaid.replace("ports: [443, 8443]", "ports: [8443, 443]  # both")
    assert re.fullmatch(r"sha256:[0-9a-f]{16}", original)
    assert parse_policy(relaid, "b.yaml").hash == original
    assert parse_policy(POLICY.replace("gist.example", "paste.example"), "a.yaml").hash != original
    assert parse_policy(POLICY.replace("name: files", "name: cache"), "a.yaml").hash != original


def test_policy_check_prints_the_hash(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY, encoding="utf-8")
    assert main(["policy", "check", str(path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"policy {parse_policy(POLICY).hash}")


def test_a_rules_hand_written_init_takes_every_field_the_dataclass_declares() -> None:
    # Rule's __init__ is written by hand (for speed): it must take exactly the fields, with their defaults.
    declared = [(f.name, f.default) for f in dataclasses.fields(Rule) if f.init]
    taken = [(p.name, p.default) for p in list(inspect.signature(Rule.__init__).parameters.values())[1:]]
    assert taken == [(name, inspect.Parameter.empty if d is dataclasses.MISSING else d) for name, d in declared]
    values = {"action": "allow", "source": "p:1", "host": "a.example", "ports": frozenset({443}), "tunnel": True,
              "ech": True, "name": "n", "inspect": True, "http": ("h",), "inject": ("i",)}  # fmt: skip
    rule = Rule(**values)  # type: ignore[arg-type]
    assert {f.name: getattr(rule, f.name) for f in dataclasses.fields(Rule)} == {**values, "cidr": None, "_id": None}
    assert dataclasses.replace(rule, host="b.example") == Rule(**{**values, "host": "b.example"})  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.host = "c.example"  # type: ignore[misc]
