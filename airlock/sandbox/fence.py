"""The kernel fence: nftables rules saying that traffic arriving on a sandbox's interface may reach the
gateway's own listening sockets on the gateway's address and nothing else, and is never forwarded.

A port alone would not say whose socket answers: once the gateway is gone, any program that binds the port (on
0.0.0.0, say) would be reached. So the gateway marks its listening sockets (SO_MARK, `mark_listeners`; accepted
connections inherit the mark) and the fence looks up the socket each packet would be delivered to (nftables
`socket mark`): only a socket carrying GATEWAY_SOCKET_MARK is reached.

With `Interception` the fence also brings everything else the sandbox sends to the gateway (`interception`): TCP to
any address and port is redirected to the gateway's transparent listener, DNS (UDP and TCP port 53) to any address
to the gateway's DNS, so that a resolver address hard-coded in the sandbox gets the policy's answers, and any
other UDP (QUIC included) is refused at once with ICMP port-unreachable, so that clients fall back to TCP without
waiting for a timeout. The redirect happens here, on the gateway's side of the link, where nothing in the sandbox
can change it, and the gateway reads the dialled address with SO_ORIGINAL_DST.

One table per sandbox, loaded and removed atomically with `nft -f`, so that a fence is either whole or absent. Each
backend names its tables with its own prefix, so neither (nor its reaper) can touch the other's fence.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import logging
import os
import socket
import stat
import subprocess
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from airlock.errors import AirlockError

# Table name prefixes, one per backend: `<prefix><sandbox id>`.
NETNS_TABLE_PREFIX = "airlock_n_"
DOCKER_TABLE_PREFIX = "airlock_d_"
# The mark of the gateway's listening sockets. Packets they send carry it too, so it avoids the bits common
# routing and firewall setups give meaning to (kube-proxy 0x4000/0x8000, Cilium 0xf00, Tailscale 0xff0000,
# Calico's high half, WireGuard's 0xca6c).
GATEWAY_SOCKET_MARK = 0x10A1

log = logging.getLogger("airlock.fence")


class FenceError(AirlockError, RuntimeError):
    pass


@dataclass(frozen=True)
class Interception:
    """Where the fence sends what the sandbox dials elsewhere: the gateway's transparent listener (TCP) and its
    DNS port (None: no DNS, so port 53 is TCP like any port and UDP is refused like any UDP)."""

    tcp_port: int
    dns_port: int | None = None


@dataclass(frozen=True)
class Fence:
    table: str  # nft table name (family inet), unique per sandbox
    interface: str  # the gateway-side interface the sandbox's traffic arrives on
    gateway_ip: str
    tcp_ports: tuple[int, ...]
    udp_ports: tuple[int, ...] = ()
    intercept: Interception | None = None

    def ruleset(self) -> str:
        iface = self.interface
        mark = f"0x{GATEWAY_SOCKET_MARK:x}"
        accepts, chains = interception(iface, self.gateway_ip, self.intercept)
        tcp_ports = (*self.tcp_ports, *((self.intercept.tcp_port,) if self.intercept else ()))
        if tcp_ports:
            to = f'iifname "{iface}" ip daddr {self.gateway_ip} tcp dport {{ {", ".join(map(str, tcp_ports))} }}'
            # `socket mark` matches a full socket only (a listener, an accepted connection); for a half-open one
            # (the handshake's last ACK meets a request socket), a TIME_WAIT or no socket it matches neither way.
            # So: a marked socket is reached; any other full socket is not; of the rest, packets that open no
            # connection pass, and so does a SYN that meets a TIME_WAIT (`socket transparent` finds any socket):
            # the client reused the ports of a connection the gateway closed, which busy clients do all the time.
            # Should that SYN reach another program that took the port after the gateway died, the connection's
            # first data meets that program's full, unmarked socket and is reset. What is refused gets a reset,
            # as from a closed port: the sandbox's client gives up at once.
            accepts += [
                f"{to} socket mark {mark} accept",
                f"{to} socket mark != {mark} counter reject with tcp reset",
                f"{to} tcp flags & syn == 0 accept",
                f"{to} socket transparent 0 accept",
                f"{to} counter reject with tcp reset",
            ]
        if self.udp_ports:
            to = f'iifname "{iface}" ip daddr {self.gateway_ip} udp dport {{ {", ".join(map(str, self.udp_ports))} }}'
            accepts += [f"{to} socket mark {mark} accept", f"{to} counter reject"]  # icmp port-unreachable
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
    }}{chains}
}}
"""

    def install(self, netns_cmd: list[str] | None = None) -> None:
        """Load the fence; refused (FenceError) when a table of this name exists, which is never replaced: it may
        be another live sandbox's fence."""
        try:
            nft(["-f", "-"], self.ruleset(), netns_cmd)
        except FenceError as e:
            if "File exists" in str(e):
                raise FenceError(
                    f"nft table inet {self.table} exists already: another sandbox with this id has it (or a crashed"
                    " run left it); refusing to replace its fence"
                ) from None
            raise

    def remove(self, netns_cmd: list[str] | None = None) -> None:
        with contextlib.suppress(FenceError):  # absent already
            nft(["delete", "table", "inet", self.table], None, netns_cmd)


