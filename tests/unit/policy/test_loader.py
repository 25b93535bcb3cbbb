"""Policy loading: every error class at its exact line, all errors at once, and the shipped configs load."""

from __future__ import annotations

import random
import re
import textwrap
from importlib import resources
from pathlib import Path

import pytest
import yaml
from policy_text import F, errors_of, rule
from repo_files import CONFIGS

from airlock.policy import DnsLimits, PolicyError, canonical_host, decide, fastload, load_policy, loader, parse_policy


def dns(body: str) -> str:
    """A one-profile policy whose dns block starts at line 5."""
    return "version: 1\nprofiles:\n  default:\n    dns:\n" + textwrap.indent(body, "      ")


def port(value: str) -> str:
    """An allow rule whose one port item, on line 6, is `value`."""
    return rule(f"- host: a.example.com\n  ports: [{value}]\n")


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
    ("star-alone", rule('- host: "*"\n'), 5, "host '*' would allow every host, and is refused"),
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
    ("host-single-label", rule("- host: vm\n"), 5, "host 'vm' is a single-label name, which the gateway never"),
    ("deny-single-label", "version: 1\nprofiles:\n  default:\n    deny:\n      - host: localhost\n", 5, "single-label"),
    ("host-ipv4-odd-spelling", rule("- host: 0x7f.1\n"), 5, "use 'cidr: 127.0.0.1/32'"),
    ("host-ipv6", rule('- host: "[fd00::1]"\n'), 5, "use 'cidr: fd00::1/128'"),
    ("wildcard-over-ip", rule('- host: "*.10.0.0.1"\n'), 5, "IP address"),
    ("host-with-space", rule('- host: "a b.example.com"\n'), 5, "host:"),
    ("host-with-userinfo", rule('- host: "user@a.example.com"\n'), 5, "host:"),
    ("host-invalid-idna", rule('- host: "a\\u200db.example.com"\n'), 5, "invalid internationalized name"),
    ("host-label-too-long", rule(f"- host: {'a' * 64}.example.com\n"), 5, "invalid label"),
    ("host-null", rule("- host:\n"), 5, "host must be a single value"),
    # --- what belongs elsewhere than in `host:` is named, with the rule to write
    (
        "host-url",
        rule('- host: "https://pypi.org/simple"\n'),
        5,
        "host 'https://pypi.org/simple' looks like a URL: write the host alone, as in {host: pypi.org}",
    ),
    ("host-url-with-port", rule('- host: "https://pypi.org:8443/x"\n'), 5, "{host: pypi.org, ports: [8443]}"),
    ("host-url-without-scheme", rule("- host: pypi.org/simple\n"), 5, "looks like a URL"),
    ("host-url-without-host", rule('- host: "https://"\n'), 5, "looks like a URL: write the host alone"),
    (
        "host-with-port",
        rule("- host: pypi.org:443\n"),
        5,
        "host 'pypi.org:443' has a port: ports go in 'ports:', as in {host: pypi.org, ports: [443]}",
    ),
    ("host-network", rule("- host: 10.0.0.0/8\n"), 5, "host '10.0.0.0/8' is a network: write it as {cidr: 10.0.0.0/8}"),
    (
        "wildcard-unquoted",
        rule("- host: *.pythonhosted.org\n"),
        5,
        "*.pythonhosted.org is read as a YAML alias (a value that starts with '*'): quote it, as in "
        '"*.pythonhosted.org"',
    ),
    ("wildcard-unquoted-in-flow", rule("- {host: *.x.org, ports: [443]}\n"), 5, 'quote it, as in "*.x.org"'),
    ("glob-unquoted", rule("- host: a.example.com\n- host: *x\n"), 6, 'quote it, as in "*x"'),
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
    ("cidr-zone-id", rule("- cidr: 'fd12::%eth0/64'\n"), 5, "zone IDs"),
    ("cidr-oci-classic", rule("- cidr: 192.0.0.192/32\n"), 5, "covers cloud metadata"),
    ("cidr-ietf-192.0.0/24", rule("- cidr: 192.0.0.0/24\n"), 5, "covers cloud metadata"),
    ("cidr-gcp-v6", rule("- cidr: fd20:ce::254/128\n"), 5, "covers cloud metadata"),
    ("cidr-gcp-v6-around", rule("- cidr: fd20:ce::/64\n"), 5, "covers cloud metadata"),
    ("cidr-oracle-v6", rule("- cidr: fd00:c1::a9fe:a9fe/128\n"), 5, "covers cloud metadata"),
    ("cidr-oracle-v6-around", rule("- cidr: fd00:c1::/32\n"), 5, "covers cloud metadata"),
    ("cidr-mapped", rule('- cidr: "::ffff:0:0/96"\n'), 5, "IPv6 forms of IPv4 addresses"),
    ("cidr-over-mapped", rule('- cidr: "::fffe:0:0/95"\n'), 5, "covers ::ffff:0:0/96"),
    ("cidr-siit", rule('- cidr: "::ffff:0:0:0/96"\n'), 5, "covers ::ffff:0:0:0/96"),
    ("cidr-siit-part", rule('- cidr: "::ffff:0:a00:0/104"\n'), 5, "IPv6 forms of IPv4 addresses"),
    ("cidr-siit-metadata", rule('- cidr: "::ffff:0:a9fe:a9fe/128"\n'), 5, "IPv6 forms of IPv4 addresses"),
    ("cidr-v4-compatible", rule('- cidr: "::a00:0/104"\n'), 5, "IPv6 forms of IPv4 addresses"),
    ("cidr-nat64", rule("- cidr: 64:ff9b::/96\n"), 5, "IPv6 forms of IPv4 addresses"),
    ("cidr-6to4", rule("- cidr: 2002:a00::/24\n"), 5, "IPv6 forms of IPv4 addresses"),
    ("cidr-over-6to4", rule("- cidr: 2000::/3\n"), 5, "covers 2002::/16"),
    ("cidr-teredo", rule("- cidr: 2001::/32\n"), 5, "Teredo"),
    ("cidr-teredo-part", rule("- cidr: 2001:0:4136:e378::/64\n"), 5, "Teredo"),
    ("cidr-over-teredo", rule("- cidr: 2001::/16\n"), 5, "Teredo"),
    ("cidr-local-nat64", rule("- cidr: 64:ff9b:1::/48\n"), 5, "local-use NAT64"),
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
    # str.isdigit() and int() accept these; a port is ASCII decimal only
    ("port-superscript", port('!!int "\u00b2"'), 6, "plain decimal"),
    ("port-arabic-indic", port('!!int "\u0664\u0664\u0663"'), 6, "plain decimal"),
    ("port-fullwidth", port('!!int "\uff14\uff14\uff13"'), 6, "plain decimal"),
    ("port-tagged-space", port('!!int " 443"'), 6, "plain decimal"),
    ("port-tagged-word", port("!!int https"), 6, "plain decimal"),
    ("port-underscore", port("4_43"), 6, "plain decimal"),
    ("port-plus", port("+443"), 6, "plain decimal"),
    ("port-sexagesimal", port("7:23"), 6, "plain decimal"),
    ("port-huge", port("9" * 5000), 6, "out of range"),
    ("port-long-zeros", port("0" * 5000 + "1"), 6, "plain decimal"),
    ("port-list", port("[443]"), 6, "port must be a number, not a list"),
    ("port-mapping", port("{a: 1}"), 6, "port must be a number, not a mapping"),
    ("port-null", port("~"), 6, "port '~' is not a number"),
    ("port-tagged-str-list", port("!!str [443]"), 6, "not a list"),
    ("port-self-alias", rule("- host: a.example.com\n  ports: &p [*p]\n"), 6, "not a list"),
    # --- tunnel
    ("tunnel-string", rule("- host: a.example.com\n  tunnel: maybe\n"), 6, "tunnel must be true or false"),
    ("tunnel-quoted-true", rule('- host: a.example.com\n  tunnel: "true"\n'), 6, "tunnel must be true or false"),
    ("tunnel-int", rule("- host: a.example.com\n  tunnel: 1\n"), 6, "tunnel must be true or false"),
    ("tunnel-on-deny", rule("- host: a.example.com\n  tunnel: true\n", "deny"), 6, "only meaningful on allow"),
    ("ech-on-deny", rule("- host: a.example.com\n  ech: true\n", "deny"), 6, "ech is only meaningful on allow"),
    ("ech-string", rule("- host: a.example.com\n  ech: grease\n"), 6, "ech must be true or false"),
    ("tunnel-tagged-list", rule("- host: a.example.com\n  tunnel: !!bool [x]\n"), 6, "tunnel must be true or false"),
    ("tunnel-tagged-map", rule("- host: a.example.com\n  tunnel: !!bool {a: b}\n"), 6, "tunnel must be true or false"),
    ("tunnel-tagged-word", rule("- host: a.example.com\n  tunnel: !!bool maybe\n"), 6, "tunnel must be true or false"),
    ("tunnel-list", rule("- host: a.example.com\n  tunnel: [true]\n"), 6, "tunnel must be true or false"),
    ("tunnel-null", rule("- host: a.example.com\n  tunnel:\n"), 6, "tunnel must be true or false"),
    ("tunnel-bad-on-deny", rule("- host: a.example.com\n  tunnel: [x]\n", "deny"), 6, "tunnel must be true or false"),
    # --- dns limits
    ("dns-not-mapping", dns("[]\n").replace("dns:\n      ", "dns: "), 4, "dns must be a mapping"),
    ("refuse-tagged-map", dns("refuse_suspicious: !!bool {a: b}\n"), 5, "refuse_suspicious must be true or false"),
    ("refuse-tagged-list", dns("refuse_suspicious: !!bool [x]\n"), 5, "refuse_suspicious must be true or false"),
    ("refuse-tagged-word", dns("refuse_suspicious: !!bool y\n"), 5, "refuse_suspicious must be true or false"),
    ("refuse-quoted", dns('refuse_suspicious: "true"\n'), 5, "refuse_suspicious must be true or false"),
    ("refuse-alias-list", dns("max_label_length: 40\nrefuse_suspicious: &r [*r]\n"), 6, "must be true or false"),
    ("entropy-inf", dns("max_label_entropy: inf\n"), 5, "max_label_entropy must be a plain decimal number"),
    ("entropy-yaml-inf", dns("max_label_entropy: .inf\n"), 5, "plain decimal number"),
    ("entropy-yaml-minus-inf", dns("max_label_entropy: -.inf\n"), 5, "plain decimal number"),
    ("entropy-tagged-inf", dns("max_label_entropy: !!float inf\n"), 5, "plain decimal number"),
    ("entropy-nan", dns("max_label_entropy: nan\n"), 5, "plain decimal number"),
    ("entropy-yaml-nan", dns("max_label_entropy: .nan\n"), 5, "plain decimal number"),
    ("entropy-tagged-nan", dns("max_label_entropy: !!float nan\n"), 5, "plain decimal number"),
    ("entropy-exponent", dns("max_label_entropy: 1.0e+400\n"), 5, "plain decimal number"),
    ("entropy-many-digits", dns(f"max_label_entropy: {'9' * 400}.0\n"), 5, "greater than 0 and at most 6"),
    ("entropy-zero", dns("max_label_entropy: 0.0\n"), 5, "greater than 0"),
    ("entropy-negative", dns("max_label_entropy: -1.0\n"), 5, "plain decimal number"),
    ("entropy-above-6", dns("max_label_entropy: 6.5\n"), 5, "at most 6"),
    ("entropy-quoted", dns('max_label_entropy: "4.0"\n'), 5, "plain decimal number"),
    ("entropy-list", dns("max_label_entropy: [4.0]\n"), 5, "plain decimal number"),
    ("entropy-null", dns("max_label_entropy:\n"), 5, "plain decimal number"),
    (
        "length-arabic-indic",
        dns("max_label_length: \u0664\u0660\n"),
        5,
        "max_label_length must be a plain decimal integer",
    ),
    ("length-tagged-arabic-indic", dns('max_label_length: !!int "\u0664\u0660"\n'), 5, "plain decimal integer"),
    ("length-float", dns("max_label_length: 40.0\n"), 5, "plain decimal integer"),
    ("length-underscore", dns("max_label_length: 4_0\n"), 5, "plain decimal integer"),
    ("length-hex", dns("max_label_length: 0x28\n"), 5, "plain decimal integer"),
    ("length-zero", dns("max_label_length: 0\n"), 5, "greater than 0"),
    ("length-64", dns("max_label_length: 64\n"), 5, "at most 63"),
    ("length-huge", dns(f"max_label_length: {'9' * 5000}\n"), 5, "at most 63"),
    ("length-mapping", dns("max_label_length: {a: 1}\n"), 5, "plain decimal integer"),
    ("subdomains-too-many", dns("max_new_subdomains_per_minute: 1000001\n"), 5, "at most 1000000"),
    ("subdomains-negative", dns("max_new_subdomains_per_minute: -1\n"), 5, "plain decimal integer"),
    # --- rule shape
    ("host-and-cidr", rule("- host: a.example.com\n  cidr: 10.0.0.1/32\n"), 5, "exactly one of 'host' or 'cidr'"),
    ("neither-host-nor-cidr", rule("- ports: [443]\n"), 5, "exactly one of 'host' or 'cidr'"),
    ("empty-rule", rule("- {}\n"), 5, "exactly one of 'host' or 'cidr'"),
    ("comment-only-rule", rule("- comment: just a note\n"), 5, "exactly one of 'host' or 'cidr'"),
    ("name-not-scalar", rule("- host: a.example.com\n  name: [x]\n"), 6, "name must be a single value"),
    ("comment-not-scalar", rule("- host: a.example.com\n  comment: {a: b}\n"), 6, "comment must be a single value"),
    ("description-not-scalar", "profiles:\n  default:\n    description: [x]\n", 3, "description must be a single"),
    # --- odd nodes where a text value is expected
    ("host-tagged-list", rule("- host: !!str [a.example.com]\n"), 5, "host must be a single value, not a list"),
    ("host-mapping", rule("- host: {a: b}\n"), 5, "host must be a single value, not a mapping"),
    ("host-application-tag", rule("- host: !secret a.example.com\n"), 5, "not a value tagged !secret"),
    ("host-tagged-null", rule("- host: !!null a.example.com\n"), 5, "host must be a single value, not null"),
    ("host-with-newline", rule('- host: "a.example.com\\n"\n'), 5, "forbidden character"),
    ("host-ip-with-newline", rule('- host: "127.0.0.1\\n"\n'), 5, "forbidden character"),
    ("key-tagged-null", rule("- !!null host: a.example.com\n"), 5, "keys must be plain strings"),
    # --- explicit tags that disagree with the node (safe_load refuses them too)
    ("ports-tagged-int-list", rule("- host: a.example.com\n  ports: !!int [443]\n"), 6, "non-empty list"),
    ("ports-application-tag", rule("- host: a.example.com\n  ports: !secret [443]\n"), 6, "non-empty list"),
    ("allow-tagged-str-list", "profiles:\n  default:\n    allow: !!str [{host: a.example.com}]\n", 3, "list of rules"),
    ("rule-tagged-set", rule("- !!set {host: a.example.com}\n"), 5, "allow rule must be a mapping"),
    ("profile-application-tag", "profiles:\n  default: !p {}\n", 2, "profile 'default' must be a mapping"),
    ("profiles-tagged-omap", "profiles: !!omap [{default: {}}]\n", 1, "profiles must be a mapping"),
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
    ("ech-true", rule("- host: a.example.com\n  ech: true\n")),
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
    ("cidr-ietf-without-oci-classic", rule("- cidr: 192.0.0.0/25\n")),
    ("cidr-gcp-v6-neighbour", rule("- cidr: fd20:ce::253/128\n")),
    ("cidr-public-v6", rule("- cidr: 2001:4860::/32\n")),
    ("cidr-after-teredo", rule("- cidr: 2001:1::/32\n")),
    ("deny-cidr-teredo", rule("- cidr: 2001::/32\n", "deny")),
    ("deny-cidr-siit", rule('- cidr: "::ffff:0:0:0/96"\n', "deny")),
    ("deny-cidr-gcp-v6", rule("- cidr: fd20:ce::254/128\n", "deny")),
    ("port-max", port("65535")),
    ("tunnel-tagged-true", rule("- host: a.example.com\n  tunnel: !!bool true\n")),
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


