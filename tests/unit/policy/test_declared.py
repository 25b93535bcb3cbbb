"""The policy's `tools:` and `upstreams:` sections: each mistake a security team can make is one `file:line:` error
(and the whole policy is refused); the example in configs/policy.example.yaml loads; grants and the CLI name
declared tools."""

from __future__ import annotations

import argparse
import re
import textwrap
from pathlib import Path

import pytest
from policy_text import F, errors_of
from repo_files import EXAMPLE_POLICY

from airlock.broker.grants import Grant, GrantError, parse_grant
from airlock.cli.common import UsageError
from airlock.cli.run import add_arguments as add_run_arguments
from airlock.cli.run import parse_grants, run_config
from airlock.gateway.config import BrokerConfig, GatewayConfig, parse_secret
from airlock.inspection.secrets import SecretSource
from airlock.launch.embedded_gateway import gateway_credentials
from airlock.policy import parse_policy
from airlock.policy.declared_tools import ArgvCommand, HttpsCall

HEAD = "version: 1\nprofiles:\n  default: {}\n"  # lines 1-3; a `tools:` section starts at line 4


def tools(body: str, upstreams: str = "") -> str:
    """A policy whose `tools:` list starts at line 5 (its first item), `upstreams:` after it."""
    text = HEAD + "tools:\n" + textwrap.indent(textwrap.dedent(body), "  ")
    return text + ("upstreams:\n" + textwrap.indent(textwrap.dedent(upstreams), "  ") if upstreams else "")


ARGV = "- name: t\n  description: d\n  input: {type: object, properties: {q: {type: string}}, required: [q]}\n"
HTTPS = ARGV + "  https:\n    upstream: {url: 'https://api.example.com'}\n"
UPSTREAMS = "tickets: {url: 'https://tickets.example.com'}\n"

