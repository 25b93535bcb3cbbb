"""Clients that act from inside a test namespace, for what curl cannot express (forged SNI, Host fronting,
keep-alive counts, many concurrent tunnels, a request to the fake GitHub with headers of its own).

A network namespace is per thread: `in_netns` runs a function in a fresh thread that has joined the namespace,
so sockets it opens live there, while the test itself stays in the host namespace.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import os
import resource
import socket
import ssl
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airlock.verify.fakegithub_client import ACCEPT, API_VERSION, GITHUB_HOST, GITHUB_IP


def in_netns[T](ns: str, fn: Callable[..., T], *args: Any) -> T:
    box: dict[str, Any] = {}

    def target() -> None:
        fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            os.setns(fd, os.CLONE_NEWNET)
        finally:
            os.close(fd)
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name=f"in-{ns}")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    error: str | None = None  # set when the connection failed or was closed instead of answered
    extra: dict[str, Any] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.body)


def proxy_http(proxy: tuple[str, int], url: str, headers: dict[str, str] | None = None, timeout: float = 10) -> Reply:
    """One plain-HTTP request in absolute form through the proxy, with exactly the headers given."""
    conn = http.client.HTTPConnection(*proxy, timeout=timeout)
    try:
        conn.putrequest("GET", url, skip_host=headers is not None and "Host" in headers, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        return Reply(response.status, dict(response.getheaders()), response.read())
    except (OSError, http.client.HTTPException) as e:
        return Reply(0, {}, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer closes `sock` (end of file or a reset) within `seconds`."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def connect_tunnel(proxy: tuple[str, int], target: str, timeout: float = 10) -> tuple[socket.socket | None, Reply]:
    """Send CONNECT target; return the open socket when the proxy said 2xx, and the proxy's reply."""
    sock = socket.create_connection(proxy, timeout=timeout)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            sock.close()
            return None, Reply(0, {}, error="closed before CONNECT reply")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    if 200 <= status < 300:
        return sock, Reply(status, headers)
    length = int(headers.get("Content-Length", "0"))
    while len(rest) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        rest += chunk
    sock.close()
    return None, Reply(status, headers, rest)


def tls_get(
    proxy: tuple[str, int],
    target: str,
    sni: str | None,
    ca_file: str,
    path: str = "/",
    host_header: str | None = None,
    timeout: float = 10,
) -> Reply:
    """CONNECT to target, TLS with the given SNI (None: no SNI), GET path. Verification is against ca_file."""
    sock, reply = connect_tunnel(proxy, target, timeout)
    if sock is None:
        return reply
    context = ssl.create_default_context(cafile=ca_file)
    if sni is None:
        context.check_hostname = False
    try:
        with context.wrap_socket(sock, server_hostname=sni) as tls:
            host = host_header or (sni or target.rsplit(":", 1)[0])
            tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
    except (OSError, ssl.SSLError) as e:
        return Reply(0, {}, error=f"{type(e).__name__}: {e}", extra={"connect_status": reply.status})
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    return Reply(status, {}, body, extra={"connect_status": reply.status})


def tcp_probe(address: tuple[str, int], timeout: float = 3, payload: bytes = b"") -> str:
    """'refused', 'timeout', 'unreachable' or 'open:<first bytes>' for a direct TCP connection attempt."""
    try:
        with socket.create_connection(address, timeout=timeout) as sock:
            if payload:
                sock.sendall(payload)
            sock.settimeout(timeout)
            try:
                return "open:" + sock.recv(64).decode("latin-1")
            except TimeoutError:
                return "open:"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as e:
        return f"unreachable:{e.errno}"


def raw_request(proxy: tuple[str, int], data: bytes, timeout: float = 5) -> Reply:
    """Send bytes as they are (hostile request lines included) and parse whatever status comes back."""
    with socket.create_connection(proxy, timeout=timeout) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)  # the gateway may refuse a request before all its body is sent: read its answer
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
                if b"\r\n\r\n" in received and b"Connection: close" not in received:
                    break
        except (TimeoutError, ConnectionResetError):
            pass
    if not received.startswith(b"HTTP/"):
        return Reply(0, {}, received, error="no HTTP reply")
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return Reply(int(lines[0].split()[1]), headers, body)