# (id, dns block, the limits it gives)
DNS_VALID = [
    ("none", "{}", DnsLimits()),
    ("upper-edges", "{max_label_length: 63, max_label_entropy: 6, max_new_subdomains_per_minute: 1000000}", None),
    ("lower-edges", "{max_label_length: 1, max_label_entropy: 0.1, max_new_subdomains_per_minute: 1}", None),
    ("refuse-yes", "{refuse_suspicious: yes}", DnsLimits(refuse=True)),
    ("refuse-off", "{refuse_suspicious: off}", DnsLimits(refuse=False)),
    ("entropy-int", "{max_label_entropy: 4}", DnsLimits(max_label_entropy=4.0)),
    ("entropy-decimal", "{max_label_entropy: 3.25}", DnsLimits(max_label_entropy=3.25)),
]


@pytest.mark.parametrize(("block", "expected"), [d[1:] for d in DNS_VALID], ids=[d[0] for d in DNS_VALID])
def test_dns_limits(block: str, expected: DnsLimits | None) -> None:
    limits = parse_policy(f"profiles:\n  default:\n    dns: {block}\n", F).profile().dns
    if expected is not None:
        assert limits == expected
    assert isinstance(limits.max_label_entropy, float)
    assert isinstance(limits.max_label_length, int) and isinstance(limits.max_new_subdomains_per_minute, int)


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
    (7, "would allow every host"),
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


