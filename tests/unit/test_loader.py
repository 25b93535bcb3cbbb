"""Policy loading: every error class at its exact line, all errors at once, and the shipped configs load."""

from __future__ import annotations

import textwrap
from importlib import resources
from pathlib import Path

import pytest

from airlock.policy import PolicyError, canonical_host, decide, load_policy, parse_policy

F = "p.yaml"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def errors_of(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, F)
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


def rule(body: str, action: str = "allow") -> str:
    """A one-profile policy whose rule list starts at line 5."""
    return "version: 1\nprofiles:\n  default:\n    " + action + ":\n" + textwrap.indent(body, "      ")


# (id, policy text, line of the one expected error, fragment of its message)
ERRORS = [
    # --- YAML itself
    ("yaml-unclosed-flow", "version: 1\nprofiles:\n  default: [\n", 4, "invalid YAML"),
    ("yaml-bad-indent", rule("- host: a.example\n     - host: b.example\n"), 6, "invalid YAML"),
    ("yaml-unclosed-quote", rule('- host: "a.example\n'), 6, "invalid YAML"),
    ("yaml-tab", "version: 1\n\tprofiles: {}\n", 2, "invalid YAML"),
    ("yaml-two-documents", "version: 1\n---\nversion: 1\n", 2, "invalid YAML"),
    # --- structure
    ("empty-file", "", 1, "empty policy"),
    ("comment-only-file", "# nothing here\n", 1, "empty policy"),
    ("top-not-mapping", "- version: 1\n", 1, "policy must be a mapping"),
    ("missing-profiles", "version: 1\ndefault_profile: default\n", 1, "'profiles' is required"),
    ("profiles-not-mapping", "version: 1\nprofiles:\n  - default\n", 3, "profiles must be a mapping"),
    ("profile-not-mapping", "version: 1\nprofiles:\n  default: allow-all\n", 3, "profile 'default' must be a mapping"),
    ("profile-null", "version: 1\nprofiles:\n  default:\n", 3, "must be a mapping"),
    ("allow-not-list", "version: 1\nprofiles:\n  default:\n    allow: {host: a.example}\n", 4, "must be a list"),
    ("rule-not-mapping", rule("- a.example.com\n"), 5, "allow rule must be a mapping"),
    ("unknown-top-key", "version: 1\nprofile:\n  default: {}\nprofiles:\n  default: {}\n", 2, "unknown key 'profile'"),
    (
        "unknown-profile-key",
        "version: 1\nprofiles:\n  default:\n    alow:\n      - host: a.example.com\n",
        4,
        "unknown key 'alow'",
    ),
    ("unknown-rule-key", rule("- host: a.example.com\n  port: [443]\n"), 6, "unknown key 'port'"),
    (
        "duplicate-profile",
        "version: 1\nprofiles:\n  default:\n    allow: []\n  default:\n    allow: []\n",
        5,
        "duplicate key 'default'",
    ),
    ("duplicate-rule-key", rule("- host: a.example.com\n  host: evil.test\n"), 6, "duplicate key 'host'"),
    ("duplicate-top-key", "version: 1\nversion: 1\nprofiles:\n  default: {}\n", 2, "duplicate key 'version'"),
    ("merge-key-refused", rule("- <<: {host: a.example.com}\n"), 5, "unknown key '<<'"),
    ("version-2", "version: 2\nprofiles:\n  default: {}\n", 1, "only version 1"),
    ("version-string", "version: one\nprofiles:\n  default: {}\n", 1, "only version 1"),
    ("version-1.0", "version: 1.0\nprofiles:\n  default: {}\n", 1, "only version 1"),
    ("version-list", "version: [1]\nprofiles:\n  default: {}\n", 1, "version must be a single value"),
    (
        "undefined-default-profile",
        "version: 1\ndefault_profile: dev\nprofiles:\n  default: {}\n",
        2,
        "default profile 'dev' is not defined",
    ),
    ("no-default-profile", "version: 1\nprofiles:\n  dev: {}\n", 1, "default profile 'default' is not defined"),
    # --- host patterns
    ("star-alone", rule('- host: "*"\n'), 5, "'*' may only stand alone as the first label"),
    ("star-com", rule('- host: "*.com"\n'), 5, "public suffix"),
    ("star-co-uk", rule('- host: "*.co.uk"\n'), 5, "public suffix"),
    ("star-github-io-private-psl", rule('- host: "*.github.io"\n'), 5, "public suffix"),
    ("star-githubusercontent", rule('- host: "*.githubusercontent.com"\n'), 5, "public suffix"),
    ("star-single-label", rule('- host: "*.internal"\n'), 5, "public suffix"),
    ("star-uppercase-suffix", rule('- host: "*.CO.UK."\n'), 5, "public suffix"),
    ("glob-in-label", rule('- host: "foo*.x.com"\n'), 5, "'*' may only stand alone"),
    ("glob-mid-name", rule('- host: "a.*.x.com"\n'), 5, "'*' may only stand alone"),
    ("double-wildcard", rule('- host: "*.*.x.com"\n'), 5, "'*' may only stand alone"),
    ("glob-last-label", rule('- host: "x.com*"\n'), 5, "'*' may only stand alone"),
    ("host-ipv4", rule("- host: 10.1.2.3\n"), 5, "use 'cidr: 10.1.2.3/32'"),
    ("host-ipv4-odd-spelling", rule("- host: 0x7f.1\n"), 5, "use 'cidr: 127.0.0.1/32'"),
    ("host-ipv6", rule('- host: "[fd00::1]"\n'), 5, "use 'cidr: fd00::1/128'"),
    ("wildcard-over-ip", rule('- host: "*.10.0.0.1"\n'), 5, "IP address"),
    ("host-with-space", rule('- host: "a b.example.com"\n'), 5, "host:"),
    ("host-with-userinfo", rule('- host: "user@a.example.com"\n'), 5, "host:"),
    ("host-invalid-idna", rule('- host: "a\\u200db.example.com"\n'), 5, "invalid internationalized name"),
    ("host-label-too-long", rule(f"- host: {'a' * 64}.example.com\n"), 5, "invalid label"),
    ("host-null", rule("- host:\n"), 5, "host must be a single value"),
    ("host-list", rule("- host: [a.example.com]\n"), 5, "host must be a single value"),
    # --- CIDR rules
    ("cidr-garbage", rule("- cidr: not-a-network\n"), 5, "cidr 'not-a-network'"),
    ("cidr-prefix-too-long", rule("- cidr: 10.0.0.0/33\n"), 5, "cidr '10.0.0.0/33'"),
    ("cidr-host-bits-set", rule("- cidr: 10.0.0.1/8\n"), 5, "has host bits set"),
    ("cidr-host-bits-set-v6", rule("- cidr: fd12::1/64\n"), 5, "has host bits set"),
    ("cidr-link-local", rule("- cidr: 169.254.0.0/16\n"), 5, "covers cloud metadata"),
    ("cidr-imds", rule("- cidr: 169.254.169.254/32\n"), 5, "covers cloud metadata"),
    ("cidr-everything", rule("- cidr: 0.0.0.0/0\n"), 5, "covers cloud metadata"),
    ("cidr-upper-half", rule("- cidr: 128.0.0.0/1\n"), 5, "covers cloud metadata"),
    ("cidr-alibaba", rule("- cidr: 100.64.0.0/10\n"), 5, "covers cloud metadata"),
    ("cidr-azure", rule("- cidr: 168.63.129.16/32\n"), 5, "covers cloud metadata"),
    ("cidr-ula-fd", rule("- cidr: fd00::/8\n"), 5, "covers cloud metadata"),
    ("cidr-ula-all", rule("- cidr: fc00::/7\n"), 5, "covers cloud metadata"),
    ("cidr-v6-everything", rule('- cidr: "::/0"\n'), 5, "covers cloud metadata"),
    ("cidr-v6-link-local", rule("- cidr: fe80::/64\n"), 5, "covers cloud metadata"),
    ("cidr-loopback", rule("- cidr: 127.0.0.0/8\n"), 5, "gateway's own loopback"),
    ("cidr-loopback-host", rule("- cidr: 127.0.0.1/32\n"), 5, "gateway's own loopback"),
    ("cidr-loopback-wider", rule("- cidr: 126.0.0.0/7\n"), 5, "gateway's own loopback"),
    ("cidr-this-network", rule("- cidr: 0.0.0.0/8\n"), 5, "gateway's own loopback"),
    ("cidr-v6-loopback", rule('- cidr: "::1/128"\n'), 5, "gateway's own loopback"),
    ("cidr-v6-unspecified", rule('- cidr: "::/128"\n'), 5, "gateway's own loopback"),
    ("cidr-null", rule("- cidr:\n"), 5, "cidr must be a single value"),
    # --- ports
    ("port-zero", rule("- host: a.example.com\n  ports: [0]\n"), 6, "port 0 is out of range"),
    ("port-70000", rule("- host: a.example.com\n  ports: [443, 70000]\n"), 6, "port 70000 is out of range"),
    ("port-negative", rule("- host: a.example.com\n  ports: [-1]\n"), 6, "port -1"),
    ("port-quoted-string", rule('- host: a.example.com\n  ports: ["443"]\n'), 6, "port '443' is not a number"),
    ("port-word", rule("- host: a.example.com\n  ports: [https]\n"), 6, "port 'https' is not a number"),
    ("port-float", rule("- host: a.example.com\n  ports: [443.0]\n"), 6, "is not a number"),
    ("port-octal-looking", rule("- host: a.example.com\n  ports: [0443]\n"), 6, "plain decimal"),
    ("port-hex", rule("- host: a.example.com\n  ports: [0x1bb]\n"), 6, "plain decimal"),
    ("ports-empty", rule("- host: a.example.com\n  ports: []\n"), 6, "non-empty list"),
    ("ports-scalar", rule("- host: a.example.com\n  ports: 443\n"), 6, "non-empty list"),
    ("ports-any-on-allow", rule("- host: a.example.com\n  ports: any\n"), 6, "non-empty list of port numbers"),
    ("ports-null", rule("- host: a.example.com\n  ports:\n"), 6, "non-empty list"),
    ("port-on-its-own-line", rule("- host: a.example.com\n  ports:\n    - 443\n    - 99999\n"), 8, "99999"),
    # --- tunnel
    ("tunnel-string", rule("- host: a.example.com\n  tunnel: maybe\n"), 6, "tunnel must be true or false"),
    ("tunnel-quoted-true", rule('- host: a.example.com\n  tunnel: "true"\n'), 6, "tunnel must be true or false"),
    ("tunnel-int", rule("- host: a.example.com\n  tunnel: 1\n"), 6, "tunnel must be true or false"),
    ("tunnel-on-deny", rule("- host: a.example.com\n  tunnel: true\n", "deny"), 6, "only meaningful on allow"),
    # --- rule shape
    ("host-and-cidr", rule("- host: a.example.com\n  cidr: 10.0.0.1/32\n"), 5, "exactly one of 'host' or 'cidr'"),
    ("neither-host-nor-cidr", rule("- ports: [443]\n"), 5, "exactly one of 'host' or 'cidr'"),
    ("empty-rule", rule("- {}\n"), 5, "exactly one of 'host' or 'cidr'"),
    ("comment-only-rule", rule("- comment: just a note\n"), 5, "exactly one of 'host' or 'cidr'"),
    ("name-not-scalar", rule("- host: a.example.com\n  name: [x]\n"), 6, "name must be a single value"),
    ("deny-ports-word", rule("- host: a.example.com\n  ports: all\n", "deny"), 6, "or 'any'"),
]


