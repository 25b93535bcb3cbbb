"""The fast path for large policies (policy/fastload.py): what it reads equals what the full loader reads (rules,
lines, ids, hash); whatever it does not read as the full loader would, it leaves to the full loader, whose errors
stay word for word."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from repo_files import REPO

from airlock.policy import Policy, PolicyError, fastload, load_policy, parse_policy

HEAD = "version: 1\nprofiles:\n  default:\n    allow:\n"


def full(text: str, monkeypatch: pytest.MonkeyPatch) -> Policy | list[str]:
    """What the full loader alone makes of `text`: the policy, or its errors."""
    with monkeypatch.context() as patched:
        patched.setattr(fastload, "read_common", lambda text, filename: None)
        try:
            return parse_policy(text, "p.yaml")
        except PolicyError as e:
            return e.errors


def ids(policy: Policy) -> list[tuple[str, str, str]]:
    return [(p.name, r.id, r.source) for p in policy.profiles.values() for r in (*p.allow, *p.deny)]


def assert_same(fast: Policy, slow: Policy | list[str]) -> None:
    assert isinstance(slow, Policy)
    assert fast == slow
    assert (fast.hash, ids(fast)) == (slow.hash, ids(slow))


COMMON = {
    "hosts": HEAD + "      - host: pypi.org\n      - host: files.example\n        ports: [443, 8443]\n",
    "ports-spaced": HEAD + "      - host: a.example\n        ports: [ 80 ,443,  8080 ]\n",
    "duplicate-port": HEAD + "      - host: a.example\n        ports: [443, 443]\n",
    "wildcard-quoted": HEAD + "      - host: \"*.example.com\"\n      - host: '*.pkg.example'\n",
    "trailing-dot": HEAD + "      - host: a.example.\n",
    "quoted-exact": HEAD + '      - host: "a.example"\n',
    "cidrs": HEAD + "      - cidr: 10.0.0.0/8\n        ports: [5432]\n      - cidr: 2001:db8::/32\n",
    "deny": HEAD + "      - host: a.example\n    deny:\n      - host: b.example\n      - cidr: 192.0.2.0/24\n"
    "        ports: any\n      - host: c.example\n        ports: [22]\n",
    "names-and-switches": HEAD
    + "      - host: git.example\n        ports: [22]\n        tunnel: true\n        name: git\n"
    "      - host: ech.example\n        ech: true\n        tunnel: false\n        name: Yes.it-is_1\n",
    "indentless-and-odd-columns": "version: 1\nprofiles:\n   default:\n         allow:\n         -   host: a.example\n"
    "             ports: [80]\n         - host: b.example\n         deny:\n         - host: c.example\n",
    "comments-and-blanks": "# top\nversion: 1   # the only one\n\nprofiles:\n  # profiles\n  default:  # d\n"
    "    allow:\n  # a comment at any column\n      - host: a.example  # why\n\n        ports: [443]   # tls\n",
    "profiles-and-default": "version: 1\ndefault_profile: ci\nprofiles:\n  ci:\n    allow:\n      - host: a.example\n"
    "  yes:\n    deny:\n      - host: b.example\n  1:\n    allow:\n      - host: c.example\n",
    "no-version": "profiles:\n  default:\n    allow:\n      - host: a.example\n",
    "numeric-looking-host": HEAD
    + "      - host: 1.5e-3\n      - host: 2001-12-14.example\n      - host: 1_000.example\n",
    "no-final-newline": HEAD + "      - host: a.example",
    "description": "version: 1\nprofiles:\n  default:\n    description: x\n    allow:\n      - host: a.example\n",
    "descriptions-as-shipped": "version: 1\nprofiles:\n  default:\n    description: Python packages and GitHub, HTTPS "
    "only\n    allow:\n      - host: a.example\n  npm:\n    deny:\n      - host: b.example\n"
    "    description: npm (and pypi.org/simple) 2_a+b-c.  # why\n",
    "description-alone": "version: 1\nprofiles:\n  default:\n    description: 1.5\n  ci:\n    description: true\n",
}


@pytest.mark.parametrize("text", COMMON.values(), ids=COMMON.keys())
def test_the_common_shape_reads_as_the_full_loader_reads_it(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = fastload.read_common(text, "p.yaml")
    assert fast is not None
    assert_same(fast, full(text, monkeypatch))


UNUSUAL = {
    # what YAML reads otherwise than a line-by-line look suggests
    "null-host": HEAD + "      - host: null\n",
    "null-name": HEAD + "      - host: a.example\n        name: Null\n",
    "null-profile": "version: 1\nprofiles:\n  null:\n    allow:\n      - host: a.example\n",
    "alias": HEAD + "      - host: *.example.com\n",
    "anchor": HEAD + "      - host: &h a.example\n",
    "tag": HEAD + "      - host: !!str a.example\n",
    "continued-scalar": HEAD + "      - host: a.example\n          b.example\n",
    "value-on-next-line": HEAD + "      - host:\n          a.example\n",
    "ipv6-ending-in-colon": HEAD + "      - cidr: 1::\n",
    "tab": HEAD + "      - host: a.example\n\tports: [443]\n",
    "crlf": HEAD.replace("\n", "\r\n") + "      - host: a.example\r\n",
    "unicode-line-break": HEAD + "      - host: a.example\u2028        ports: [80]\n",
    "bom": "\ufeff" + HEAD + "      - host: a.example\n",
    "document-marker": "---\n" + HEAD + "      - host: a.example\n",
    "flow-rule": HEAD + "      - {host: a.example}\n",
    "block-ports": HEAD + "      - host: a.example\n        ports:\n          - 443\n",
    "hash-in-value": HEAD + "      - host: a.example#x\n",
    "quote-with-hash": HEAD + '      - host: "a #b"\n',
    "deeper-key": HEAD + "      - host: a.example\n          ports: [443]\n",
    "key-between-columns": HEAD + "      - host: a.example\n       ports: [443]\n",
    "key-after-sequence": "version: 1\nprofiles:\n  default:\n    allow:\n      - host: a.example\n      ports: [1]\n",
    "empty-allow": "version: 1\nprofiles:\n  default:\n    allow:\n",
    "empty-profile": "version: 1\nprofiles:\n  default:\n",
    "empty": "",
    # a description that is not a plain phrase of one line
    "description-null": HEAD + "      - host: a.example\n    description: null\n",
    "description-tilde": HEAD + "      - host: a.example\n    description: ~\n",
    "description-empty": HEAD + "      - host: a.example\n    description:\n",
    "description-quoted": HEAD + '      - host: a.example\n    description: "x"\n',
    "description-colon": HEAD + "      - host: a.example\n    description: a: b\n",
    "description-colon-end": HEAD + "      - host: a.example\n    description: a:\n",
    "description-flow": HEAD + "      - host: a.example\n    description: [a]\n",
    "description-anchor": HEAD + "      - host: a.example\n    description: &a x\n",
    "description-tab": HEAD + "      - host: a.example\n    description: a\tb\n",
    "description-non-ascii": HEAD + "      - host: a.example\n    description: caf\u00e9\n",
    "description-continued": HEAD + "      - host: a.example\n    description: a\n      b\n",
    "description-twice": HEAD + "      - host: a.example\n    description: a\n    description: b\n",
    "description-item": HEAD + "      - host: a.example\n    - description: a\n",
    "description-of-a-rule": HEAD + "      - host: a.example\n        description: a\n",
    "top-description": "description: a\n" + HEAD + "      - host: a.example\n",
    # another key than the common shape's: the full loader reads it
    "comment-key": HEAD + "      - host: a.example\n        comment: why\n",
    "inspect": HEAD + "      - host: a.example\n        inspect: true\n",
    "mode": "version: 1\nprofiles:\n  default:\n    mode: report\n    allow:\n      - host: a.example\n",
    "tools": HEAD + "      - host: a.example\ntools: []\n",
    "uppercase-host": HEAD + "      - host: A.example\n",
    "idn-host": HEAD + "      - host: bücher.example\n",
    # invalid: the full loader's errors, as ever
    "duplicate-rule-key": HEAD + "      - host: a.example\n        host: b.example\n",
    "duplicate-profile": HEAD + "      - host: a.example\n  default:\n    allow:\n      - host: b.example\n",
    "duplicate-top-key": HEAD + "      - host: a.example\nversion: 1\n",
    "duplicate-action": HEAD + "      - host: a.example\n    allow:\n      - host: b.example\n",
    "duplicate-name": HEAD + "      - host: a.example\n        name: x\n      - host: b.example\n        name: x\n",
    "host-and-cidr": HEAD + "      - host: a.example\n        cidr: 10.0.0.0/8\n",
    "neither": HEAD + "      - ports: [443]\n",
    "null-cidr-beside-host": HEAD + "      - host: b.example\n        cidr:\n",
    "null-host-beside-cidr": "version: 1\nprofiles:\n  default:\n    deny:\n      - cidr: 10.0.0.0/8\n"
    "        host:  # x\n",
    "null-host-alone": HEAD + "      - host:\n        ports: [443]\n",
    "octal-port": HEAD + "      - host: a.example\n        ports: [0443]\n",
    "port-zero": HEAD + "      - host: a.example\n        ports: [0]\n",
    "port-too-high": HEAD + "      - host: a.example\n        ports: [65536]\n",
    "ports-any-on-allow": HEAD + "      - host: a.example\n        ports: any\n",
    "tunnel-on-deny": "version: 1\nprofiles:\n  default:\n    deny:\n      - host: a.example\n        tunnel: false\n",
    "tunnel-yes": HEAD + "      - host: a.example\n        tunnel: yes\n",
    "ip-as-host": HEAD + "      - host: 192.0.2.1\n",
    "single-label-host": HEAD + "      - host: vm\n",
    "single-label-date-like": HEAD + "      - host: 2001-12-14\n",
    "public-suffix-wildcard": HEAD + '      - host: "*.co.uk"\n',
    "star-inside": HEAD + '      - host: "a.*.example"\n',
    "metadata-cidr": HEAD + "      - cidr: 169.254.0.0/16\n",
    "loopback-cidr": HEAD + "      - cidr: 127.0.0.0/8\n",
    "host-bits-set": HEAD + "      - cidr: 10.0.0.1/8\n",
    "bad-name": HEAD + "      - host: a.example\n        name: 1st\n",
    "version-2": "version: 2\nprofiles:\n  default:\n    allow:\n      - host: a.example\n",
    "no-default-profile": "version: 1\nprofiles:\n  ci:\n    allow:\n      - host: a.example\n",
    "unknown-top-key": HEAD + "      - host: a.example\nextra: 1\n",
    "unknown-rule-key": HEAD + "      - host: a.example\n        port: [443]\n",
    "label-too-long": HEAD + f"      - host: {'a' * 64}.example\n",
    "item-without-colon": HEAD + "      - host\n",
    "key-without-colon": HEAD + "      - host: a.example\n        tunnel\n",
    "key-without-space": HEAD + "      - host:a.example\n",
}


@pytest.mark.parametrize("text", UNUSUAL.values(), ids=UNUSUAL.keys())
def test_anything_else_is_left_to_the_full_loader(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert fastload.read_common(text, "p.yaml") is None
    try:
        outcome: Policy | list[str] = parse_policy(text, "p.yaml")
    except PolicyError as e:
        outcome = e.errors
    assert outcome == full(text, monkeypatch)  # the same policy, or the same errors word for word


@pytest.mark.parametrize(
    "path", sorted([*(REPO / "configs").glob("*.yaml"), *(REPO / "tests/e2e/policies").glob("*.yaml")]), ids=str
)
def test_shipped_policies_load_alike_whichever_path_reads_them(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_same(load_policy(path), _full_file(path, monkeypatch))


def _full_file(path: Path, monkeypatch: pytest.MonkeyPatch) -> Policy:
    with monkeypatch.context() as patched:
        patched.setattr(fastload, "read_common", lambda text, filename: None)
        return load_policy(path)


def generated(rules: int, seed: int = 12) -> str:
    """A large policy of the common shape, with each kind of rule and layout it knows."""
    pick = random.Random(seed)
    lines = ["# generated", "version: 1", "default_profile: ci", "profiles:"]
    for profile in ("default", "ci"):
        lines += [f"  {profile}:", "    allow:"]
        for i in range(rules):
            kind = pick.randrange(6)
            if kind == 0:
                lines.append(f"      - cidr: 10.{i % 256}.{i // 256 % 256}.0/24")
            elif kind == 1:
                lines.append(f'      - host: "*.w{i}.{profile}.example"  # wildcard')
            else:
                lines.append(f"      - host: h{i}.{profile}.example")
            if kind == 2:
                lines.append(f"        ports: [{pick.randrange(1, 65536)}, 443]")
            if kind == 3:
                lines += [f"        name: {profile}-r{i}", "        ports: [22]", "        tunnel: true"]
        lines += ["    deny:", "      - host: blocked.example", "        ports: any"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("chunk", [1, 100, 65536])
def test_a_large_generated_policy_reads_alike(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The reader splits its text some thousand lines at a time: lines cut at any chunk's end read alike.
    monkeypatch.setattr(fastload, "_SPLIT_CHARS", chunk)
    text = generated(3000)
    fast = fastload.read_common(text, "p.yaml")
    assert fast is not None and len(fast.profile("ci").allow) == 3000
    assert_same(fast, full(text, monkeypatch))


def test_an_error_at_the_end_of_a_large_policy_is_the_full_loaders(monkeypatch: pytest.MonkeyPatch) -> None:
    text = generated(3000) + "      - host: null\n"
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    assert e.value.errors == full(text, monkeypatch)
    assert e.value.errors[0].endswith("host must be a single value, not null")


def test_a_large_invalid_policy_is_reported_in_seconds_not_minutes() -> None:
    # The full loader once compared every rule with every earlier one (inspected rules decide alone): 40,000 rules
    # took about a minute. A wildcard left unquoted (a YAML alias) does not stop YAML; a bad port stops nothing.
    body = "".join(f"      - host: h{i}.example\n" for i in range(40_000))
    start = time.process_time()
    with pytest.raises(PolicyError) as e:
        parse_policy(HEAD + body + "      - host: a.example\n        ports: [0]\n", "p.yaml")
    assert time.process_time() - start < 15
    assert e.value.errors == ["p.yaml:40006: port 0 is out of range 1-65535"]