def test_all_errors_reported_in_line_order() -> None:
    errors = errors_of(MANY_ERRORS)
    got = [(int(e.split(":")[1]), e) for e in errors]  # line 3's error is found last, but reported in its place
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
    ("default.yaml", None, "registry.npmjs.org", 443, False),
    ("default.yaml", "npm", "registry.npmjs.org", 443, True),
    ("default.yaml", "npm", "codeload.github.com", 443, True),
    ("default.yaml", "npm", "pypi.org", 443, False),
    ("default.yaml", "npm", "gist.githubusercontent.com", 443, False),
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


# --- odd YAML nodes everywhere a value is expected, and fuzzing: PolicyError with file:line, never a crash ---------

# Valid YAML whose node kind is wrong wherever a single value is expected: lists, mappings, nulls, aliases (to a list,
# a mapping, or a node containing itself), and explicit tags on any of them. (id, YAML, line of the error when it is
# not the slot's own: an alias is the node it names, so the error names the line where that node is written.)
ODD_NODES = [
    ("list", "[x]", None),
    ("empty-list", "[]", None),
    ("mapping", "{a: b}", None),
    ("empty-mapping", "{}", None),
    ("null", "~", None),
    ("empty", "", None),
    ("alias-to-list", "*l", 4),
    ("alias-to-mapping", "*m", 2),
    ("self-alias-list", "&s [*s]", None),
    ("self-alias-mapping", "&s {k: *s}", None),
    ("tagged-bool-list", "!!bool [x]", None),
    ("tagged-bool-mapping", "!!bool {a: b}", None),
    ("tagged-int-list", "!!int [1]", None),
    ("tagged-str-mapping", "!!str {a: 1}", None),
    ("tagged-null", "!!null x", None),
    ("application-tag", "!secret x", None),
    ("application-tag-list", "!secret [x]", None),
]
# Anchors the aliases above refer to: an empty profile `a` (line 2) and an empty deny list (line 4), both valid.
_ODD_HEAD = "profiles:\n  a: &m {}\n  default:\n    deny: &l []\n"
# (slot id, text after _ODD_HEAD with ODD on its last line, a valid value for ODD)
ODD_SLOTS = [
    ("version", "version: ODD\n", "1"),
    ("default_profile", "default_profile: ODD\n", "default"),
    ("description", "    description: ODD\n", "hi"),
    ("host", "    allow:\n      - host: ODD\n", "a.example.com"),
    ("cidr", "    allow:\n      - cidr: ODD\n", "10.1.2.3/32"),
    ("ports", "    allow:\n      - host: a.example.com\n        ports: ODD\n", "[443]"),
    ("port", "    allow:\n      - host: a.example.com\n        ports: [ODD]\n", "443"),
    ("tunnel", "    allow:\n      - host: a.example.com\n        tunnel: ODD\n", "true"),
    ("name", "    allow:\n      - host: a.example.com\n        name: ODD\n", "cache"),
    ("comment", "    allow:\n      - host: a.example.com\n        comment: ODD\n", "why"),
    ("refuse_suspicious", "    dns:\n      refuse_suspicious: ODD\n", "true"),
    ("max_label_length", "    dns:\n      max_label_length: ODD\n", "40"),
    ("max_label_entropy", "    dns:\n      max_label_entropy: ODD\n", "4.0"),
    ("max_new_subdomains_per_minute", "    dns:\n      max_new_subdomains_per_minute: ODD\n", "60"),
]


