"""`airlock policy check` (0 ok / 2 errors) and `airlock policy explain` (0 allow / 1 deny / 2 error)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from repo_files import CONFIGS

from airlock.cli import main
from airlock.gateway.reload import PolicyReloader
from airlock.policy import Policy, fastload, loader, parse_policy

POLICY = """\
version: 1
default_profile: dev
profiles:
  dev:
    allow:
      - host: pypi.org
      - host: "*.example.com"
        ports: [443, 8080]
      - host: ssh.example.org
        ports: [22]
        tunnel: true
    deny:
      - host: gist.example.com
  internal:
    allow:
      - host: artifacts.corp.example
      - cidr: 10.1.2.3/32
        ports: [443]
"""

BAD_POLICY = """\
version: 1
profiles:
  default:
    allow:
      - host: "*.com"
      - cidr: 169.254.0.0/16
      - host: a.example.com
        ports: [70000]
"""


@pytest.fixture
def policy_file(tmp_path: Path) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY, encoding="utf-8")
    return str(path)


# --- check --------------------------------------------------------------------------------------------------------


def test_check_ok(policy_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "check", policy_file]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{policy_file}: ok (2 profiles, 6 rules, default profile 'dev')")


@pytest.mark.parametrize("name", ["default.yaml", "policy.example.yaml"])
def test_check_shipped(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "check", str(CONFIGS / name)]) == 0
    assert ": ok (" in capsys.readouterr().out


def test_check_bad_lists_every_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_POLICY, encoding="utf-8")
    assert main(["policy", "check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert [int(re.match(rf"^{re.escape(str(path))}:(\d+): ", line).group(1)) for line in lines] == [5, 6, 8]


@pytest.mark.parametrize(
    ("content", "line"),
    [(b"", 1), (b"version: 1\nprofiles: [\n", 3), ("version: 1\n# caf\xe9\n".encode("latin-1"), 1)],
    ids=["empty", "invalid-yaml", "non-utf8"],
)
def test_check_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, line: int) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(content)
    assert main(["policy", "check", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"{path}:{line}: ")


# Odd YAML that used to crash the loader (AttributeError, ValueError, TypeError) or pass as something else.
_RULE = "version: 1\nprofiles:\n  default:\n    allow:\n      - host: a.example.com\n"
_DNS = "version: 1\nprofiles:\n  default:\n    dns:\n"
ODD_POLICIES = [
    ("tunnel-tagged-list", _RULE + "        tunnel: !!bool [x]\n", 6),
    ("refuse-tagged-mapping", _DNS + "      refuse_suspicious: !!bool {a: b}\n", 5),
    ("port-superscript", _RULE + '        ports: [!!int "\u00b2"]\n', 6),
    ("port-arabic-indic", _RULE + '        ports: [!!int "\u0664\u0664\u0663"]\n', 6),
    ("port-fullwidth", _RULE + '        ports: [!!int "\uff14\uff14\uff13"]\n', 6),
    ("entropy-inf", _DNS + "      max_label_entropy: inf\n", 5),
    ("entropy-nan", _DNS + "      max_label_entropy: nan\n", 5),
    ("entropy-list", _DNS + "      max_label_entropy: [4.0]\n", 5),
    ("host-with-newline", _RULE.replace("a.example.com", '"127.0.0.1\\n"'), 5),
]


@pytest.mark.parametrize(("content", "line"), [o[1:] for o in ODD_POLICIES], ids=[o[0] for o in ODD_POLICIES])
def test_check_odd_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, line: int) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(content, encoding="utf-8")
    assert main(["policy", "check", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"{path}:{line}: ")


def test_check_loader_bug_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(raw: str) -> str:
        raise RuntimeError("boom")

    monkeypatch.setattr(loader, "canonical_host", broken)
    monkeypatch.setattr(fastload, "read_common", lambda text, filename: None)  # the full loader's host check
    path = tmp_path / "p.yaml"
    path.write_text(POLICY, encoding="utf-8")
    assert main(["policy", "check", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"{path}:1: cannot load policy: RuntimeError: boom")


RUNNING = parse_policy(POLICY, "running.yaml")


class _Gateway:
    def __init__(self) -> None:
        self.policies: list[Policy] = []
        self.refused: list[str] = []

    def replace_policy(self, policy: Policy) -> None:
        self.policies.append(policy)

    def policy_refused(self, source: str, errors: list[str]) -> None:
        self.refused.append(source)


@pytest.mark.parametrize(
    ("content", "loaded"),
    [(POLICY, 1), *((o[1], 0) for o in ODD_POLICIES)],
    ids=["valid", *(o[0] for o in ODD_POLICIES)],
)
async def test_reload_keeps_running_policy_on_odd_yaml(tmp_path: Path, content: str, loaded: int) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(content, encoding="utf-8")
    gateway = _Gateway()
    outcome = await PolicyReloader(gateway, str(path), lambda: RUNNING).reload()  # never raises
    assert outcome.ok == bool(loaded)
    assert outcome.policy_hash == (gateway.policies[0].hash if loaded else RUNNING.hash)
    assert len(gateway.policies) == loaded
    assert gateway.refused == ([] if loaded else [str(path)])  # a file that does not load is audited as refused


def test_check_several_files_reports_each_and_fails_if_any_is_bad(
    policy_file: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_POLICY, encoding="utf-8")
    shipped = str(CONFIGS / "default.yaml")
    missing = str(tmp_path / "absent.yaml")
    assert main(["policy", "check", policy_file, str(bad), shipped, missing]) == 2
    captured = capsys.readouterr()
    assert [line.split(": ok (")[0] for line in captured.out.splitlines()] == [policy_file, shipped]
    errors = captured.err.strip().splitlines()
    assert [line.split(":")[0] for line in errors] == [str(bad)] * 3 + [missing]
    assert main(["policy", "check", policy_file, shipped]) == 0


def test_check_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "check", str(tmp_path / "absent.yaml")]) == 2
    assert "cannot read policy" in capsys.readouterr().err


# --- explain ------------------------------------------------------------------------------------------------------

# (id, extra args before the target, target, exit code, fragments expected on stdout)
EXPLAIN = [
    ("allow-url", [], "https://pypi.org/simple/", 0, ["target:   pypi.org:443 (profile dev)", "decision: allow"]),
    ("allow-host-port", [], "pypi.org:443", 0, ["decision: allow", "pass --resolve"]),
    ("allow-wildcard", [], "https://a.b.example.com:8080/x", 0, ["*.example.com", "tunnel:   TLS only;"]),
    ("allow-case-and-dot", [], "https://PyPI.org./", 0, ["target:   pypi.org:443"]),
    (
        "deny-not-listed",
        [],
        "https://evil.test/",
        1,
        ["decision: deny [not_allowlisted] — evil.test:443 is not in the allowlist", "to allow: allow:"],
    ),
    (
        "deny-not-listed-ssh",
        [],
        "git.example.net:22",
        1,
        [
            "to allow: allow: [{host: git.example.net, ports: [22]}]; a CONNECT tunnel that is not TLS (e.g. ssh) "
            "needs allow: [{host: git.example.net, ports: [22], tunnel: true}]"
        ],
    ),
    (
        "deny-port-ssh",
        [],
        "pypi.org:22",
        1,
        ["[port_not_allowed]", "add 22 to the ports", "needs allow: [{host: pypi.org, ports: [22], tunnel: true}]"],
    ),
    ("deny-port", [], "http://pypi.org/", 1, ["port 80 is not allowed", "to allow: add 80 to the ports"]),
    ("deny-rule", [], "https://gist.example.com/", 1, ["rule:     deny gist.example.com", "remove or narrow"]),
    ("deny-wildcard-apex", [], "https://example.com/", 1, ["decision: deny"]),
    ("tunnel", [], "ssh.example.org:22", 0, ["tunnel"]),
    ("metadata-hex", [], "http://0xa9fea9fe/", 1, ["169.254.169.254 is a metadata/link-local address"]),
    ("metadata-decimal", [], "http://2852039166/latest/meta-data/", 1, ["169.254.169.254"]),
    ("metadata-mapped", [], "http://[::ffff:169.254.169.254]/", 1, ["metadata"]),
    ("metadata-v6", [], "http://[fd00:ec2::254]/", 1, ["metadata"]),
    ("loopback-short", [], "http://127.1:8080/", 1, ["127.0.0.1 is an internal address (loopback)"]),
    ("resolve-internal", ["--resolve", "pypi.org=10.0.0.5"], "https://pypi.org/", 1, ["blocked:  10.0.0.5"]),
    ("resolve-loopback-odd", ["--resolve", "pypi.org=0x7f.1"], "https://pypi.org/", 1, ["blocked:  127.0.0.1"]),
    (
        "resolve-metadata",
        ["--resolve", "pypi.org=169.254.169.254"],
        "https://pypi.org/",
        1,
        ["decision: deny [metadata] — every address"],
    ),
    ("resolve-mapped", ["--resolve", "pypi.org=::ffff:10.0.0.5"], "https://pypi.org/", 1, ["blocked:"]),
    (
        "resolve-mixed-keeps-public",
        ["--resolve", "pypi.org=10.0.0.5,192.0.2.7"],
        "https://pypi.org/",
        0,
        ["blocked:  10.0.0.5", "would connect to 192.0.2.7"],
    ),
    ("resolve-public", ["--resolve", "PYPI.org.=192.0.2.7"], "https://pypi.org/", 0, ["would connect to 192.0.2.7"]),
    (
        "resolve-other-host-ignored",
        ["--resolve", "other.test=10.0.0.5"],
        "https://pypi.org/",
        0,
        ["pass --resolve"],
    ),
    (
        "internal-cidr-allows",
        ["--profile", "internal"],
        "https://10.1.2.3/",
        0,
        ["rule:     allow 10.1.2.3/32", "would connect to 10.1.2.3"],
    ),
    ("internal-cidr-other-port", ["--profile", "internal"], "http://10.1.2.3/", 1, ["decision: deny"]),
    (
        "internal-name-resolves-internal",
        ["--profile", "internal", "--resolve", "artifacts.corp.example=10.1.2.3"],
        "https://artifacts.corp.example/",
        0,
        ["would connect to 10.1.2.3"],
    ),
    (
        "internal-name-resolves-elsewhere",
        ["--profile", "internal", "--resolve", "artifacts.corp.example=10.1.2.4"],
        "https://artifacts.corp.example/",
        1,
        ["blocked:  10.1.2.4"],
    ),
]


@pytest.mark.parametrize(
    ("extra", "target", "code", "fragments"), [e[1:] for e in EXPLAIN], ids=[e[0] for e in EXPLAIN]
)
def test_explain(
    policy_file: str,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    target: str,
    code: int,
    fragments: list[str],
) -> None:
    assert main(["policy", "explain", "--policy", policy_file, *extra, target]) == code
    out = capsys.readouterr().out
    for fragment in fragments:
        assert fragment in out, out


@pytest.mark.parametrize(
    ("target", "noted"),
    [("pypi.org:443", False), ("http://a.example.com:8080/", True), ("ssh.example.org:22", False)],
    ids=["tls-port", "other-port", "tunnel-rule"],
)
def test_explain_says_when_only_tls_passes_a_tunnel(
    policy_file: str, capsys: pytest.CaptureFixture[str], target: str, noted: bool
) -> None:
    assert main(["policy", "explain", "--policy", policy_file, target]) == 0
    assert ("needs `tunnel: true` on the rule" in capsys.readouterr().out) is noted


def test_explain_packaged_default_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "explain", "https://pypi.org/simple/"]) == 0
    assert main(["policy", "explain", "https://evil.test/"]) == 1
    assert "to allow:" in capsys.readouterr().out


# (id, argv after `policy explain --policy FILE`, fragment of the error on stderr)
EXPLAIN_ERRORS = [
    ("missing-profile", ["--profile", "nope", "https://pypi.org/"], "no profile 'nope'"),
    ("ftp-url", ["ftp://pypi.org/"], "only http:// and https://"),
    ("no-port", ["pypi.org"], "give a URL or host:port"),
    ("port-not-number", ["pypi.org:https"], "give a URL or host:port"),
    ("port-zero", ["pypi.org:0"], "port out of range"),
    ("port-too-big", ["pypi.org:70000"], "port out of range"),
    ("userinfo", ["https://user:pw@pypi.org/"], "userinfo"),
    ("bad-host", ["https://exa mple.com/"], "forbidden character"),
    ("bad-ip", ["http://1.2.3.999/"], "out of range"),
    ("zone-id", ["http://[fe80::1%25eth0]/"], "zone"),
    ("resolve-no-equals", ["--resolve", "pypi.org", "https://pypi.org/"], "expected HOST=IP"),
    ("resolve-empty", ["--resolve", "pypi.org=", "https://pypi.org/"], "expected HOST=IP"),
    ("resolve-name-not-ip", ["--resolve", "pypi.org=example.com", "https://pypi.org/"], "not an IP address list"),
    ("resolve-bad-ip", ["--resolve", "pypi.org=1.2.3.999", "https://pypi.org/"], "out of range"),
    ("resolve-bad-host", ["--resolve", "a b=192.0.2.1", "https://pypi.org/"], "forbidden character"),
]


@pytest.mark.parametrize(("argv", "fragment"), [e[1:] for e in EXPLAIN_ERRORS], ids=[e[0] for e in EXPLAIN_ERRORS])
def test_explain_errors(policy_file: str, capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    assert main(["policy", "explain", "--policy", policy_file, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("airlock: ")
    assert fragment in captured.err
    assert "decision:" not in captured.out


def test_explain_bad_policy_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_POLICY, encoding="utf-8")
    assert main(["policy", "explain", "--policy", str(path), "https://pypi.org/"]) == 2
    assert capsys.readouterr().err.startswith(f"{path}:5: ")


@pytest.mark.parametrize(
    "argv",
    [[], ["policy"], ["policy", "explain"], ["policy", "check"], ["policy", "frobnicate"], ["policy", "explain", "-x"]],
    ids=["nothing", "no-action", "explain-no-target", "check-no-file", "unknown-action", "unknown-option"],
)
def test_bad_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("airlock: ") and " --help)" in err, err


def test_explain_url_port_out_of_range(policy_file: str) -> None:
    assert main(["policy", "explain", "--policy", policy_file, "http://pypi.org:99999/"]) == 2