def interception(iface: str, gateway_ip: str, intercept: Interception | None) -> tuple[list[str], str]:
    """The fence's part for transparent mode: (input rules that go first, chains). Packets to any of the
    gateway host's own addresses are never redirected (`fib daddr type local`): the input chain decides those,
    as without interception. The transparent listener is reached only through the redirect (`ct status dnat`):
    dialled directly, it would read its own address as the destination."""
    if intercept is None:
        return [], ""
    arrives = f'iifname "{iface}"'
    redirects, refuse_udp = [], f"{arrives} meta l4proto udp fib daddr type != local"
    if intercept.dns_port:
        redirects.append(
            f"{arrives} meta nfproto ipv4 meta l4proto {{ tcp, udp }} th dport 53 "
            f"dnat ip to {gateway_ip}:{intercept.dns_port}"
        )
        refuse_udp += " udp dport != 53"
    redirects += [
        f"{arrives} fib daddr type local return",
        f"{arrives} meta nfproto ipv4 meta l4proto tcp dnat ip to {gateway_ip}:{intercept.tcp_port}",
    ]
    direct = f"{arrives} tcp dport {intercept.tcp_port} ct status & dnat == 0 counter reject with tcp reset"
    redirect_lines = "\n        ".join(redirects)
    # Refused before conntrack (priority raw), from the address the sandbox dialled: its client hears at once.
    chains = f"""
    chain refuse {{
        type filter hook prerouting priority raw; policy accept;
        {refuse_udp} counter reject with icmpx type port-unreachable
    }}
    chain intercept {{
        type nat hook prerouting priority dstnat; policy accept;
        {redirect_lines}
    }}"""
    return [direct], chains


# Port-unreachable is type 3 of `net.ipv4.icmp_ratemask` (and type 1 of `net.ipv6.icmp.ratemask`): the types the
# kernel rate-limits, both per destination (`icmp_ratelimit`: a burst of 6, then one a second) and for the whole
# namespace (`icmp_msgs_per_sec`).
ICMP_PORT_UNREACHABLE_BIT = 1 << 3
ICMPV6_RATEMASK_WITHOUT_UNREACHABLE = "0,3-127"  # the default, 0-1,3-127, without type 1
# What every new network namespace starts with (types 3, 4, 11, 12): a docker container's, before it exists.
KERNEL_ICMP_RATEMASK = 0x1818
IPV6_RATEMASK = Path("/proc/sys/net/ipv6/icmp/ratemask")  # absent in a kernel without IPv6 (or too old for it)


def refuse_udp_inside(
    table: str, gateway_ip: str, udp_ports: tuple[int, ...], intercept: Interception, netns: str | Path
) -> None:
    """Refuse, in the sandbox's own namespace (its file: /run/netns/NAME, /proc/PID/ns/net), the UDP the gateway-side
    fence refuses, so that the refusal reaches the sandbox's socket at once however many datagrams it sends: the
    gateway side's refusal comes from the gateway's namespace, whose ICMP rate limit (a host-wide setting when that
    is the host's) lets a burst of about 6 through and then one a second. Here the datagram is rejected as it leaves
    (before conntrack: no state is kept for it), and the sandbox's namespace does not rate-limit port-unreachable;
    the sandbox, without CAP_NET_ADMIN, can neither remove the rule nor change that sysctl. The gateway-side fence
    stays the enforcement."""
    in_network_namespace(netns, lambda: refuse_udp_here(table, gateway_ip, udp_ports, intercept)).result()


def refuse_udp_here(table: str, gateway_ip: str, udp_ports: tuple[int, ...], intercept: Interception) -> None:
    """`refuse_udp_inside()` in the network namespace this thread is in (see `in_network_namespace`)."""
    current = int(read_sysctl("net.ipv4.icmp_ratemask"))
    for name, value in unlimited_unreachable(current).items():
        write_sysctl(name, value)
    load_inner_refusal(table, gateway_ip, udp_ports, intercept)


