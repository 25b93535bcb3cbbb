"""The kernel fence: nftables rules saying that traffic arriving on a sandbox's interface may reach the
gateway's listening ports on the gateway's address and nothing else, and is never forwarded.

One table per sandbox, loaded and removed atomically with `nft -f`, so that a fence is either whole or absent. Each
backend names its tables with its own prefix, so neither (nor its reaper) can touch the other's fence.
"""

from __future__ import annotations

import contextlib
import subprocess
from dataclasses import dataclass

# Table name prefixes, one per backend: `<prefix><sandbox id>`.
NETNS_TABLE_PREFIX = "airlock_n_"
DOCKER_TABLE_PREFIX = "airlock_d_"


class FenceError(RuntimeError):
    pass


@dataclass(frozen=True)
class Fence:
    table: str  # nft table name (family inet), unique per sandbox
    interface: str  # the gateway-side interface the sandbox's traffic arrives on
    gateway_ip: str
    tcp_ports: tuple[int, ...]
    udp_ports: tuple[int, ...] = ()

    def ruleset(self) -> str:
        iface = self.interface
        accepts = []
        if self.tcp_ports:
            ports = ", ".join(map(str, self.tcp_ports))
            accepts.append(f'iifname "{iface}" ip daddr {self.gateway_ip} tcp dport {{ {ports} }} accept')
        if self.udp_ports:
            ports = ", ".join(map(str, self.udp_ports))
            accepts.append(f'iifname "{iface}" ip daddr {self.gateway_ip} udp dport {{ {ports} }} accept')
        accept_lines = "\n        ".join(accepts)
        # Priority -200 runs before the usual filter chains, so another table's accept cannot open more;
        # a drop here is final whatever other tables say.
        # `create` fails if the table exists: that fence belongs to someone else, and the whole batch is refused.
        return f"""create table inet {self.table}
table inet {self.table} {{
    chain input {{
        type filter hook input priority -200; policy accept;
        {accept_lines}
        iifname "{iface}" counter drop
    }}
    chain forward {{
        type filter hook forward priority -200; policy accept;
        iifname "{iface}" counter drop
        oifname "{iface}" counter drop
    }}
}}
"""

    def install(self, netns_cmd: list[str] | None = None) -> None:
        """Load the fence; refused (FenceError) when a table of this name exists, which is never replaced: it may
        be another live sandbox's fence."""
        try:
            _nft(["-f", "-"], self.ruleset(), netns_cmd)
        except FenceError as e:
            if "File exists" in str(e):
                raise FenceError(
                    f"nft table inet {self.table} exists already: another sandbox with this id has it (or a crashed"
                    " run left it); refusing to replace its fence"
                ) from None
            raise

    def remove(self, netns_cmd: list[str] | None = None) -> None:
        with contextlib.suppress(FenceError):  # absent already
            _nft(["delete", "table", "inet", self.table], None, netns_cmd)


def _nft(args: list[str], stdin: str | None, netns_cmd: list[str] | None) -> None:
    argv = [*(netns_cmd or []), "nft", *args]
    try:
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise FenceError(f"cannot run nft: {e}") from e
    if result.returncode != 0:
        raise FenceError(f"nft {' '.join(args)} failed: {result.stderr.strip()}")
