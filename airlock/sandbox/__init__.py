"""Sandbox backends (netns, docker), each with its `launch()`, and the kernel fence that makes the gateway their
only route."""

import re

# Sandbox ids name namespaces, interfaces (15 characters at most with their prefix) and nft tables.
SANDBOX_ID = re.compile(r"[a-z0-9]{1,12}")