class ForeignListeners:
    """Another program's sockets on the gateway's ports: bound on 0.0.0.0 inside namespace `ns` (retrying until
    the gateway's own sockets are gone), counting every connection, datagram and byte that reaches them. Only
    for the length of one test: `close()` (or the with block) frees the ports again."""

    def __init__(self, ns: str, tcp_ports: tuple[int, ...], udp_ports: tuple[int, ...], wait: float = 10) -> None:
        self.received: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets = in_netns(ns, self._bind, tcp_ports, udp_ports, wait)
        self._threads = [threading.Thread(target=self._serve, args=(sock,), daemon=True) for sock in self._sockets]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _bind(tcp_ports: tuple[int, ...], udp_ports: tuple[int, ...], wait: float) -> list[socket.socket]:
        wanted = [(socket.SOCK_STREAM, p) for p in tcp_ports] + [(socket.SOCK_DGRAM, p) for p in udp_ports]
        bound: list[socket.socket] = []
        deadline = time.monotonic() + wait
        try:
            for kind, port in wanted:
                while True:
                    sock = socket.socket(socket.AF_INET, kind)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as any ordinary service does
                    try:
                        sock.bind(("0.0.0.0", port))
                        break
                    except OSError:
                        sock.close()
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.02)
                if kind == socket.SOCK_STREAM:
                    sock.listen()
                sock.settimeout(0.1)
                bound.append(sock)
        except BaseException:
            for sock in bound:
                sock.close()
            raise
        return bound

    def _count(self, key: str, amount: int = 1) -> None:
        with self._lock:
            self.received[key] = self.received.get(key, 0) + amount

    def _serve(self, sock: socket.socket) -> None:
        tcp = sock.type == socket.SOCK_STREAM
        name = f"{'tcp' if tcp else 'udp'}/{sock.getsockname()[1]}"
        while not self._stop.is_set():
            try:
                if not tcp:
                    data, _ = sock.recvfrom(65536)
                    self._count(f"{name} datagrams")
                    self._count(f"{name} bytes", len(data))
                    continue
                conn, _ = sock.accept()
            except (TimeoutError, OSError):
                continue
            self._count(f"{name} connections")
            with conn:
                conn.settimeout(0.5)
                with contextlib.suppress(OSError):
                    self._count(f"{name} bytes", len(conn.recv(65536)))

    def total(self) -> int:
        with self._lock:
            return sum(self.received.values())

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        for sock in self._sockets:
            sock.close()

    def __enter__(self) -> ForeignListeners:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raise_open_file_limit() -> int:
    """This process's soft RLIMIT_NOFILE raised to its hard limit (a client holding many sockets needs it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


class HeldTunnels:
    """Many TLS tunnels through the proxy, opened concurrently from a thread inside a namespace and held open
    (keep-alive) until close(): what a client holding idle connections looks like to the gateway."""

    def __init__(self, ns: str, proxy: tuple[str, int], target: str, ca_file: str) -> None:
        self.proxy, self.target, self.host = proxy, target, target.rsplit(":", 1)[0]
        self.context = ssl.create_default_context(cafile=ca_file)
        self.tunnels: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.loop = asyncio.new_event_loop()
        joined = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ns, joined), name=f"tunnels-{ns}", daemon=True)
        self.thread.start()
        joined.wait()
        raise_open_file_limit()

    def _run(self, ns: str, joined: threading.Event) -> None:
        fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            os.setns(fd, os.CLONE_NEWNET)
        finally:
            os.close(fd)
            joined.set()
        self.loop.run_forever()

    def _call[T](self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coroutine, timeout), self.loop).result()

    def open(self, n: int, timeout: float = 120) -> list[str]:
        """Open n more tunnels at once, each with one request answered; the outcome of each: "200" or the
        CONNECT status or error. The ones that worked stay held."""
        return self._call(self._open_all(n), timeout)

    def request_all(self, timeout: float = 120) -> list[str]:
        """One more request on every held tunnel, all at once: "200" for each that answered."""
        return self._call(self._request_all(), timeout)

    def close(self) -> None:
        self._call(self._close_all(), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _open_all(self, n: int) -> list[str]:
        return list(await asyncio.gather(*(self._open_one() for _ in range(n))))

    async def _open_one(self) -> str:
        try:
            reader, writer = await asyncio.open_connection(*self.proxy)
        except OSError as e:
            return f"connect: {type(e).__name__}"
        try:
            writer.write(f"CONNECT {self.target} HTTP/1.1\r\nHost: {self.target}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b" ", 2)[1].decode()
            if status != "200":
                writer.close()
                return status
            await writer.start_tls(self.context, server_hostname=self.host)
            outcome = await self._get(reader, writer)
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError, IndexError) as e:
            writer.close()
            return f"{type(e).__name__}"
        if outcome == "200":
            self.tunnels.append((reader, writer))
        else:
            writer.close()
        return outcome

    async def _get(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        writer.write(f"GET / HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
            0,
        )
        await reader.readexactly(length)
        return head.split(b" ", 2)[1].decode()

    async def _request_all(self) -> list[str]:
        async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
            try:
                return await self._get(reader, writer)
            except (OSError, ssl.SSLError, asyncio.IncompleteReadError, IndexError) as e:
                return f"{type(e).__name__}"

        return list(await asyncio.gather(*(one(r, w) for r, w in self.tunnels)))

    async def _close_all(self) -> None:
        for _, writer in self.tunnels:
            writer.transport.abort()
        self.tunnels.clear()


# What a sandbox sends, over and over, to every port of its gateway (found from its proxy variable): TCP (proxy,
# DNS, broker) and UDP (DNS). Run as `python3 -c SENDER MARKER` (the marker names its process).
SENDER = """
import os, socket, time
gateway = os.environ["HTTP_PROXY"].split("//")[1].split(":")[0]
while True:
    for port in (3128, 53, 8080):
        s = socket.socket(); s.settimeout(0.3)
        try:
            s.connect((gateway, port)); s.sendall(b"from the sandbox\\n")
        except OSError:
            pass
        s.close()
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.sendto(b"from the sandbox", (gateway, 53)); u.close()
    time.sleep(0.05)
