"""The policy editor: allow rules written into a policy document, as `airlock policy suggest` prints them and as an
approval adds one — a new document of the rules, or a policy file with them added, its comments and layout kept
(a ruamel.yaml round trip). No I/O but reading the policy file it is given; what comes out is loaded back first.

Not imported with `airlock.policy`: ruamel.yaml is for those two callers alone."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError
from ruamel.yaml.util import load_yaml_guess_indent

from .reading import PolicyError, parse_policy


@dataclass(frozen=True)
class Suggestion:
    """One allow rule for a profile: its target, its ports and the comment written beside it."""

    profile: str
    target: str  # a host, "*.parent", or a cidr
    ports: list[int]
    comment: str

    def rule(self) -> CommentedMap:
        rule = CommentedMap()
        key = "cidr" if "/" in self.target else "host"
        rule[key] = self.target
        ports = CommentedSeq(self.ports)
        ports.fa.set_flow_style()
        rule["ports"] = ports
        rule.yaml_add_eol_comment(self.comment, key)
        return rule


def render(suggestions: list[Suggestion], merge: Path | None = None, source: str = "the audit") -> str:
    """The policy document: a new one of the suggested rules, or the `merge` policy with them added (PolicyError,
    as file:line, when it cannot be read or is no valid policy). It is loaded back before it is returned: a rule
    `policy check` would refuse is a bug, never output."""
    yaml, document = _document(suggestions, merge, source)
    profiles = document["profiles"]
    for suggestion in suggestions:
        if suggestion.profile not in profiles:
            profiles[suggestion.profile] = CommentedMap()
        rules = profiles[suggestion.profile]
        if rules.get("allow") is None:
            rules["allow"] = CommentedSeq()
        rules["allow"].append(suggestion.rule())
    out = io.StringIO()
    yaml.dump(document, out)
    text = out.getvalue()
    try:
        parse_policy(text, "<suggested policy>")
    except PolicyError as e:
        raise AssertionError(f"policy suggest produced a policy that does not load:\n{e}") from None
    return text


def _document(suggestions: list[Suggestion], merge: Path | None, source: str) -> tuple[YAML, CommentedMap]:
    if merge is not None:
        return _load_for_merge(merge)
    yaml = YAML()
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.width = 4096
    document = CommentedMap()
    document["version"] = 1
    profiles = sorted({s.profile for s in suggestions}) or ["default"]
    document["default_profile"] = "default" if "default" in profiles else profiles[0]
    document["profiles"] = CommentedMap((name, CommentedMap()) for name in profiles)
    document.yaml_set_start_comment(
        f"Suggested by `airlock policy suggest` from {source}: {len(suggestions)} rules.\n"
        "Review every rule before it goes live: each one opens its host to the sandbox."
    )
    return yaml, document


def _load_for_merge(path: Path) -> tuple[YAML, CommentedMap]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:  # ValueError: undecodable bytes
        raise PolicyError([f"{path}:1: cannot read policy: {e}"]) from None
    parse_policy(text, str(path))  # PolicyError (file:line) unless it is a valid policy
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096
    try:
        _, sequence, offset = load_yaml_guess_indent(text)
        yaml.indent(mapping=_mapping_indent(text), sequence=sequence or 2, offset=offset or 0)
        document: CommentedMap = yaml.load(text)
    except YAMLError as e:
        raise PolicyError([f"{path}:1: {e}"]) from None
    return yaml, document


def _mapping_indent(text: str) -> int:
    """How far the file indents a mapping inside a mapping (the first nested key that is not a list item)."""
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        if stripped and line != stripped and not stripped.startswith(("-", "#")):
            return len(line) - len(stripped)
    return 2