# (id, policy text, line of the one expected error, fragment of its message)
ERRORS = [
    ("tools-not-list", HEAD + "tools: {a: 1}\n", 4, "tools must be a list"),
    ("no-name", tools("- description: d\n  argv: [/bin/true]\n"), 5, "'name' is required"),
    ("bad-name", tools("- name: Bad-Name\n  description: d\n  argv: [/bin/true]\n"), 5, "lowercase letters"),
    ("no-description", tools("- name: t\n  argv: [/bin/true]\n"), 5, "'description' is required"),
    ("unknown-key", tools("- name: t\n  description: d\n  argv: [/bin/true]\n  shell: yes\n"), 8, "unknown key"),
    ("no-executor", tools("- name: t\n  description: d\n"), 5, "exactly one executor"),
    ("two-executors", tools(HTTPS + "  argv: [/bin/true]\n"), 5, "exactly one executor"),
    ("twice", tools("- {name: t, description: d, argv: [/bin/true]}\n" * 2), 6, "declared twice"),
    ("schema-not-object", tools("- name: t\n  description: d\n  input: {type: string}\n  argv: [/bin/true]\n"), 7,
     "JSON Schema of an object"),
    ("schema-invalid", tools("- name: t\n  description: d\n  input: {type: object, properties: {q: {type: 5}}}\n"
                             "  argv: [/bin/true]\n"), 7, "not a valid JSON Schema"),
    ("schema-remote-ref", tools("- name: t\n  description: d\n  input: {type: object, $ref: 'https://x.test/s'}\n"
                                "  argv: [/bin/true]\n"), 7, "only local references"),
    ("schema-not-json", tools("- name: t\n  description: d\n  input: {type: object, default: 2024-01-01}\n"
                              "  argv: [/bin/true]\n"), 7, "is not a JSON value"),
    ("timeout-zero", tools("- {name: t, description: d, argv: [/bin/true], timeout: 0}\n"), 5, "timeout must be"),
    ("output-huge", tools("- {name: t, description: d, argv: [/bin/true], max_output: 99999999999}\n"), 5,
     "max_output must be"),
    ("rate-text", tools("- {name: t, description: d, argv: [/bin/true], rate: many}\n"), 5, "rate must be"),
    # --- argv
    ("argv-relative", tools(ARGV + "  argv: [jq]\n"), 8, "absolute path"),
    ("argv-field-program", tools(ARGV + "  argv: ['{q}']\n"), 8, "absolute path"),
    ("argv-partial", tools(ARGV + "  argv: [/bin/echo, '--name={q}']\n"), 8, "mixes text and a field"),
    ("argv-unquoted-field", tools(ARGV + "  argv:\n    - /bin/echo\n    - {q}\n"), 10, "quote it"),
    ("argv-unknown-field", tools(ARGV + "  argv: [/bin/echo, '{nope}']\n"), 8, "not a property of the input"),
    ("argv-lone-brace", tools(ARGV + "  argv: [/bin/echo, 'a{b']\n"), 8, "a lone '{'"),
    ("argv-optional-field", tools("- name: t\n  description: d\n  input: {type: object, properties: {q: "
                                  "{type: string}}}\n  argv: [/bin/echo, '{q}']\n"), 8, "must require it"),
    ("argv-object-field", tools("- name: t\n  description: d\n  input: {type: object, properties: {q: "
                                "{type: object}}, required: [q]}\n  argv: [/bin/echo, '{q}']\n"), 8, "needs type"),
    ("argv-env-secret-name", tools(ARGV + "  argv: [/bin/true]\n  env: {T: {secret: 'no such'}}\n"), 9, "secret"),
    ("argv-env-name", tools(ARGV + "  argv: [/bin/true]\n  env: {'A-B': x}\n"), 9, "not an environment variable"),
    ("argv-stdin-partial", tools(ARGV + "  argv: [/bin/cat]\n  stdin: 'x{q}'\n"), 9, "one whole"),
    ("argv-network-text", tools(ARGV + "  argv: [/bin/true]\n  network: 'no'\n"), 9, "true or false"),
    # --- https
    ("https-argv-key", tools(HTTPS + "  network: true\n"), 10, "is for argv tools"),
    ("https-no-upstream", tools(ARGV + "  https: {method: GET}\n"), 8, "needs 'upstream'"),
    ("https-unknown-upstream", tools(ARGV + "  https: {upstream: nope}\n", UPSTREAMS), 8, "no upstream 'nope'"),
    ("https-http-url", tools(ARGV + "  https: {upstream: {url: 'http://api.example.com'}}\n"), 8, "must be https"),
    ("https-userinfo", tools(ARGV + "  https: {upstream: {url: 'https://u:p@api.example.com'}}\n"), 8, "no user"),
    ("https-relative-ca", tools(ARGV + "  https: {upstream: {url: 'https://a.example', ca: ca.pem}}\n"), 8,
     "absolute path"),
    ("https-method", tools(HTTPS + "    method: TRACE\n"), 10, "method must be"),
    ("https-path-dots", tools(HTTPS + "    path: '/v1/../admin/{q}'\n"), 10, "'.' or '..'"),
    ("https-path-query", tools(HTTPS + "    path: '/v1?x={q}'\n"), 10, "URL path characters"),
    ("https-path-unknown", tools(HTTPS + "    path: '/v1/{ticket}'\n"), 10, "not a property"),
    ("https-header-host", tools(HTTPS + "    headers: {Host: evil.example}\n"), 10, "set by the broker"),
    ("https-header-name", tools(HTTPS + "    headers: {'Bad Header': x}\n"), 10, "not a header name"),
    ("https-get-json", tools(HTTPS + "    json: {a: '{q}'}\n"), 10, "a GET sends no json"),
    ("https-json-key", tools(HTTPS + "    method: POST\n    json: {'{q}': 1}\n"), 11, "keys are literal"),
    ("https-credential-format", tools(HTTPS + "    credential: {secret: T, format: 'Bearer'}\n"), 10,
     "must hold '{secret}' once"),
    ("https-credential-no-secret", tools(HTTPS + "    credential: {header: X-Key}\n"), 10, "needs 'secret'"),
    ("upstream-name", tools(HTTPS, "'bad name': {url: 'https://a.example'}\n"), 11, "letters, digits"),
    ("upstream-no-url", tools(HTTPS, "t: {ca: /ca.pem}\n"), 11, "'url' is required"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "line", "fragment"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_each_mistake_is_one_error_at_its_line(text: str, line: int, fragment: str) -> None:
    errors = errors_of(text)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{F}:{line}: "), errors
    assert fragment in errors[0], errors


def test_every_mistake_is_reported_at_once() -> None:
    text = tools("- {name: a, description: d, argv: [jq]}\n- {name: b, description: d, https: {upstream: x}}\n")
    assert [e.split(":")[1] for e in errors_of(text)] == ["5", "6"]


def example_with_tools() -> str:
    """configs/policy.example.yaml with its commented `tools:` section switched on."""
    text = EXAMPLE_POLICY.read_text()
    start, end = text.index("# tools:"), text.index("# (end of the tools example)")
    block = re.sub(r"(?m)^# ?", "", text[start:end])
    return text[:start] + block + text[end:]


def test_the_example_declares_one_tool_of_each_kind() -> None:
    policy = parse_policy(example_with_tools(), "example.yaml")
    kinds = {tool.name: type(tool.executor) for tool in policy.tools}
    assert sorted(kinds.values(), key=str) == sorted([ArgvCommand, HttpsCall], key=str)
    assert parse_policy(EXAMPLE_POLICY.read_text()).tools == ()  # commented out: the example runs without --secret


# --- grants and the CLI -------------------------------------------------------------------------------------------


def test_a_declared_tool_grant_is_its_name_alone() -> None:
    grant = parse_grant("lookup_ticket")
    assert grant.declared and grant.to_claim() == {"tool": "lookup_ticket"}
    assert Grant.from_claim({"tool": "lookup_ticket"}) == grant
    assert not parse_grant("push_branch:acme/app").declared  # built-in grants exactly as before
    with pytest.raises(GrantError, match="repository must be owner/name"):
        parse_grant("push_branch")
    with pytest.raises(GrantError, match="unknown tool"):
        parse_grant("Not-A-Tool")


def run_args(*argv: str) -> argparse.Namespace:
    """`airlock run`'s own parser, as the command line gives it."""
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return parser.parse_args([*argv, "--", "true"])


def test_run_refuses_a_grant_for_a_tool_the_policy_does_not_declare() -> None:
    policy = parse_policy(tools("- {name: lookup_ticket, description: d, argv: [/bin/true]}\n"), F)
    assert parse_grants(["lookup_ticket"], policy)[0].tool == "lookup_ticket"
    with pytest.raises(UsageError, match=r"--grant lookup_tickets: p.yaml declares no such tool \(declared: lookup_"):
        parse_grants(["lookup_tickets"], policy)


def test_secret_options(tmp_path: Path) -> None:
    assert parse_secret("TOKEN=env:TICKETS") == SecretSource("TOKEN", "env", "TICKETS")
    assert parse_secret("T=file:rel/t.txt").where == str(Path("rel/t.txt").absolute())
    for bad in ("TOKEN", "TOKEN=TICKETS", "TOKEN=url:x", "=env:X", "T=file:"):
        with pytest.raises(ValueError, match="expected NAME=file:PATH or NAME=env:VAR"):
            parse_secret(bad)
    policy = parse_policy(HEAD, F)
    args = run_args("--secret", f"T=file:{tmp_path}/t", "--secret", "E=env:TICKETS", "--env", "TICKETS=x")
    with pytest.raises(UsageError, match="--env TICKETS: that variable holds a --secret"):
        run_config(args, ["true"], policy)
    config = GatewayConfig(policy, "127.0.0.1", broker=BrokerConfig(secrets=[parse_secret(f"T=file:{tmp_path}/t")]))
    assert f"{tmp_path}/t" in gateway_credentials(config)  # hidden from the sandbox like the GitHub key