"""
GATEWAY_PORTS = {"tcp": (3128, 53, 8080), "udp": (53,)}


def tls_tunnel(
    proxy: tuple[str, int], target: str, ca_file: str, alpn: tuple[str, ...] = ("http/1.1",), timeout: float = 10
) -> tuple[ssl.SSLSocket | None, Reply]:
    """CONNECT to host:port and TLS inside it (SNI the host), verified against ca_file alone: the open TLS socket,
    or None and the proxy's reply (a TLS failure in its `error`)."""
    sock, reply = connect_tunnel(proxy, target, timeout)
    if sock is None:
        return None, reply
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(list(alpn))
    try:
        return context.wrap_socket(sock, server_hostname=target.rsplit(":", 1)[0]), reply
    except (OSError, ssl.SSLError) as e:
        sock.close()
        return None, Reply(0, {}, error=f"{type(e).__name__}: {e}", extra={"connect_status": reply.status})


def exchange(sock: socket.socket, data: bytes, timeout: float = 5) -> bytes:
    """Send bytes as they are and read until the peer closes (or goes quiet for `timeout`)."""
    sock.settimeout(timeout)
    with contextlib.suppress(OSError):
        sock.sendall(data)
    received = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def http_replies(data: bytes) -> list[tuple[int, bytes]]:
    """The (status, body) of each HTTP/1.1 response in `data` (Content-Length framed), in order."""
    replies = []
    while data.startswith(b"HTTP/1."):
        head, _, rest = data.partition(b"\r\n\r\n")
        fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
        length = int(next((v for k, v in fields.items() if k.lower() == b"content-length"), b"0"))
        replies.append((int(head.split(b" ", 2)[1]), rest[:length]))
        data = rest[length:]
    return replies


@dataclass
class WebsocketResult:
    status: int  # of the upgrade's answer (0: no answer)
    messages: list[bytes] = field(default_factory=list)  # what the server sent, in order
    head: bytes = b""
    body: bytes = b""  # of an answer that is not an upgrade