def _line_of(error: str) -> int:
    match = re.match(rf"{re.escape(F)}:(\d+): ", error)
    assert match, error
    return int(match.group(1))


@pytest.mark.parametrize(("slot", "valid"), [s[1:] for s in ODD_SLOTS], ids=[s[0] for s in ODD_SLOTS])
def test_odd_slots_load_with_a_valid_value(slot: str, valid: str) -> None:
    parse_policy(_ODD_HEAD + slot.replace("ODD", valid), F)  # so the errors below come from the odd node alone


@pytest.mark.parametrize("loader_class", [yaml.SafeLoader, loader._YAML_LOADER], ids=["python", "default"])
@pytest.mark.parametrize(("odd", "line"), [o[1:] for o in ODD_NODES], ids=[o[0] for o in ODD_NODES])
@pytest.mark.parametrize("slot", [s[1] for s in ODD_SLOTS], ids=[s[0] for s in ODD_SLOTS])
def test_odd_node_where_a_value_is_expected(
    monkeypatch: pytest.MonkeyPatch, loader_class: type, slot: str, odd: str, line: int | None
) -> None:
    monkeypatch.setattr(loader, "_YAML_LOADER", loader_class)
    text = _ODD_HEAD + slot.replace("ODD", odd)
    errors = errors_of(text)
    assert {_line_of(e) for e in errors} == {line or len(text.splitlines())}, errors


