"""The mitmproxy addon that enforces the policy on every upstream connection."""
