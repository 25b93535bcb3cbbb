"""How evenly N asyncio processes accepting on loopback share new connections: one listening socket shared by all
(what `airlock gateway --workers N` does) against one SO_REUSEPORT socket per process (the kernel hashing each
connection to one of them). The choice behind airlock/gateway/workers.py's listeners.

    .venv/bin/python -P bench/accept_balance.py [--processes 2] [--rounds 5] [--burst 8] [--sequential 200]

Each process is a fresh interpreter running an asyncio server (`asyncio.start_server(sock=...)`, as the workers
do) that answers each connection with its own index and holds it open until the client closes. Two loads per round:
a burst of `--burst` connections opened at once and kept (wrk -c8's kept-alive connections: each process's share is
its share of the work), and `--sequential` connections opened one after another, each closed before the next (a new
connection per request). The report gives each process's share per load, over every round, and the worst round.
Loopback only; every process started here is stopped by PID."""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import time

SERVER = """
import asyncio, socket, sys
index, fd, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
async def main():
    async def serve(reader, writer):
        writer.write(bytes([index]))
        await writer.drain()
        await reader.read()
        writer.close()
    sock = socket.socket(fileno=fd)
    # asyncio accepts up to `backlog` connections each time the socket is readable, and listens with it too
    server = await asyncio.start_server(serve, sock=sock, backlog=batch)
    sock.listen(100)  # the kernel's queue as before, whatever asyncio accepts at a time
    print("ready", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def listeners(mode: str, count: int) -> tuple[list[socket.socket], int]:
    """The listening sockets each process gets (one shared, or one SO_REUSEPORT socket each) and their port."""

    def make(port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if mode == "reuseport":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(100)
        sock.set_inheritable(True)
        return sock

    first = make(0)
    port = first.getsockname()[1]
    if mode == "shared":
        return [first] * count, port
    return [first, *(make(port) for _ in range(count - 1))], port


def start(mode: str, count: int) -> tuple[list[subprocess.Popen[str]], list[socket.socket], int]:
    socks, port = listeners(mode.split(",")[0], count)
    batch = 1 if mode.endswith("one accept each") else 100
    procs = []
    for index, sock in enumerate(socks):
        proc = subprocess.Popen(
            [sys.executable, "-P", "-c", SERVER, str(index), str(sock.fileno()), str(batch)],
            pass_fds=(sock.fileno(),), stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        procs.append(proc)
    return procs, socks, port


def burst(port: int, n: int) -> collections.Counter[int]:
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    served = collections.Counter(conn.recv(1)[0] for conn in conns)
    for conn in conns:
        conn.close()
    return served


def sequential(port: int, n: int) -> collections.Counter[int]:
    served: collections.Counter[int] = collections.Counter()
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port)) as conn:
            served[conn.recv(1)[0]] += 1
    return served


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--sequential", type=int, default=200)
    args = parser.parse_args()
    rows = []
    for mode in ("shared", "shared, one accept each", "reuseport"):
        procs, socks, port = start(mode, args.processes)
        try:
            time.sleep(0.2)
            for name, load, n in (("burst", burst, args.burst), ("sequential", sequential, args.sequential)):
                rounds = [load(port, n) for _ in range(args.rounds)]
                total = sum(rounds, collections.Counter())
                shares = ", ".join(f"#{i} {total[i] / (n * args.rounds):.0%}" for i in range(args.processes))
                worst = max(max(r.values()) / n for r in rounds)
                rows.append(f"| {mode} | {name} ({n} connections) | {shares} | {worst:.0%} |")
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            for sock in set(socks):
                sock.close()
    print(f"{args.processes} processes, {args.rounds} rounds, {os.cpu_count()} CPUs\n")
    print("| listeners | load | share of connections per process | busiest process's share, worst round |")
    print("|---|---|---|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