@pytest.mark.parametrize(("text", "line", "fragment"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_error(text: str, line: int, fragment: str) -> None:
    errors = errors_of(text)
    assert errors[0].startswith(f"{F}:{line}: "), errors
    assert fragment in errors[0], errors


# (id, policy text): valid corner cases that must load
VALID = [
    ("deny-any-ports", rule("- host: a.example.com\n  ports: any\n", "deny")),
    ("deny-cidr-metadata", rule("- cidr: 169.254.0.0/16\n", "deny")),
    ("deny-cidr-everything", rule("- cidr: 0.0.0.0/0\n", "deny")),
    ("deny-wildcard", rule('- host: "*.example.com"\n', "deny")),
    ("tunnel-true", rule("- host: a.example.com\n  ports: [22]\n  tunnel: true\n")),
    ("tunnel-yes", rule("- host: a.example.com\n  ports: [22]\n  tunnel: yes\n")),
    ("tunnel-false", rule("- host: a.example.com\n  tunnel: false\n")),
    ("wildcard-under-suffix", rule('- host: "*.example.co.uk"\n')),
    ("wildcard-under-private-suffix", rule('- host: "*.project.github.io"\n')),
    ("idna-host", rule("- host: bücher.de\n")),
    ("cidr-internal", rule("- cidr: 10.1.2.3/32\n  ports: [443, 8443]\n  name: cache\n")),
    ("cidr-ula", rule("- cidr: fd12:3456::/32\n")),
    ("cidr-cgnat-part", rule("- cidr: 100.64.0.0/11\n")),
    ("comment-key", rule("- host: a.example.com\n  comment: why\n")),
    ("empty-profile", "version: 1\nprofiles:\n  default: {}\n"),
    ("empty-lists", "version: 1\nprofiles:\n  default:\n    allow: []\n    deny: []\n"),
    ("no-version", "profiles:\n  default: {}\n"),
    ("description", "version: 1\nprofiles:\n  default:\n    description: hi\n"),
]


@pytest.mark.parametrize("text", [v[1] for v in VALID], ids=[v[0] for v in VALID])
def test_valid(text: str) -> None:
    policy = parse_policy(text, F)
    assert "default" in policy.profiles


def test_rule_fields() -> None:
    policy = parse_policy(
        rule(
            '- host: "*.Example.COM."\n'  # line 5
            "- host: ssh.example.com\n"  # line 6
            "  ports: [22, 443, 22]\n"
            "  tunnel: true\n"
            "  name: git\n"
            "- cidr: 10.1.2.3/32\n"  # line 10
        ),
        F,
    )
    wild, ssh, cidr = policy.profile().allow
    assert (wild.host, wild.ports, wild.tunnel, wild.source) == ("*.example.com", frozenset({443}), False, f"{F}:5")
    assert (ssh.host, ssh.ports, ssh.tunnel, ssh.name, ssh.source) == (
        "ssh.example.com",
        frozenset({22, 443}),
        True,
        "git",
        f"{F}:6",
    )
    assert (str(cidr.cidr), cidr.ports, cidr.source) == ("10.1.2.3/32", frozenset({443}), f"{F}:10")


def test_deny_default_ports_every_port() -> None:
    (deny,) = parse_policy(rule("- host: a.example.com\n", "deny"), F).profile().deny
    assert deny.ports is None


MANY_ERRORS = """\
version: 2
colour: blue
default_profile: nope
profiles:
  dev:
    allow:
      - host: "*"
      - host: "*.co.uk"
      - host: 10.0.0.1
      - cidr: 10.0.0.1/8
      - cidr: 169.254.0.0/16
      - host: ok.example.com
        ports: [0, 443, 70000]
        tunnel: sometimes
      - host: a.example.com
        cidr: 10.0.0.0/8
      - {}
    deny:
      - host: b.example.com
        tunnel: true
      - host: c.example.com
        hots: x
    alow: []
  dev:
    allow: []
"""
MANY_EXPECTED = [
    (1, "only version 1"),
    (2, "unknown key 'colour'"),
    (7, "'*' may only stand alone"),
    (8, "public suffix"),
    (9, "is an IP address"),
    (10, "host bits set"),
    (11, "covers cloud metadata"),
    (13, "port 0 is out of range"),
    (13, "port 70000 is out of range"),
    (14, "tunnel must be true or false"),
    (15, "exactly one of 'host' or 'cidr'"),
    (17, "exactly one of 'host' or 'cidr'"),
    (20, "only meaningful on allow"),
    (22, "unknown key 'hots'"),
    (23, "unknown key 'alow'"),
    (24, "duplicate key 'dev'"),
    (3, "default profile 'nope' is not defined"),
]
MANY_EXPECTED.sort(key=lambda e: e[0])


def test_all_errors_reported() -> None:
    errors = errors_of(MANY_ERRORS)
    got = sorted(((int(e.split(":")[1]), e) for e in errors), key=lambda e: e[0])  # reported in walk order
    assert len(got) == len(MANY_EXPECTED), "\n".join(errors)
    for (line, message), (want_line, fragment) in zip(got, MANY_EXPECTED, strict=True):
        assert line == want_line, message
        assert fragment in message, message


def test_nothing_half_valid_returned() -> None:
    # One bad rule among good ones: the whole file is refused, never loaded without the bad rule.
    with pytest.raises(PolicyError):
        parse_policy(rule("- host: good.example.com\n- host: '*.com'\n- host: also-good.example.com\n"), F)


# --- files --------------------------------------------------------------------------------------------------------


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("version: 1\nprofiles:\n  default:\n    description: caf\xe9\n".encode("latin-1"))
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.errors[0].startswith(f"{path}:1: cannot read policy")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.errors[0].startswith(f"{path}:1: cannot read policy")


def test_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(rule("- host: '*.com'\n"), encoding="utf-8")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.errors == [f"{path}:5: host '*.com': com is a public suffix; anyone can own names under it"]


@pytest.mark.parametrize("name", ["default.yaml", "policy.example.yaml"])
def test_shipped_configs_load(name: str) -> None:
    policy = load_policy(CONFIGS / name)
    assert policy.profile() is policy.profiles[policy.default_profile]
    assert all(p.allow for p in policy.profiles.values())


def test_packaged_default_is_the_repo_default() -> None:
    packaged = resources.files("airlock.configs") / "default.yaml"
    assert packaged.read_text(encoding="utf-8") == (CONFIGS / "default.yaml").read_text(encoding="utf-8")


# What the shipped files promise in their comments.
SHIPPED = [
    ("default.yaml", None, "pypi.org", 443, True),
    ("default.yaml", None, "pypi.org", 80, False),
    ("default.yaml", None, "files.pythonhosted.org", 443, True),
    ("default.yaml", None, "gist.github.com", 443, False),
    ("default.yaml", None, "example.com", 443, False),
    ("policy.example.yaml", None, "files.pythonhosted.org", 443, True),
    ("policy.example.yaml", None, "pythonhosted.org", 443, False),
    ("policy.example.yaml", None, "upload.pythonhosted.org", 443, False),
    ("policy.example.yaml", None, "github.com", 80, False),
    ("policy.example.yaml", None, "ssh.github.com", 22, True),
    ("policy.example.yaml", None, "a.gist.github.com", 443, False),
    ("policy.example.yaml", "internal-service", "10.1.2.3", 443, True),
    ("policy.example.yaml", "internal-service", "10.1.2.3", 22, False),
    ("policy.example.yaml", "internal-service", "10.1.2.4", 443, False),
    ("policy.example.yaml", "internal-service", "pypi.org", 443, False),
]


@pytest.mark.parametrize(
    ("name", "profile", "host", "port", "allow"),
    SHIPPED,
    ids=[f"{s[0].split('.')[0]}-{s[1] or 'default'}-{s[2]}-{s[3]}" for s in SHIPPED],
)
def test_shipped_config_decisions(name: str, profile: str | None, host: str, port: int, allow: bool) -> None:
    policy = load_policy(CONFIGS / name)
    assert decide(policy.profile(profile), canonical_host(host), port).allow is allow


@pytest.mark.parametrize("cidr", ["::ffff:127.0.0.0/104", "::ffff:10.0.0.0/104", "2002:a00::/24", "64:ff9b::a00:0/104"])
def test_ipv6_forms_of_ipv4_networks_are_refused(cidr: str) -> None:
    text = f"version: 1\nprofiles:\n  default:\n    allow:\n      - cidr: '{cidr}'\n"
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    assert info.value.errors[0].startswith("p.yaml:5: ")
