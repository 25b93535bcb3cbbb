"""airlock benchmarks: one command, one run, one markdown report.

    sudo .venv/bin/python bench/run.py [--duration 6] [--rounds 2] [--connections 8] [--bulk-mb 200]
        [--tls-requests 500] [--tls-fresh 100] [--output F]

1. Small plain-HTTP requests (wrk, same script and concurrency for every column): direct from the gateway
   namespace to the fake upstream, through a bare `mitmdump` (no addon), and through `airlock gateway`.
2. CONNECT + TLS bulk download (curl, certificate verified against the test CA): direct, through a bare
   `mitmdump --ignore-hosts '.*'` (TLS passthrough), and through airlock.
3. `airlock.policy.decide` in-process, µs per call at 100 / 1,000 / 10,000 rules.
4. Inspected HTTPS (curl, one connection, keep-alive; then a new connection per request): through airlock with
   rules that say `inspect: true` (alone, with an injected header, with `http:` sub-rules too) vs a bare `mitmdump`
   intercepting with its own CA, and vs passthrough; the large download of 2. through an inspected rule too.

All traffic stays inside the network namespaces of airlock/verify/topology.py (sandbox ─ gateway ─ fake internet, no
link to the host's network); every process is started here and stopped by PID, the namespaces are deleted at the
end. Needs root, `wrk` and `curl` (apt-get install -y wrk curl).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import timeit
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The e2e helpers, not the repo root: the root's dns/ would shadow dnspython. bench/ last: its dns.py and
# docker.py must not shadow dnspython and docker-py.
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

from airlock.verify.topology import GW_IP, FakeNet, Topology  # noqa: E402

import common  # noqa: E402
from common import (  # noqa: E402
    HOST,
    UPSTREAM_IP,
    HttpResult,
    Mitmdump,
    cpu_seconds,
    fmt,
    http_round,
    ratio,
    run_wrk,
    wrk_script,
)
from gateway_proc import GatewayProcess  # noqa: E402

AIRLOCK_PORT = 3128  # and the gateway's transparent listener on 3129: the bare ones stay clear of both
BARE_HTTP_PORT = 3140
BARE_PASS_PORT = 3141
BARE_INTERCEPT_PORT = 3142
INSPECTING_PORTS = 3150  # the first of the inspecting gateways' proxy ports, one per rule of INSPECTED
SECRET = "sk-bench-5b8e1f0c9a7d3e2f4a6b8c0d"  # what the injecting rules send upstream; never in a response
# The rules of the inspecting gateways, one gateway each (a held secret turns scrubbing on for every inspected
# response, so the rule without `inject:` runs where the gateway holds none). The http sub-rules are a package
# index's, plus the paths the bench asks for.
INSPECTED = {
    "airlock inspected": "",
    "airlock inspected + inject": """
        inject:
          - {header: Authorization, value: "Bearer {secret:bench_api}"}""",
    "airlock inspected + inject + http rules": """
        http:
          - {methods: [GET, HEAD], paths: ["/simple/**", "/packages/**", "/", "/big"]}
          - {methods: [POST], paths: ["/v1/**"]}
        inject:
          - {header: Authorization, value: "Bearer {secret:bench_api}"}""",
}
INSPECT_POLICY = """version: 1
profiles:
  default:
    allow:
      - host: allowed.test
        ports: [443]
        inspect: true{rule}
