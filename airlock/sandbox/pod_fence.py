"""The pod fence: nftables rules in a network namespace shared by an agent and its gateway (a Kubernetes pod's),
under which nothing but the gateway reaches the network.

The sandbox fence (fence.py) stands on the gateway's side of a link; in a pod there is no link between them, so
this one judges each packet as it leaves, by who sent it. The gateway's packets pass: those of its UID (`meta
skuid`), and those of its marked sockets (GATEWAY_SOCKET_MARK, `mark_listeners`: setting a mark needs
CAP_NET_ADMIN, which nothing else in the pod holds). Of everyone else's, TCP is redirected to the gateway's
transparent listener on loopback and DNS (UDP and TCP port 53, to any address, loopback's too) to its resolver;
any other UDP, ICMP and IPv6 beyond loopback is refused at once. The pod's own loopback stays open (an agent's
test server, say), except the gateway's ports: its transparent and DNS listeners are reached only through the
redirect and its other ports (broker, admin) not at all; only its proxy port answers. A loopback connection once
let through is let through to its end (its last ACK may leave from a socket in TIME_WAIT, which has no UID).

Fail closed by construction: with the gateway gone, the redirect lands on a closed loopback port and the client
hears a reset. One table, `TABLE`, replaced atomically (`nft -f -`), so a fence is whole or absent, and installing
it twice leaves one; `installed()` reads it back in the form `ruleset()` writes, so a check is a comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fence import GATEWAY_SOCKET_MARK, FenceError, nft

TABLE = "airlock_pod"


@dataclass(frozen=True)
class PodFence:
    gateway_uid: int
    proxy_port: int  # the gateway's explicit proxy: the one port of its the agent may dial
    transparent_port: int
    dns_port: int | None = None  # None: no DNS redirect (port 53 is TCP like any port, and UDP is refused)
    gateway_ports: tuple[int, ...] = ()  # its other loopback ports (broker, admin): refused to all but the gateway

    def ruleset(self) -> str:
        """The table as `nft -s list table` prints it (stateless: counters without their counts)."""
        return _table(self._gateways("return") + self._redirects(), self._gateways("accept") + self._filters())

    def _gateways(self, verdict: str) -> list[str]:
        return [f"meta skuid {self.gateway_uid} {verdict}", f"meta mark 0x{GATEWAY_SOCKET_MARK:08x} {verdict}"]

    def _redirects(self) -> list[str]:
        tcp = f"meta nfproto ipv4 meta l4proto tcp counter redirect to :{self.transparent_port}"
        if not self.dns_port:
            return ['oifname "lo" return', tcp]
        # DNS first: a resolver on loopback (127.0.0.53, say) gets the gateway's answers too.
        dns = f"meta nfproto ipv4 meta l4proto {{ tcp, udp }} th dport 53 counter redirect to :{self.dns_port}"
        return [dns, 'oifname "lo" return', tcp]

    def _filters(self) -> list[str]:
        redirected = (self.transparent_port, *((self.dns_port,) if self.dns_port else ()))
        closed = _port_set((*redirected, *self.gateway_ports))
        return [
            # A connection the fence let through stays open to its end: the last ACK of a gateway's own client (its
            # `airlock status`), sent by a socket in TIME_WAIT that no longer has a UID, is let through too.
            'oifname "lo" ct state established accept',
            f"ip daddr 127.0.0.1 th dport {_port_set(redirected)} ct status dnat accept",
            f'oifname "lo" tcp dport {self.proxy_port} accept',
            f'oifname "lo" meta l4proto {{ tcp, udp }} th dport {closed} counter reject',
            'oifname "lo" accept',
            "meta l4proto tcp counter reject with tcp reset",
            "counter reject",  # with icmpx port-unreachable, as nft lists it
        ]

    def install(self) -> None:
        """Load the fence in this process's network namespace, replacing any earlier one in the same transaction."""
        nft(["-f", "-"], f"table inet {TABLE}\ndelete table inet {TABLE}\n{self.ruleset()}")


def installed() -> str | None:
    """The pod fence in place in this network namespace (as `ruleset()` writes it), None without one."""
    try:
        return nft(["-s", "list", "table", "inet", TABLE]) + "\n"
    except FenceError as e:
        if "No such file or directory" in str(e):
            return None
        raise


def _table(redirects: list[str], filters: list[str]) -> str:
    # The redirect happens at dstnat; the filter comes after it (priority filter) and so sees where a redirected
    # packet now goes. Its `oifname` is still the route's before the redirect: redirected packets are told by
    # their conntrack status instead. (-100 is dstnat, a name nft 1.0 accepts at prerouting only.)
    return f"""table inet {TABLE} {{
\tchain intercept {{
\t\ttype nat hook output priority -100; policy accept;
{_lines(redirects)}
\t}}

\tchain egress {{
\t\ttype filter hook output priority filter; policy accept;
{_lines(filters)}
\t}}
}}
"""


def _lines(rules: list[str]) -> str:
    return "\n".join(f"\t\t{rule}" for rule in rules)


def _port_set(ports: tuple[int, ...]) -> str:
    """An nft set (or a lone port), in the order nft lists it."""
    ports = tuple(sorted(set(ports)))
    return str(ports[0]) if len(ports) == 1 else f"{{ {', '.join(map(str, ports))} }}"
