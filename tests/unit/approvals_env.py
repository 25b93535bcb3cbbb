"""The policy the approvals tests hold requests under (gateway/test_approvals_desk.py, and on a fleet's shared
store gateway/test_approvals_fleet.py): one profile that asks for whatever it does not list, one sandbox."""

from __future__ import annotations

import ipaddress

from airlock.policy import LivePolicy, Sandbox, SandboxRegistry, parse_policy

POLICY_TEXT = """\
version: 1
profiles:
  default:
    on_unlisted: ask  # hold it
    allow:
      - host: listed.test
"""
POLICY = parse_policy(POLICY_TEXT, "p.yaml")
SANDBOX = Sandbox("sbx", "default", ipaddress.ip_network("10.9.0.2/32"))
LIVE = LivePolicy(POLICY, SandboxRegistry([SANDBOX]))