"""

# wrk: the request line is `GET <PATH> HTTP/1.1` with `Host: allowed.test`; against a proxy PATH is the absolute
# URL, so wrk talks to the proxy as if it were the server. Only status 200 counts as a success.
# ------------------------------------------------------------------------------------------------ helpers


def bench_info() -> dict[str, str]:
    import mitmproxy.version

    return common.machine_info(
        mitmproxy=mitmproxy.version.VERSION,
        wrk=common.tool_version(["wrk", "--version"]).split(" [")[0],
        curl=" ".join(common.tool_version(["curl", "--version"]).split()[:2]),
    )


# ------------------------------------------------------------------------------------------------ processes


# ------------------------------------------------------------------------------------------------ 1. HTTP


def check_http(topo: Topology, ns: str, curl_args: list[str]) -> None:
    """One request by curl first: the column measures what it claims (200 from the fake upstream)."""
    proc = topo.curl(ns, "-w", "\n%{http_code}", *curl_args)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or lines[-1] != "200" or not lines[0].startswith("fakenet"):
        raise RuntimeError(f"sanity request failed in {ns}: {curl_args}: {proc.stdout} {proc.stderr}")


# ------------------------------------------------------------------------------------------------ 2. TLS bulk


@dataclass
class BulkResult:
    name: str
    mbps: list[float]
    cpu_ms_per_mb: float | None

    @property
    def mean(self) -> float:
        return statistics.fmean(self.mbps)


@dataclass(frozen=True)
class TlsRoute:
    """How curl reaches https://allowed.test/ for one column: from `ns`, through `proxy` (None: straight to the
    upstream), trusting `ca` alone (so a column whose certificate is not the one it claims fails); `pid` is the
    proxy's, for its CPU."""

    name: str
    ns: str
    proxy: str | None
    ca: Path
    pid: int | None

    def args(self) -> list[str]:
        route = ["-x", self.proxy] if self.proxy else ["--resolve", f"{HOST}:443:{UPSTREAM_IP}"]
        return ["--cacert", str(self.ca), *route]


def curl_bulk(topo: Topology, route: TlsRoute, size: int) -> float:
    url = f"https://{HOST}/big?n={size}"
    write_out = "%{http_code} %{size_download} %{time_total}"
    proc = topo.curl(route.ns, "-o", "/dev/null", *route.args(), "-w", write_out, url, max_time=120)
    parts = proc.stdout.split()
    if proc.returncode != 0 or len(parts) != 3 or parts[0] != "200" or int(parts[1]) != size:
        raise RuntimeError(f"bulk download failed via {route.name}: {proc.stdout} {proc.stderr}")
    return size / float(parts[2]) / 1e6


# ------------------------------------------------------------------------------------------------ 4. inspected HTTPS


@dataclass
class TlsResult:
    name: str
    rounds: list[list[float]] = field(default_factory=list)  # each round: every timed request's latency, ms
    requests: int = 0  # all requests sent, the untimed first of a kept-alive connection too
    cpu_s: float | None = 0.0  # the proxy's CPU over all rounds (None for direct)
    upstream_conns: int = 0  # the most the fake upstream accepted in a round

    @property
    def latencies(self) -> list[float]:
        return sorted(ms for r in self.rounds for ms in r)

    @staticmethod
    def rate(latencies: list[float]) -> float:
        """Requests per second of one connection, one request after the other."""
        return len(latencies) / sum(latencies) * 1000 if latencies else 0.0

    @property
    def rps(self) -> float:
        return self.rate(self.latencies)

    @property
    def p50_ms(self) -> float | None:
        return common.percentile(self.latencies, 0.50)

    @property
    def p99_ms(self) -> float | None:
        return common.percentile(self.latencies, 0.99)

    @property
    def cpu_us_per_req(self) -> float | None:
        return None if self.cpu_s is None or not self.requests else self.cpu_s / self.requests * 1e6


def curl_requests(topo: Topology, route: TlsRoute, n: int, fresh: bool) -> list[float]:
    """`n` GETs of https://allowed.test/ by one curl, one after the other: ms each (curl's time_total). Over one
    kept-alive connection (the first request, which opens it, is left out), or with `fresh` a new connection for
    each (`Connection: close`: curl's connect, CONNECT and TLS handshake are in the time). HTTP/1.1 end to end, as
    fakenet speaks no other: a client speaking HTTP/2 to mitmproxy gets an upstream connection per request there."""
    write_out = "%{http_code} %{num_connects} %{time_total}\\n"
    close = ["-H", "Connection: close"] if fresh else []
    argv = ["curl", "-sS", "--http1.1", "--max-time", "10", "-o", "/dev/null", *route.args(), *close, "-w", write_out,
            f"https://{HOST}/?i=[1-{n}]"]  # fmt: skip
    proc = topo.run(route.ns, argv, timeout=60 + n)
    rows = [line.split() for line in proc.stdout.splitlines()]
    connects = [int(row[1]) for row in rows if len(row) == 3]
    expected = [1] * n if fresh else [1] + [0] * (n - 1)
    if proc.returncode != 0 or len(rows) != n or any(row[0] != "200" for row in rows) or connects != expected:
        bad = next((" ".join(r) for r, c in zip(rows, expected, strict=False) if r[0] != "200" or int(r[1]) != c), "")
        raise RuntimeError(f"https requests via {route.name} failed ({proc.returncode}, {len(rows)}/{n} "
                           f"answered, first bad: {bad!r}): {proc.stderr.strip()[:300]}")  # fmt: skip
    return [float(row[2]) * 1000 for row in rows[0 if fresh else 1 :]]


