"""The decision tables: decide()'s answer for each target and vet()'s for each set of resolved addresses under one
policy, which test_decide checks in enforce mode and test_report_mode in report mode."""

from __future__ import annotations

from airlock.policy import ReasonCode

POLICY = """\
version: 1
profiles:
  default:
    allow:
      - host: exact.example.org              # line 5
      - host: "*.example.com"                # line 6
      - host: web.example.org                # line 7
        ports: [80, 443]
      - host: ssh.example.org                # line 9
        ports: [22]
        tunnel: true
      - host: both.example.org               # line 12
      - host: inner.blocked.example.com      # line 13
      - cidr: 10.1.2.3/32                    # line 14
        ports: [22, 443]
        name: service
      - cidr: 198.51.100.0/24                # line 17
      - cidr: fd12:3456::/32                 # line 18
        ports: [8443]
    deny:
      - host: both.example.org               # line 21
      - host: "*.blocked.example.com"        # line 22
      - host: web.example.org                # line 23
        ports: [80]
      - cidr: 198.51.100.66/32               # line 25
      - cidr: 10.1.2.0/24                    # line 26
        ports: [22]
"""
ALLOWED, NOT_ALLOWLISTED, PORT_NOT_ALLOWED = ReasonCode.ALLOWED, ReasonCode.NOT_ALLOWLISTED, ReasonCode.PORT_NOT_ALLOWED
DENIED_BY_RULE, INTERNAL_ADDRESS, METADATA = ReasonCode.DENIED_BY_RULE, ReasonCode.INTERNAL_ADDRESS, ReasonCode.METADATA
OWN_ADDRESS, SANDBOX_LINK = ReasonCode.OWN_ADDRESS, ReasonCode.SANDBOX_LINK
NO_ADDRESS, NO_ADDRESS_LEFT = ReasonCode.NO_ADDRESS, ReasonCode.NO_ADDRESS_LEFT