# Mutations of the shipped example: odd tags, anchors, flow collections, odd numbers, deleted/duplicated/shifted
# lines, random characters. Fixed seed: the same cases every run.
_FUZZ_TOKENS = [
    *(o[1] for o in ODD_NODES),
    *("!!bool", "!!int", "!!float", "!!str", "!!binary", "&a", "*a", "<<:", "? ", "- ", ": ", "'", '"', "|", "---"),
    *("inf", ".inf", ".nan", "-1", "0", "99999", "0x1bb", "0443", "1_000", "7:23", "maybe", "1.0e+400", "9" * 5000),
    *('!!int "\u00b2"', '!!int "\u0664\u0664\u0663"', '"a\\nb"', "\u00a0", "\u2028", "2001::/32", "::/0"),
]


def _mutate(text: str, rng: random.Random) -> str:
    lines = text.splitlines(keepends=True)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(lines))
        token = rng.choice(_FUZZ_TOKENS)
        match rng.randrange(6):
            case 0 if ":" in lines[i]:  # replace a value
                lines[i] = lines[i].partition(":")[0] + ": " + token + "\n"
            case 1:  # insert a token anywhere
                j = rng.randint(0, len(lines[i]))
                lines[i] = lines[i][:j] + token + " " + lines[i][j:]
            case 2 if len(lines) > 1:
                del lines[i]
            case 3:
                lines.insert(i, rng.choice(lines))
            case 4:
                lines[i] = " " * rng.choice([1, 2, 4]) + lines[i]
            case _ if lines[i]:  # one random character
                j = rng.randrange(len(lines[i]))
                char = chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x3000)]))
                lines[i] = lines[i][:j] + char + lines[i][j + 1 :]
    return "".join(lines)