def tls_rounds(
    topo: Topology, net: FakeNet, routes: list[TlsRoute], n: int, rounds: int, fresh: bool
) -> list[TlsResult]:
    """`rounds` interleaved rounds of `n` requests per route (so drift hits every column alike)."""
    results = [TlsResult(route.name, cpu_s=None if route.pid is None else 0.0) for route in routes]
    for i in range(rounds):
        for route, result in zip(routes, results, strict=True):
            how = "new connection each" if fresh else "keep-alive"
            print(f"  https {how}: {route.name} round {i + 1} ...", file=sys.stderr, flush=True)
            net.reset()
            cpu0 = cpu_seconds(route.pid) if route.pid else 0.0
            result.rounds.append(curl_requests(topo, route, n, fresh))
            result.requests += n
            if route.pid and result.cpu_s is not None:
                result.cpu_s += cpu_seconds(route.pid) - cpu0
            result.upstream_conns = max(result.upstream_conns, net.connections(UPSTREAM_IP, 443))
    return results


def start_inspecting(topo: Topology, workdir: Path, upstream_ca: Path, procs: list[Any]) -> list[TlsRoute]:
    """One `airlock gateway` per rule of INSPECTED, each on its own port (no DNS, broker or transparent port of its
    own: the main gateway has those), verifying the upstream against the test CA; the routes to them."""
    secret = workdir / "bench_api.secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    routes = []
    for i, (name, rule) in enumerate(INSPECTED.items()):
        port = INSPECTING_PORTS + i
        gwdir = workdir / f"gateway-inspect-{i + 1}"
        gwdir.mkdir()
        policy = gwdir / "policy.yaml"
        policy.write_text(INSPECT_POLICY.format(rule=rule))
        extra = ["--proxy-port", str(port), "--dns-port", "0", "--broker-port", "0", "--transparent-port", "0",
                 "--upstream-ca", str(upstream_ca)]  # fmt: skip
        if "{secret:bench_api}" in rule:
            extra += ["--secret", f"bench_api=file:{secret}"]
        gateway = GatewayProcess(topo, gwdir, policy, (*extra, "--workers", "1"))
        procs.append(gateway)
        assert gateway.start().proc is not None
        (ca,) = (gwdir / "state" / "ca").glob("*/gateway-ca-*.pem")  # what an `airlock run` sandbox trusts
        routes.append(TlsRoute(name, topo.sbx, f"http://{GW_IP}:{port}", ca, gateway.proc.pid))
    return routes


def check_tls(topo: Topology, net: FakeNet, route: TlsRoute) -> None:
    """One request first: 200 from the fake upstream, which got the injected secret exactly when the column's rule
    injects it; and the column with http rules refuses a path they do not name."""
    net.reset()
    check_http(topo, route.ns, [*route.args(), f"https://{HOST}/"])
    (seen,) = net.http_requests()
    sent = [v for k, v in seen["headers"] if k.lower() == "authorization"]
    if sent != ([f"Bearer {SECRET}"] if "inject" in route.name else []):
        raise RuntimeError(f"{route.name}: the upstream got Authorization {sent!r}")
    if "http rules" in route.name:
        refused = topo.curl(route.ns, *route.args(), "-o", "/dev/null", "-w", "%{http_code}", f"https://{HOST}/admin")
        if refused.stdout != "403":
            raise RuntimeError(f"{route.name}: GET /admin answered {refused.stdout!r}, not 403")


# ------------------------------------------------------------------------------------------------ 3. decide


def policy_text(n: int) -> str:
    """n rules: ~50% exact hosts, ~25% wildcards, ~23% CIDRs (/24, /28, /32), ~2% deny rules."""
    allow, deny = [], []
    for i in range(n):
        kind = i % 50
        if kind == 0:
            deny.append(f"      - host: bad{i}.example.com")
        elif kind < 26:
            allow.append(f"      - host: svc{i}.corp{i % 97}.example.com")
        elif kind < 38:
            allow.append(f'      - host: "*.w{i}.example.org"')
        else:
            base = 0x0A000000 + i * 256  # 10.x.y.0, distinct per rule
            offset, length = ((0, 24), (16, 28), (5, 32))[i % 3]
            addr = base + offset
            dotted = ".".join(str((addr >> s) & 255) for s in (24, 16, 8, 0))
            allow.append(f"      - cidr: {dotted}/{length}\n        ports: [443]")
    return (
        "version: 1\nprofiles:\n  default:\n    allow:\n" + "\n".join(allow) + "\n    deny:\n" + "\n".join(deny) + "\n"
    )