# (id, raw target, port, code (allowed or why not), source line of the deciding rule or None)
DECISIONS = [
    ("default-deny", "other.example.net", 443, NOT_ALLOWLISTED, None),
    ("default-deny-apex-lookalike", "xexample.com", 443, NOT_ALLOWLISTED, None),
    ("default-deny-suffix-trick", "example.com.evil.test", 443, NOT_ALLOWLISTED, None),
    ("exact", "exact.example.org", 443, ALLOWED, 5),
    ("exact-case-and-dot", "EXACT.Example.ORG.", 443, ALLOWED, 5),
    ("exact-not-subdomain", "a.exact.example.org", 443, NOT_ALLOWLISTED, None),
    ("exact-not-parent", "example.org", 443, NOT_ALLOWLISTED, None),
    ("allow-default-port-443-only", "exact.example.org", 80, PORT_NOT_ALLOWED, None),
    ("allow-default-not-8443", "exact.example.org", 8443, PORT_NOT_ALLOWED, None),
    ("wildcard-one-label", "a.example.com", 443, ALLOWED, 6),
    ("wildcard-two-labels", "a.b.example.com", 443, ALLOWED, 6),
    ("wildcard-not-apex", "example.com", 443, NOT_ALLOWLISTED, None),
    ("wildcard-port", "a.example.com", 80, PORT_NOT_ALLOWED, None),
    ("explicit-ports-80", "web.example.org", 443, ALLOWED, 7),
    ("deny-port-wins", "web.example.org", 80, DENIED_BY_RULE, 23),
    ("deny-wins-exact", "both.example.org", 443, DENIED_BY_RULE, 21),
    ("deny-default-every-port", "both.example.org", 8080, DENIED_BY_RULE, 21),
    ("wildcard-deny-over-wildcard-allow", "x.blocked.example.com", 443, DENIED_BY_RULE, 22),
    ("wildcard-deny-over-exact-allow", "inner.blocked.example.com", 443, DENIED_BY_RULE, 22),
    ("wildcard-deny-not-apex", "blocked.example.com", 443, ALLOWED, 6),
    ("tunnel-port", "ssh.example.org", 22, ALLOWED, 9),
    ("tunnel-other-port", "ssh.example.org", 443, PORT_NOT_ALLOWED, None),
    ("cidr-internal-on-its-port", "10.1.2.3", 443, ALLOWED, 14),
    ("cidr-internal-odd-spelling", "0xa010203", 443, ALLOWED, 14),
    ("cidr-internal-short-spelling", "10.66051", 443, ALLOWED, 14),
    ("cidr-internal-mapped", "::ffff:10.1.2.3", 443, ALLOWED, 14),
    ("cidr-internal-other-port", "10.1.2.3", 80, INTERNAL_ADDRESS, None),
    ("cidr-deny-port-wins", "10.1.2.3", 22, DENIED_BY_RULE, 26),
    ("cidr-internal-neighbour", "10.1.2.4", 443, INTERNAL_ADDRESS, None),
    ("cidr-public", "198.51.100.7", 443, ALLOWED, 17),
    ("cidr-public-decimal", "3325256711", 443, ALLOWED, 17),
    ("cidr-public-default-port", "198.51.100.7", 80, NOT_ALLOWLISTED, None),
    ("deny-cidr", "198.51.100.66", 443, DENIED_BY_RULE, 25),
    ("deny-cidr-mapped", "::ffff:198.51.100.66", 443, DENIED_BY_RULE, 25),
    ("public-ip-without-rule", "203.0.113.9", 443, NOT_ALLOWLISTED, None),
    ("cidr-v6-ula", "[fd12:3456::1]", 8443, ALLOWED, 18),
    ("cidr-v6-ula-other-port", "fd12:3456::1", 443, INTERNAL_ADDRESS, None),
    ("ula-outside-rule", "fd12:3457::1", 8443, INTERNAL_ADDRESS, None),
    ("loopback", "127.0.0.1", 443, INTERNAL_ADDRESS, None),
    ("loopback-decimal", "2130706433", 443, INTERNAL_ADDRESS, None),
    ("loopback-hex-short", "0x7f.1", 443, INTERNAL_ADDRESS, None),
    ("loopback-v6", "[::1]", 443, INTERNAL_ADDRESS, None),
    ("loopback-mapped", "::ffff:127.0.0.1", 443, INTERNAL_ADDRESS, None),
    ("metadata", "169.254.169.254", 80, METADATA, None),
    ("metadata-hex", "0xa9fea9fe", 80, METADATA, None),
    ("metadata-octal", "0251.0376.0251.0376", 80, METADATA, None),
    ("metadata-mapped", "::ffff:169.254.169.254", 80, METADATA, None),
    ("metadata-nat64", "64:ff9b::a9fe:a9fe", 80, METADATA, None),
    ("metadata-v6", "fd00:ec2::254", 80, METADATA, None),
    ("rfc1918", "192.168.1.1", 443, INTERNAL_ADDRESS, None),
    ("cidr-internal-siit", "::ffff:0:a01:203", 443, ALLOWED, 14),
    ("metadata-siit", "::ffff:0:a9fe:a9fe", 80, METADATA, None),
    ("loopback-siit", "::ffff:0:7f00:1", 443, INTERNAL_ADDRESS, None),
    ("metadata-gcp-v6", "[fd20:ce::254]", 80, METADATA, None),
    ("metadata-oracle-v6", "fd00:c1::a9fe:a9fe", 80, METADATA, None),
    ("metadata-oci-classic", "192.0.0.192", 80, METADATA, None),
    ("v6-unallocated", "4000::1", 443, INTERNAL_ADDRESS, None),
    ("v6-srv6", "5f00::1", 443, INTERNAL_ADDRESS, None),
    ("v6-documentation-3fff", "3fff::1", 443, INTERNAL_ADDRESS, None),
    ("v6-ietf-anycast", "2001:1::1", 443, INTERNAL_ADDRESS, None),
]