def in_network_namespace[T](netns: str | Path, work: Callable[[], T]) -> concurrent.futures.Future[T]:
    """`work()` done by a thread of its own that has entered the network namespace at `netns` (setns), and ends
    with it: no thread of this process is ever left in another namespace. What that thread starts runs in the
    namespace too, and its /proc/sys/net is the namespace's: a sysctl is one write, not an `ip netns exec sysctl`
    (about 10 ms each: a mount namespace, /sys mounted again, two execs). FenceError when it cannot be entered."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def enter_and_work() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.setns(fd, os.CLONE_NEWNET)
            finally:
                os.close(fd)
        except OSError as e:
            done.set_exception(FenceError(f"cannot enter the network namespace {netns}: {e.strerror or e}"))
            return
        try:
            done.set_result(work())
        except BaseException as e:
            done.set_exception(e)

    done.set_running_or_notify_cancel()
    threading.Thread(target=enter_and_work, name="airlock-in-netns").start()
    return done


def unlimited_unreachable(ipv4_ratemask: int = KERNEL_ICMP_RATEMASK) -> dict[str, str]:
    """The ICMP rate-limit sysctls of a sandbox's namespace whose mask is `ipv4_ratemask`, with port-unreachable
    taken out of them (IPv6's where the kernel has it)."""
    settings = {"net.ipv4.icmp_ratemask": str(ipv4_ratemask & ~ICMP_PORT_UNREACHABLE_BIT)}
    if IPV6_RATEMASK.exists():
        settings["net.ipv6.icmp.ratemask"] = ICMPV6_RATEMASK_WITHOUT_UNREACHABLE
    return settings


def load_inner_refusal(
    table: str,
    gateway_ip: str,
    udp_ports: tuple[int, ...],
    intercept: Interception,
    netns_cmd: list[str] | None = None,
) -> None:
    """`inner_refusal()` loaded in the namespace `netns_cmd` enters (whose rate limit `unlimited_unreachable()`
    has lifted), or without it in this thread's."""
    nft(["-f", "-"], inner_refusal(table, gateway_ip, udp_ports, intercept), netns_cmd)


def inner_refusal(table: str, gateway_ip: str, udp_ports: tuple[int, ...], intercept: Interception) -> str:
    """The sandbox namespace's ruleset: UDP leaving for anywhere but the gateway's own UDP ports and (with the
    gateway's DNS) port 53 is rejected with port-unreachable. The sender's send() fails (EPERM) and its socket then
    reports ECONNREFUSED, as the gateway side's refusal would. Its own loopback traffic is untouched."""
    passes = [f"ip daddr {gateway_ip} udp dport {{ {', '.join(map(str, udp_ports))} }} accept"] if udp_ports else []
    if intercept.dns_port:
        passes.append("udp dport 53 accept")
    pass_lines = "".join(f"\n        {line}" for line in passes)
    return f"""create table inet {table}
table inet {table} {{
    chain refuse {{
        type filter hook output priority raw; policy accept;
        oifname "lo" accept
        meta l4proto != udp accept{pass_lines}
        counter reject with icmpx type port-unreachable
    }}
}}
"""


def read_sysctl(name: str) -> str:
    """A sysctl of this thread's network namespace (for net.*), as `sysctl -n` reads it."""
    try:
        return _sysctl_path(name).read_text().strip()
    except OSError as e:
        raise FenceError(f"cannot read {name}: {e.strerror or e}") from None


def write_sysctl(name: str, value: str) -> None:
    """Set a sysctl of this thread's network namespace (for net.*), as `sysctl -w` does."""
    try:
        _sysctl_path(name).write_text(value)
    except OSError as e:
        raise FenceError(f"cannot set {name}={value}: {e.strerror or e}") from None


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys", *name.split("."))


def nft(args: list[str], stdin: str | None = None, netns_cmd: list[str] | None = None) -> str:
    """Run nft (in the namespace `netns_cmd` enters, else this thread's); its output. FenceError when it fails."""
    return _tool(["nft", *args], stdin, netns_cmd)


def _tool(argv: list[str], stdin: str | None, netns_cmd: list[str] | None) -> str:
    try:
        result = subprocess.run([*(netns_cmd or []), *argv], input=stdin, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise FenceError(f"cannot run {argv[0]}: {e}") from e
    if result.returncode != 0:
        raise FenceError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result.stdout.strip()


def mark_listeners(address: str, ports: Iterable[int]) -> int:
    """Give this process's sockets bound to `address` on `ports` (listening TCP, UDP) the mark the fence admits;
    returns how many. Needs CAP_NET_ADMIN (OSError without): unmarked, they stay out of every sandbox's reach."""
    wanted, ports = ipaddress.ip_address(address), set(ports)
    marked = 0
    for sock in _own_sockets():
        with sock:
            host, port = sock.getsockname()[:2]
            if port in ports and ipaddress.ip_address(host.split("%")[0]) == wanted and _is_listener(sock):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, GATEWAY_SOCKET_MARK)
                marked += 1
    return marked


def _own_sockets() -> Iterable[socket.socket]:
    """A duplicate of each IP socket this process holds (the mark set on one is the socket's)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed meanwhile (the listing's own fd, too)
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            yield sock
        else:
            sock.close()


def _is_listener(sock: socket.socket) -> bool:
    if sock.type == socket.SOCK_DGRAM:
        return True
    return sock.type == socket.SOCK_STREAM and bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