def websocket_session(
    sock: socket.socket, host: str, path: str, send: list[bytes], timeout: float = 5
) -> WebsocketResult:
    """A websocket client written out by hand: the upgrade request, then one masked text frame per `send`, each
    answered (the server's first message comes unasked), then a close."""
    sock.settimeout(timeout)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    buffer = _Buffered(sock)
    head = buffer.until(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 "):
        return WebsocketResult(0, head=head + buffer.rest())
    result = WebsocketResult(int(head.split(b" ", 2)[1]), head=head)
    if result.status != 101:
        result.body = buffer.rest()
        return result
    result.messages.append(_read_frame(buffer))
    for payload in send:
        sock.sendall(_masked_frame(0x1, payload))
        result.messages.append(_read_frame(buffer))
    sock.sendall(_masked_frame(0x8, b"\x03\xe8"))
    return result


class _Buffered:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.data = sock, b""

    def take(self, n: int) -> bytes:
        while len(self.data) < n:
            if not (chunk := self.sock.recv(65536)):
                raise ConnectionError("closed mid-frame")
            self.data += chunk
        out, self.data = self.data[:n], self.data[n:]
        return out

    def until(self, separator: bytes) -> bytes:
        with contextlib.suppress(OSError, ConnectionError):
            while separator not in self.data:
                if not (chunk := self.sock.recv(65536)):
                    break
                self.data += chunk
        head, _, self.data = self.data.partition(separator)
        return head

    def rest(self) -> bytes:
        with contextlib.suppress(OSError):
            while chunk := self.sock.recv(65536):
                self.data += chunk
        return self.data


def _read_frame(buffer: _Buffered) -> bytes:
    """One whole unfragmented frame from the server (unmasked)."""
    head = buffer.take(2)
    length = head[1] & 0x7F
    if length >= 126:
        length = int.from_bytes(buffer.take(2 if length == 126 else 8))
    return buffer.take(length)


def _masked_frame(opcode: int, payload: bytes) -> bytes:
    """One final frame as a client sends it: masked (RFC 6455 §5.3)."""
    mask = os.urandom(4)
    length = len(payload)
    size = bytes([0x80 | length]) if length < 126 else bytes([0x80 | 126]) + length.to_bytes(2)
    return bytes([0x80 | opcode]) + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def h2_request(sock: ssl.SSLSocket, headers: list[tuple[str, str]], timeout: float = 5) -> Reply:
    """One HTTP/2 request with exactly these header fields (pseudo-headers first; nothing checked or normalized on
    the way out): the answer's status and body, or an `error` naming the reset or the connection's end."""
    import h2.config
    import h2.connection
    import h2.events

    config = h2.config.H2Configuration(client_side=True, validate_outbound_headers=False,
                                       normalize_outbound_headers=False, validate_inbound_headers=False)  # fmt: skip
    conn = h2.connection.H2Connection(config)
    conn.initiate_connection()
    conn.send_headers(1, headers, end_stream=True)
    sock.settimeout(timeout)
    sock.sendall(conn.data_to_send())
    status, body = 0, b""
    while True:
        try:
            data = sock.recv(65536)
        except OSError as e:
            return Reply(status, {}, body, error=f"{type(e).__name__}: {e}")
        if not data:
            return Reply(status, {}, body, error="connection closed")
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                status = int(dict(event.headers)[b":status"])
            elif isinstance(event, h2.events.DataReceived):
                body += event.data
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                return Reply(status, {}, body)
            elif isinstance(event, h2.events.StreamReset):
                return Reply(status, {}, body, error=f"stream reset ({event.error_code!r})")
            elif isinstance(event, h2.events.ConnectionTerminated):
                return Reply(status, {}, body, error=f"connection terminated ({event.error_code!r})")
        with contextlib.suppress(OSError):
            sock.sendall(conn.data_to_send())


def github_request(
    ca_file: str | Path,
    method: str,
    path: str,
    token: str | None = None,
    scheme: str = "token",
    body: Any = None,
    raw_body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10,
    address: tuple[str, int] = (GITHUB_IP, 443),
) -> Reply:
    """One HTTPS request to the fake from the calling thread's namespace (use in_netns), verified against ca_file
    for api.github.test, with GitHub's usual headers (headers override; a None value drops one)."""
    all_headers: dict[str, str | None] = {
        "Accept": ACCEPT,
        "X-GitHub-Api-Version": API_VERSION,
        "User-Agent": "airlock-e2e",
    }
    if token is not None:
        all_headers["Authorization"] = f"{scheme} {token}"
    all_headers.update(headers or {})
    data = raw_body if raw_body is not None else (json.dumps(body).encode() if body is not None else None)
    if data is not None:
        all_headers.setdefault("Content-Type", "application/json")
        all_headers["Content-Length"] = str(len(data))
    context = ssl.create_default_context(cafile=str(ca_file))
    conn = http.client.HTTPSConnection(GITHUB_HOST, address[1], timeout=timeout, context=context)
    try:
        # Connect by address: names of the fake internet only resolve through fakenet, never the host's resolver.
        raw = socket.create_connection(address, timeout=timeout)
        conn.sock = context.wrap_socket(raw, server_hostname=GITHUB_HOST)
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in all_headers.items():
            if value is not None:
                conn.putheader(name, value)
        conn.endheaders(data)
        response = conn.getresponse()
        return Reply(response.status, dict(response.getheaders()), response.read())
    except (OSError, http.client.HTTPException) as e:
        return Reply(0, {}, error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()