# The shipped example without its comments, plus a dns block: every key the loader knows, for the mutations to hit.
_FUZZ_SEED = "".join(
    line
    for line in (CONFIGS / "policy.example.yaml").read_text(encoding="utf-8").splitlines(keepends=True)
    if line.strip() and not line.lstrip().startswith("#")
) + textwrap.indent(
    "dns:\n  refuse_suspicious: true\n  max_label_length: 40\n  max_label_entropy: 4.0\n"
    "  max_new_subdomains_per_minute: 60\n",
    "    ",
)


def test_fuzz_seed_is_valid() -> None:
    assert parse_policy(_FUZZ_SEED, F).profile("internal-service").dns.refuse


def test_fuzzed_example_never_crashes() -> None:
    rng = random.Random(20240601)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(400):
        text = _mutate(_FUZZ_SEED, rng)
        try:
            parse_policy(text, F)
            outcomes["ok"] += 1
        except PolicyError as e:
            assert e.errors and all(_line_of(error) >= 1 for error in e.errors), text
            assert not any("cannot load policy" in error for error in e.errors), (e.errors, text)
            outcomes["error"] += 1
    assert outcomes["ok"] and outcomes["error"]  # the mutations exercise both paths


def test_unexpected_exception_becomes_policy_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(raw: str) -> str:
        raise RuntimeError("boom")

    monkeypatch.setattr(loader, "canonical_host", broken)
    monkeypatch.setattr(fastload, "read_common", lambda text, filename: None)  # the full loader's host check
    assert errors_of(rule("- host: a.example.com\n")) == [f"{F}:1: cannot load policy: RuntimeError: boom"]
    monkeypatch.undo()
    monkeypatch.setattr(fastload, "_is_canonical_name", broken)  # the fast path's
    assert errors_of(rule("- host: a.example.com\n")) == [f"{F}:1: cannot load policy: RuntimeError: boom"]


def test_deep_nesting_under_the_python_yaml_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without libyaml, PyYAML's composer recurses per level and raises RecursionError, not a YAMLError.
    monkeypatch.setattr(loader, "_YAML_LOADER", yaml.SafeLoader)
    text = "profiles:\n" + "".join(" " * (2 * depth) + "- \n" for depth in range(1, 1000))
    assert errors_of(text)[0].startswith(f"{F}:")


def test_nul_in_path_is_a_policy_error() -> None:
    with pytest.raises(PolicyError) as info:
        load_policy("bad\x00name.yaml")
    assert "cannot read policy" in info.value.errors[0]