# (id, resolved addresses, port, expected allowed, expected rejected with their codes, the answer's code)
VETS = [
    ("public", ["192.0.2.1", "203.0.113.5"], 443, ["192.0.2.1", "203.0.113.5"], [], ALLOWED),
    ("public-v6", ["2606:4700::1111"], 443, ["2606:4700::1111"], [], ALLOWED),
    (
        "mixed-keeps-public",
        ["192.0.2.1", "10.0.0.1", "127.0.0.1"],
        443,
        ["192.0.2.1"],
        [("10.0.0.1", INTERNAL_ADDRESS), ("127.0.0.1", INTERNAL_ADDRESS)],
        ALLOWED,
    ),
    ("metadata", ["169.254.169.254"], 80, [], [("169.254.169.254", METADATA)], METADATA),
    (
        "metadata-mixed",
        ["192.0.2.1", "169.254.169.254", "fd00:ec2::254"],
        80,
        ["192.0.2.1"],
        [("169.254.169.254", METADATA), ("fd00:ec2::254", METADATA)],
        ALLOWED,
    ),
    (
        "rfc1918-only",
        ["10.0.0.1", "172.16.0.1", "192.168.0.1"],
        443,
        [],
        [("10.0.0.1", INTERNAL_ADDRESS), ("172.16.0.1", INTERNAL_ADDRESS), ("192.168.0.1", INTERNAL_ADDRESS)],
        INTERNAL_ADDRESS,
    ),
    (
        "ula-and-link-local",
        ["fd12::1", "fe80::1"],
        443,
        [],
        [("fd12::1", INTERNAL_ADDRESS), ("fe80::1", METADATA)],
        NO_ADDRESS_LEFT,
    ),
    ("mapped-internal", ["::ffff:10.0.0.1"], 443, [], [("::ffff:10.0.0.1", INTERNAL_ADDRESS)], INTERNAL_ADDRESS),
    ("mapped-loopback", ["::ffff:127.0.0.1"], 443, [], [("::ffff:127.0.0.1", INTERNAL_ADDRESS)], INTERNAL_ADDRESS),
    ("nat64-internal", ["64:ff9b::a00:1"], 443, [], [("64:ff9b::a00:1", INTERNAL_ADDRESS)], INTERNAL_ADDRESS),
    ("6to4-internal", ["2002:a00:1::"], 443, [], [("2002:a00:1::", INTERNAL_ADDRESS)], INTERNAL_ADDRESS),
    ("mapped-public", ["::ffff:192.0.2.1"], 443, ["::ffff:192.0.2.1"], [], ALLOWED),
    ("cidr-opens-internal-on-its-port", ["10.1.2.3"], 443, ["10.1.2.3"], [], ALLOWED),
    ("cidr-opens-mapped-on-its-port", ["::ffff:10.1.2.3"], 443, ["::ffff:10.1.2.3"], [], ALLOWED),
    ("cidr-closed-on-other-port", ["10.1.2.3"], 80, [], [("10.1.2.3", INTERNAL_ADDRESS)], INTERNAL_ADDRESS),
    ("cidr-deny-port", ["10.1.2.3"], 22, [], [("10.1.2.3", DENIED_BY_RULE)], DENIED_BY_RULE),
    ("cidr-neighbour", ["10.1.2.4"], 443, [], [("10.1.2.4", INTERNAL_ADDRESS)], INTERNAL_ADDRESS),
    (
        "deny-cidr-on-public",
        ["198.51.100.66", "198.51.100.67"],
        443,
        ["198.51.100.67"],
        [("198.51.100.66", DENIED_BY_RULE)],
        ALLOWED,
    ),
    ("own-address", ["192.0.2.53", "192.0.2.54"], 443, ["192.0.2.54"], [("192.0.2.53", OWN_ADDRESS)], ALLOWED),
    ("own-address-mapped", ["::ffff:192.0.2.53"], 443, [], [("::ffff:192.0.2.53", OWN_ADDRESS)], OWN_ADDRESS),
    ("own-address-v6", ["2001:db8::53"], 443, [], [("2001:db8::53", OWN_ADDRESS)], OWN_ADDRESS),
    ("unspecified", ["0.0.0.0", "::"], 443, [], [("0.0.0.0", OWN_ADDRESS), ("::", OWN_ADDRESS)], OWN_ADDRESS),
    ("duplicates-once", ["192.0.2.1", "192.0.2.1"], 443, ["192.0.2.1"], [], ALLOWED),
    ("empty", [], 443, [], [], NO_ADDRESS),
    ("siit-metadata", ["::ffff:0:a9fe:a9fe"], 80, [], [("::ffff:0:a9fe:a9fe", METADATA)], METADATA),
    ("siit-loopback", ["::ffff:0:7f00:1"], 443, [], [("::ffff:0:7f00:1", INTERNAL_ADDRESS)], INTERNAL_ADDRESS),
    ("cidr-opens-siit-on-its-port", ["::ffff:0:a01:203"], 443, ["::ffff:0:a01:203"], [], ALLOWED),
    (
        "cloud-metadata-v6-and-oci",
        ["192.0.2.1", "fd20:ce::254", "fd00:c1::a9fe:a9fe", "192.0.0.192"],
        80,
        ["192.0.2.1"],
        [("fd20:ce::254", METADATA), ("fd00:c1::a9fe:a9fe", METADATA), ("192.0.0.192", METADATA)],
        ALLOWED,
    ),
    (
        "v6-outside-global-unicast",
        ["4000::1", "5f00::1", "8000::1", "2606:4700::1111"],
        443,
        ["2606:4700::1111"],
        [("4000::1", INTERNAL_ADDRESS), ("5f00::1", INTERNAL_ADDRESS), ("8000::1", INTERNAL_ADDRESS)],
        ALLOWED,
    ),
    (
        "v6-special-in-2000::/3",
        ["2001:1::1", "2001:20::1", "3fff::1", "2001:4860::1"],
        443,
        ["2001:4860::1"],
        [("2001:1::1", INTERNAL_ADDRESS), ("2001:20::1", INTERNAL_ADDRESS), ("3fff::1", INTERNAL_ADDRESS)],
        ALLOWED,
    ),
]