def decide_queries(n: int) -> list[tuple[str, str, int, bool]]:
    """(label, host, port, expected allow); the hit targets sit in the middle of the rule list."""

    def last(kinds: range) -> int:
        return max(i for i in range(n // 2) if i % 50 in kinds)

    exact, wild, bad = last(range(1, 26)), last(range(26, 38)), last(range(1))
    cidr = max(i for i in range(n // 2) if i % 50 >= 38 and i % 3 == 0)
    base = 0x0A000000 + cidr * 256 + 77
    inside = ".".join(str((base >> s) & 255) for s in (24, 16, 8, 0))
    return [
        ("exact host, allow", f"svc{exact}.corp{exact % 97}.example.com", 443, True),
        ("wildcard, allow (2 labels below)", f"a.b.w{wild}.example.org", 443, True),
        ("deny rule", f"bad{bad}.example.com", 443, False),
        ("exact host, wrong port", f"svc{exact}.corp{exact % 97}.example.com", 80, False),
        ("unknown name (5 labels), deny", "x.y.z.unknown.example.net", 443, False),
        ("CIDR /24, allow", inside, 443, True),
        ("public IP no rule, deny", "203.0.113.5", 443, False),
    ]


def bench_decide(sizes: list[int], repeat: int = 7) -> tuple[dict[int, float], dict[int, dict[str, float]], list[str]]:
    """µs per decide() call by query kind and rule count. The sizes are measured round-robin, `repeat` times, and
    the best timing kept, so that a slow moment of the machine cannot pass for a cost of the rule count."""
    from airlock.policy import decide, parse_policy

    parse_ms: dict[int, float] = {}
    cases: list[tuple[int, str, Any, int]] = []  # (rules, label, timed function, decide calls per call)
    labels: list[str] = []
    for n in sizes:
        text = policy_text(n)
        t0 = time.perf_counter()
        profile = parse_policy(text, f"<bench {n}>").profile()
        parse_ms[n] = (time.perf_counter() - t0) * 1000
        assert len(profile.allow) + len(profile.deny) == n, (len(profile.allow), len(profile.deny))
        queries = decide_queries(n)
        labels = [q[0] for q in queries] + ["mix of the above"]
        for label, host, port, expected in queries:
            got = decide(profile, host, port).allow
            assert got is expected, (n, label, host, port, got)
            cases.append((n, label, lambda pr=profile, h=host, p=port: decide(pr, h, p), 1))
        mix = [(host, port) for _, host, port, _ in queries]

        def run_mix(profile: Any = profile, mix: list[tuple[str, int]] = mix) -> None:
            for h, p in mix:
                decide(profile, h, p)

        cases.append((n, "mix of the above", run_mix, len(mix)))
    numbers = [common.calibrate(fn, 0.03, 0.005) for _, _, fn, _ in cases]
    best: dict[tuple[int, str], float] = {}
    for _ in range(repeat):
        for (n, label, fn, calls), number in zip(cases, numbers, strict=True):
            us = timeit.timeit(fn, number=number) / number / calls * 1e6
            best[n, label] = min(us, best.get((n, label), us))
    per_call = {n: {label: best[n, label] for label in labels} for n in sizes}
    return parse_ms, per_call, labels


# ------------------------------------------------------------------------------------------------ report


def report(
    info: dict[str, str],
    command: str,
    args: argparse.Namespace,
    results: NetworkResults,
    decide_data: tuple[dict[int, float], dict[int, dict[str, float]], list[str]],
    elapsed: float,
) -> str:
    out: list[str] = []
    w = out.append
    http, bulk = results.http, results.bulk
    w("## airlock benchmarks\n")
    w(f"`{command}` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {elapsed:.0f} s total\n")
    w(
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), Linux {info['kernel']}; Python {info['python']}, "
        f"mitmproxy {info['mitmproxy']}, {info['wrk']}, {info['curl']}. Load generator, proxy and fake upstream "
        f"share these CPUs; {info['others']}.\n"
    )
    if http:
        direct, bare, air = (next((r for r in http if r.name.startswith(k)), None) for k in ("direct", "bare", "air"))
        w(
            f"### 1. Small plain-HTTP requests (`GET http://{HOST}/`, wrk -t1, {args.connections} keep-alive "
            f"connections, {args.rounds} interleaved rounds of {args.duration:g} s; latency: median of the rounds)\n"
        )
        w("| | req/s | per round | p50 ms | p99 ms | proxy CPU µs/req | upstream conns | non-200 | socket errors |")
        w("|---|---:|---|---:|---:|---:|---:|---:|---:|")
        for r in http:
            per_round = ", ".join(f"{x.rps:,.0f}" for x in r.rounds)
            w(
                f"| {r.name} | {fmt(r.rps)} | {per_round} | {fmt(r.p50_ms, 2)} | {fmt(r.p99_ms, 2)} | "
                f"{fmt(r.cpu_us_per_req)} | {r.upstream_conns} | {r.non200} | {r.socket_errors} |"
            )
        if direct and bare and air:
            w("")
            w("| ratio | req/s | p50 latency | p99 latency | proxy CPU/req |")
            w("|---|---:|---:|---:|---:|")
            w(
                f"| airlock / bare mitmproxy | {ratio(air.rps, bare.rps)} | {ratio(air.p50_ms, bare.p50_ms)} | "
                f"{ratio(air.p99_ms, bare.p99_ms)} | {ratio(air.cpu_us_per_req, bare.cpu_us_per_req)} |"
            )
            w(
                f"| airlock / direct | {ratio(air.rps, direct.rps)} | {ratio(air.p50_ms, direct.p50_ms)} | "
                f"{ratio(air.p99_ms, direct.p99_ms)} | |"
            )
            w(f"| bare mitmproxy / direct | {ratio(bare.rps, direct.rps)} | {ratio(bare.p50_ms, direct.p50_ms)} | "
              f"{ratio(bare.p99_ms, direct.p99_ms)} | |")  # fmt: skip
        w("")
    if bulk:
        w(
            f"### 2. CONNECT + TLS bulk download (`GET https://{HOST}/big?n={args.bulk_mb * 10**6}`, curl, "
            f"certificate verified, mean of {args.bulk_runs} runs, MB = 10⁶ bytes)\n"
        )
        base = next((b for b in bulk if b.name.startswith("direct")), None)
        w("| | MB/s (mean) | runs | proxy CPU ms/MB | vs direct |")
        w("|---|---:|---|---:|---:|")
        for b in bulk:
            runs = ", ".join(f"{x:.0f}" for x in b.mbps)
            vs_direct = ratio(b.mean, base.mean if base else None)
            w(f"| {b.name} | {fmt(b.mean)} | {runs} | {fmt(b.cpu_ms_per_mb, 2)} | {vs_direct} |")
        by_name = {b.name: b for b in bulk}
        w("")
        for a, b in [("airlock passthrough", "bare mitmproxy passthrough"),
                     *((name, "bare mitmproxy intercepting") for name in INSPECTED)]:  # fmt: skip
            if a in by_name and b in by_name:
                w(f"- {a} / {b}: {ratio(by_name[a].mean, by_name[b].mean)} MB/s")
        w("")
    parse_ms, per_call, labels = decide_data
    if per_call:
        sizes = sorted(per_call)
        w("### 3. `airlock.policy.decide`, in-process, µs per call (best of 7, sizes measured round-robin)\n")
        w("| query | " + " | ".join(f"{n:,} rules" for n in sizes) + " |")
        w("|---|" + "---:|" * len(sizes))
        for label in labels:
            w(f"| {label} | " + " | ".join(f"{per_call[n][label]:.2f}" for n in sizes) + " |")
        w("| *parse_policy, ms (once)* | " + " | ".join(f"{parse_ms[n]:,.0f}" for n in sizes) + " |")
        w("")
        w(
            "Rules: ~50% exact hosts, ~25% `*.` wildcards, ~23% CIDRs (/24, /28, /32), ~2% deny. "
            "Hosts are already canonical (as the proxy passes them).\n"
        )
    if results.kept:
        w(inspect_report(args, results.kept, results.fresh))
    return "\n".join(out) + "\n"


def inspect_report(args: argparse.Namespace, kept: list[TlsResult], fresh: list[TlsResult]) -> str:
    out: list[str] = []
    w = out.append
    w(
        f"### 4. Inspected HTTPS (`GET https://{HOST}/`, curl, certificate verified; {args.rounds} interleaved rounds "
        f"per column; latency: every request of the rounds)\n"
    )
    w(f"One connection kept alive, {args.tls_requests} requests one after the other per round (the first, which "
      "opens the connection, not timed):\n")  # fmt: skip
    w("| | req/s | per round | p50 ms | p99 ms | proxy CPU µs/req | upstream conns |")
    w("|---|---:|---|---:|---:|---:|---:|")
    for r in kept:
        per_round = ", ".join(f"{r.rate(x):,.0f}" for x in r.rounds)
        w(f"| {r.name} | {fmt(r.rps)} | {per_round} | {fmt(r.p50_ms, 2)} | {fmt(r.p99_ms, 2)} | "
          f"{fmt(r.cpu_us_per_req)} | {r.upstream_conns} |")  # fmt: skip
    k = {r.name: r for r in kept}
    pairs = [*((name, "bare mitmproxy intercepting") for name in INSPECTED),
             ("airlock passthrough", "bare mitmproxy passthrough"),
             ("bare mitmproxy intercepting", "bare mitmproxy passthrough")]  # fmt: skip
    w("")
    w("| ratio (keep-alive) | req/s | p50 latency | p99 latency | proxy CPU/req |")
    w("|---|---:|---:|---:|---:|")
    for a, b in pairs:
        if a in k and b in k:
            ka, kb = k[a], k[b]
            target = " (target ≥ 0.90x)" if b == "bare mitmproxy intercepting" else ""
            w(f"| {a} / {b} | {ratio(ka.rps, kb.rps)}{target} | {ratio(ka.p50_ms, kb.p50_ms)} | "
              f"{ratio(ka.p99_ms, kb.p99_ms)} | {ratio(ka.cpu_us_per_req, kb.cpu_us_per_req)} |")  # fmt: skip
    w("")
    w(f"A new connection for each request (`Connection: close`), {args.tls_fresh} per round: curl's connect, "
      "CONNECT, TLS handshake and request:\n")  # fmt: skip
    w("| | p50 ms | p99 ms | proxy CPU µs/req |")
    w("|---|---:|---:|---:|")
    for r in fresh:
        w(f"| {r.name} | {fmt(r.p50_ms, 2)} | {fmt(r.p99_ms, 2)} | {fmt(r.cpu_us_per_req)} |")
    f = {r.name: r for r in fresh}
    w("")
    w("Extra latency of one inspected request over one passed through, ms (p50, p99 of each column):\n")
    w("| | keep-alive p50 | keep-alive p99 | new connection p50 | new connection p99 |")
    w("|---|---:|---:|---:|---:|")
    for a, b in [*((name, "airlock passthrough") for name in INSPECTED),
                 ("bare mitmproxy intercepting", "bare mitmproxy passthrough")]:  # fmt: skip
        if a in k and b in k and a in f and b in f:
            cells = [extra_ms(x[a].p50_ms, x[b].p50_ms) + " | " + extra_ms(x[a].p99_ms, x[b].p99_ms) for x in (k, f)]
            w(f"| {a} minus {b} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def extra_ms(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a - b:+.2f}"


# ------------------------------------------------------------------------------------------------ main


@dataclass
class NetworkResults:
    http: list[HttpResult] = field(default_factory=list)
    bulk: list[BulkResult] = field(default_factory=list)
    kept: list[TlsResult] = field(default_factory=list)  # 4. inspected HTTPS, one kept-alive connection
    fresh: list[TlsResult] = field(default_factory=list)  # 4. a new connection per request


def network_benchmarks(args: argparse.Namespace, workdir: Path) -> NetworkResults:
    with common.fake_internet(workdir) as (topo, net, ca, procs):
        # Safety: every address we send to must leave on a device of this topology.
        topo.assert_route_inside(topo.gw, UPSTREAM_IP)
        topo.assert_route_inside(topo.sbx, GW_IP)
        (workdir / "gateway").mkdir()
        gateway = GatewayProcess(topo, workdir / "gateway", extra=("--workers", "1")).start()
        assert gateway.proc is not None
        procs.append(gateway)
        bare_http = Mitmdump(topo, workdir, BARE_HTTP_PORT).start()
        procs.append(bare_http)
        bare_pass = Mitmdump(topo, workdir, BARE_PASS_PORT, ("--ignore-hosts", ".*")).start()
        procs.append(bare_pass)
        results = NetworkResults()

        if not args.skip_http:
            results.http = http_benchmark(args, topo, net, workdir, gateway.proc.pid, bare_http.pid)

        direct = TlsRoute("direct (gw → upstream)", topo.gw, None, ca.ca_cert, None)
        passthrough = [
            TlsRoute("bare mitmproxy passthrough", topo.sbx, f"http://{GW_IP}:{BARE_PASS_PORT}", ca.ca_cert,
                     bare_pass.pid),
            TlsRoute("airlock passthrough", topo.sbx, f"http://{GW_IP}:{AIRLOCK_PORT}", ca.ca_cert, gateway.proc.pid),
        ]  # fmt: skip
        intercepting: list[TlsRoute] = []
        if not (args.skip_bulk and args.skip_inspect):
            # The same options as the gateway's (lazy, streaming past 1 MB, no upstream certificate sniffing, the
            # upstream verified against the test CA), no addon; the client trusts mitmproxy's own CA.
            bare_intercept = Mitmdump(topo, workdir, BARE_INTERCEPT_PORT, (
                "--set", "stream_large_bodies=1m", "--set", "upstream_cert=false",
                "--set", f"ssl_verify_upstream_trusted_ca={ca.ca_cert}",
            ))  # fmt: skip
            procs.append(bare_intercept.start())
            mitm_ca = workdir / "mitmproxy" / "mitmproxy-ca-cert.pem"
            intercepting = [
                TlsRoute("bare mitmproxy intercepting", topo.sbx, f"http://{GW_IP}:{BARE_INTERCEPT_PORT}", mitm_ca,
                         bare_intercept.pid),
                *start_inspecting(topo, workdir, ca.ca_cert, procs),
            ]  # fmt: skip

        if not args.skip_bulk:
            routes = [direct, passthrough[0], passthrough[1], *intercepting]
            results.bulk = bulk_benchmark(args, topo, routes)

        if not args.skip_inspect:
            routes = [direct, passthrough[0], intercepting[0], passthrough[1], *intercepting[1:]]
            for route in routes:
                check_tls(topo, net, route)
                curl_requests(topo, route, 20, fresh=False)  # warm-up: leaf certificates, DNS cache, imports
            results.kept = tls_rounds(topo, net, routes, args.tls_requests, args.rounds, fresh=False)
            results.fresh = tls_rounds(topo, net, routes, args.tls_fresh, args.rounds, fresh=True)
        return results


def http_benchmark(
    args: argparse.Namespace, topo: Topology, net: FakeNet, workdir: Path, airlock_pid: int, bare_pid: int
) -> list[HttpResult]:
    check_http(topo, topo.gw, ["-H", f"Host: {HOST}", f"http://{UPSTREAM_IP}/"])
    check_http(topo, topo.sbx, ["-x", f"http://{GW_IP}:{BARE_HTTP_PORT}", f"http://{HOST}/"])
    check_http(topo, topo.sbx, ["-x", f"http://{GW_IP}:{AIRLOCK_PORT}", f"http://{HOST}/"])
    columns = [
        ("direct (gw → upstream)", topo.gw, f"http://{UPSTREAM_IP}:80/", "/", None),
        ("bare mitmproxy", topo.sbx, f"http://{GW_IP}:{BARE_HTTP_PORT}/", f"http://{HOST}/", bare_pid),
        ("airlock", topo.sbx, f"http://{GW_IP}:{AIRLOCK_PORT}/", f"http://{HOST}/", airlock_pid),
    ]
    luas = {}
    for name, ns, url, path, _ in columns:
        luas[name] = workdir / f"wrk-{name.split()[0]}.lua"
        luas[name].write_text(wrk_script(path, HOST))
        run_wrk(topo.cmd(ns), luas[name], url, 1, args.connections)  # warm-up: connections, DNS cache, imports
    results = {name: HttpResult(name, []) for name, *_ in columns}
    for i in range(args.rounds):  # interleaved, so drift hits every column alike
        for name, ns, url, _, pid in columns:
            print(f"  http: {name} round {i + 1} ...", file=sys.stderr, flush=True)
            lua = luas[name]
            results[name].rounds.append(http_round(net, topo.cmd(ns), lua, url, pid, args.duration, args.connections))
    return list(results.values())


def bulk_benchmark(args: argparse.Namespace, topo: Topology, routes: list[TlsRoute]) -> list[BulkResult]:
    size = args.bulk_mb * 10**6
    runs: dict[str, list[float]] = {route.name: [] for route in routes}
    cpu: dict[str, float] = {route.name: 0.0 for route in routes}
    for i in range(args.bulk_runs):  # interleaved, so drift hits every column alike
        for route in routes:
            print(f"  tls bulk: {route.name} run {i + 1} ...", file=sys.stderr, flush=True)
            cpu0 = cpu_seconds(route.pid) if route.pid else 0.0
            runs[route.name].append(curl_bulk(topo, route, size))
            cpu[route.name] += cpu_seconds(route.pid) - cpu0 if route.pid else 0.0
    total_mb = args.bulk_mb * args.bulk_runs
    return [BulkResult(r.name, runs[r.name], cpu[r.name] * 1000 / total_mb if r.pid else None) for r in routes]


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per HTTP round (default 6)")
    parser.add_argument("--rounds", type=int, default=2, help="HTTP rounds per column, interleaved (default 2)")
    parser.add_argument("--connections", type=int, default=8, help="keep-alive connections (default 8)")
    parser.add_argument("--bulk-mb", type=int, default=200, help="MB per TLS download (default 200)")
    parser.add_argument("--bulk-runs", type=int, default=3, help="TLS downloads per column (default 3)")
    parser.add_argument("--rules", default="100,1000,10000", help="rule counts for decide (default 100,1000,10000)")
    parser.add_argument("--tls-requests", type=int, default=500,
                        help="HTTPS requests per round over one kept-alive connection (default 500)")  # fmt: skip
    parser.add_argument("--tls-fresh", type=int, default=100,
                        help="HTTPS requests per round, a new connection each (default 100)")  # fmt: skip
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--skip-bulk", action="store_true")
    parser.add_argument("--skip-inspect", action="store_true")
    parser.add_argument("--skip-decide", action="store_true")
    args = common.parse_args(parser, argv)
    if not (1 <= args.duration <= 60 and 1 <= args.rounds <= 10 and 1 <= args.connections <= 256):
        parser.error("keep --duration in 1..60, --rounds in 1..10, --connections in 1..256")
    if not 1 <= args.bulk_runs <= 10:
        parser.error("keep --bulk-runs in 1..10")
    if not 1 <= args.bulk_mb <= 2000:
        parser.error("keep --bulk-mb in 1..2000")
    if not (2 <= args.tls_requests <= 100_000 and 1 <= args.tls_fresh <= 10_000):
        parser.error("keep --tls-requests in 2..100000, --tls-fresh in 1..10000")
    network = not (args.skip_http and args.skip_bulk and args.skip_inspect)
    if network and os.geteuid() != 0:
        parser.error("needs root for network namespaces (or pass --skip-http --skip-bulk --skip-inspect)")
    for tool in ("wrk", "curl", "unshare", "ss") if network else ():
        if shutil.which(tool) is None:
            parser.error(f"{tool} not found (apt-get install -y wrk curl util-linux iproute2)")

    common.interrupt_on_sigterm()
    command = common.command_line("bench/run.py")
    started, other_cpu = time.monotonic(), common.OtherCpu()
    info = bench_info()
    decide_data: tuple[dict[int, float], dict[int, dict[str, float]], list[str]] = ({}, {}, [])
    if not args.skip_decide:
        print("  decide ...", file=sys.stderr, flush=True)
        decide_data = bench_decide([int(x) for x in args.rules.split(",")])
    results = NetworkResults()
    if network:
        with common.scratch_dir("airlock-bench-") as workdir:
            results = network_benchmarks(args, workdir)
    elapsed = time.monotonic() - started
    # Everything this run started has been reaped by now, so what the machine did beyond that was someone else.
    others = other_cpu.seconds() / (elapsed * (os.cpu_count() or 1))
    info["others"] = f"other processes used {others:.0%} of the machine's CPU during the run"
    if others > 0.05:
        info["others"] += " (**over 5%: numbers are disturbed, run again on an idle machine**)"
        print(f"warning: {info['others']}", file=sys.stderr)
    text = report(info, command, args, results, decide_data, elapsed)
    common.emit(text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
