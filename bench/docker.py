"""The docker backend: start-to-first-byte per sandbox, and sandboxes running at once, one run, one report.

    sudo .venv/bin/python -P bench/docker.py [--sandboxes 20] [--concurrent 10] [--requests 50]

Everything runs in the end-to-end topology of airlock/verify/topology.py: a private dockerd (airlock/verify/dockerd.py)
inside the gateway namespace, whose only other link is the fake internet (allowed.test = 192.0.2.10:80, the fake
DNS server 192.0.2.53); the sandbox image is scripts/build-test-image's Debian rootfs, imported into that daemon.

1. Start to first byte, `--sandboxes` sandboxes one after another, two ways, interleaved (after one warm-up each):
   - `airlock run --backend docker --image IMG --policy tests/e2e/policies/e2e.yaml --upstream-dns 192.0.2.53
     --sandbox-id <prefix>bN -- sh -c PROBE`, launched in the gateway namespace (`ip netns exec`) with DOCKER_HOST
     pointing at the private daemon, timed end to end from the host: network + fence, embedded gateway (proxy,
     DNS; no broker, as the probe holds no token), container, the request, teardown, and the CLI's own start-up
     (Python imports) — what a user waits for.
   - The same in-process, as `airlock run` does it (its `run_config()`, then `airlock.launch.docker_launcher.launch`
     and `DockerHandle.close`),
     in a thread that joined the gateway namespace, with a timestamp after each step `launch()` takes (its methods
     wrapped in this process only): network + fence (`DockerSandbox.create`), gateway start (`Gateway.start`:
     proxy, DNS), container create + start (`DockerSandbox.start`, docker API), then the first byte;
     teardown (`Gateway.stop`, then `DockerSandbox.destroy`: container, network and fence removed). A 5 ms ticker
     on the same event loop measures how long `launch()` keeps that loop from running anything else.
   PROBE prints the time (`date +%s.%N`, the host's clock: containers share its kernel) before and after one
   `curl -sS http://allowed.test/` through the proxy, and curl's own time to first byte and total time; "first
   byte" = the time after curl minus curl's time from first byte to its end. The body must be fakenet's answer.
2. Sustained: `--concurrent` `airlock run`s at once, each looping `--requests` times `curl -s -o /dev/null -w
   "%{http_code}" http://allowed.test/`; every answer must be 200 and fakenet must have counted every request. The
   docker API is polled meanwhile for how many sandbox containers run at once. Afterwards no airlock container,
   network, fence table or bridge may remain.

All traffic stays inside the namespaces (the bench process itself talks only to unix sockets); every process is
started here and stopped by PID; the daemon and namespaces are removed at the end, also on Ctrl-C or SIGTERM.
Needs root, docker.io (dockerd), debootstrap (for the image, cached in /var/cache/airlock) and util-linux.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The e2e helpers, not the repo root: the root's dns/ would shadow dnspython. bench/ last: its dns.py and
# docker.py must not shadow dnspython and docker-py.
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

import docker  # noqa: E402

from airlock.cli import build_parser  # noqa: E402
from airlock.cli.common import load_policy_file  # noqa: E402
from airlock.cli.run import run_config  # noqa: E402
from airlock.gateway import Gateway  # noqa: E402
from airlock.launch.docker_launcher import launch  # noqa: E402
from airlock.sandbox.docker import LABEL, DockerSandbox  # noqa: E402
from airlock.verify.dockerd import DockerDaemon, docker_problem  # noqa: E402
from airlock.verify.topology import DNS_SERVER, FakeNet, Topology  # noqa: E402

import common  # noqa: E402
from common import fmt, percentile  # noqa: E402
from gateway_proc import AIRLOCK, E2E_POLICY  # noqa: E402
from netclient import in_netns  # noqa: E402

BUILD_TEST_IMAGE = REPO / "scripts" / "build-test-image"
ALLOWED_IP = "192.0.2.10"
URL = "http://allowed.test/"
BODY = f"fakenet {ALLOWED_IP}:80 host=allowed.test path=/"
PROBE = (
    'date +%s.%N; curl -sS --max-time 10 -w "\\n%{http_code} %{time_starttransfer} %{time_total}\\n" '
    + URL
    + "; date +%s.%N"
)
LOOP = (
    "date +%s.%N; for i in $(seq {n}); do "
    'curl -s -o /dev/null --max-time 10 -w "%{{http_code}}\\n" ' + URL + "; done; date +%s.%N"
)


# ------------------------------------------------------------------------------------------------ helpers


def machine_info(client: docker.DockerClient) -> dict[str, str]:
    mem = "?"
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = f"{int(Path('/proc/meminfo').read_text().split()[1]) / 2**20:.1f} GiB"
    version = client.version()
    info = client.info()
    components = {c.get("Name"): c.get("Version") for c in version.get("Components") or []}
    cli_version = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        cli_version = subprocess.run(["docker", "--version"], capture_output=True, text=True, timeout=10).stdout
    return {
        "nproc": str(os.cpu_count()),
        "cpu": common.cpu_model(),
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "dockerd": f"{version.get('Version', '?')} (API {version.get('ApiVersion', '?')})",
        "containerd": str(components.get("containerd", "?")),
        "runc": str(components.get("runc", "?")),
        "docker CLI": cli_version.strip().removeprefix("Docker version ") or "not installed",
        "docker-py": docker.__version__,
        "storage": f"{info.get('Driver', '?')}, cgroup v{info.get('CgroupVersion', '?')}",
        "load": f"{os.getloadavg()[0]:.2f}",
    }


def build_image(daemon: DockerDaemon) -> tuple[str, Path]:
    build = subprocess.run(
        [str(BUILD_TEST_IMAGE)], capture_output=True, text=True, timeout=900, check=False, stdin=subprocess.DEVNULL
    )
    if build.returncode != 0 or not build.stdout.strip():
        raise RuntimeError(f"scripts/build-test-image failed ({build.returncode}):\n{build.stderr[-4000:]}")
    tarball = Path(build.stdout.strip().splitlines()[-1])
    return daemon.import_image(tarball), tarball


def run_argv(image: str, sandbox_id: str, *cmd: str) -> list[str]:
    return [
        AIRLOCK, "run", "--backend", "docker", "--image", image, "--policy", str(E2E_POLICY),
        "--upstream-dns", DNS_SERVER, "--sandbox-id", sandbox_id, "--", *cmd,
    ]  # fmt: skip


@dataclass
class Probe:
    started: float  # in the container, before curl
    first_byte: float  # in the container: after curl, less curl's time from its first byte to its end
    done: float  # in the container, after curl
    ttfb: float  # curl's own time to first byte (from curl's start)


def parse_probe(stdout: str) -> Probe:
    lines = stdout.splitlines()
    if len(lines) < 4:
        raise RuntimeError(f"unexpected probe output: {stdout!r}")
    started, *body, result, done = lines
    code, ttfb, total = result.split()
    if code != "200" or "\n".join(body).strip() != BODY:
        raise RuntimeError(f"probe got {code} {body!r}, want 200 {BODY!r}")
    return Probe(float(started), float(done) - (float(total) - float(ttfb)), float(done), float(ttfb))


# ------------------------------------------------------------------------------------------------ part 1


@dataclass
class Samples:
    values: dict[str, list[float]] = field(default_factory=dict)  # phase -> seconds

    def add(self, sample: dict[str, float]) -> None:
        for key, value in sample.items():
            self.values.setdefault(key, []).append(value)

    def row(self, key: str) -> list[str]:
        """p50, p95, min, max in ms."""
        v = sorted(self.values.get(key, []))
        picks = [percentile(v, 0.5), percentile(v, 0.95), v[0] if v else None, v[-1] if v else None]
        return [fmt(None if x is None else x * 1000) for x in picks]


def cli_once(topo: Topology, env: dict[str, str], image: str, sandbox_id: str) -> dict[str, float]:
    """`airlock run` end to end; times from just before it is launched."""
    argv = run_argv(image, sandbox_id, "sh", "-c", PROBE)
    t0 = time.time()
    proc = topo.run(topo.gw, argv, timeout=180, env=env)
    t_exit = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"airlock run exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    probe = parse_probe(proc.stdout)
    return {
        "running": probe.started - t0,
        "first_byte": probe.first_byte - t0,
        "ttfb": probe.ttfb,
        "exit": t_exit - t0,
        "after_body": t_exit - probe.done,
    }


IMPORTS = "import airlock.cli.run, airlock.launch.docker_launcher, docker"


def startup_once(topo: Topology, env: dict[str, str]) -> dict[str, float]:
    """For comparison: what `airlock run` costs before it does anything (`ip netns exec`, Python, its imports)."""
    t0 = time.time()
    proc = topo.run(topo.gw, [sys.executable, "-P", "-c", IMPORTS], timeout=60, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"importing airlock failed:\n{proc.stderr[-3000:]}")
    return {"startup": time.time() - t0}


MARKS: dict[str, float] = {}  # step -> time.time() when it returned, for the in-process run in progress


def instrument() -> None:
    """Timestamp the steps `launch()` and `DockerHandle.close()` take, by wrapping the methods they call (the code
    that runs is unchanged; only this process, never the `airlock run` subprocesses, is instrumented)."""

    def after(cls: type, name: str, mark: str) -> None:
        original = getattr(cls, name)
        if inspect.iscoroutinefunction(original):

            async def wrapped_async(self: Any, *args: Any, **kw: Any) -> Any:
                try:
                    return await original(self, *args, **kw)
                finally:
                    MARKS[mark] = time.time()

            setattr(cls, name, wrapped_async)
        else:

            def wrapped(self: Any, *args: Any, **kw: Any) -> Any:
                try:
                    return original(self, *args, **kw)
                finally:
                    MARKS[mark] = time.time()

            setattr(cls, name, wrapped)

    after(DockerSandbox, "create", "created")
    after(Gateway, "start", "gateway")
    after(DockerSandbox, "start", "started")
    after(Gateway, "stop", "gateway_stopped")
    after(DockerSandbox, "destroy", "destroyed")


async def _ticker(stalls: list[float], period: float = 0.005) -> None:
    """The longest gap between ticks of this event loop: how long `launch()` keeps it from serving anything else
    (in an orchestrator: every other sandbox's gateway on the same loop)."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(period)
        now = time.monotonic()
        stalls.append(now - last - period)
        last = now


async def _inprocess(client: docker.DockerClient, image: str, sandbox_id: str, state_dir: Path) -> dict[str, float]:
    """What `airlock run --backend docker` does (airlock/cli/run.py `_run_docker`): `launch()`, wait, logs, close."""
    argv = ["run", "--backend", "docker", "--image", image, "--policy", str(E2E_POLICY)]
    argv += ["--upstream-dns", DNS_SERVER, "--sandbox-id", sandbox_id, "--state-dir", str(state_dir), "--", "true"]
    args = build_parser(["run"]).parse_args(argv)
    run = run_config(args, ["sh", "-c", PROBE], load_policy_file(args.policy))
    MARKS.clear()
    stalls: list[float] = []
    ticker = asyncio.ensure_future(_ticker(stalls))
    await asyncio.sleep(0.02)
    t0 = time.time()
    handle = await launch(
        client, image, run.command, run.gateway, profile=run.profile, sandbox_id=sandbox_id, limits=run.limits,
        mounts=run.mounts, env=run.env, grants=run.grants, token_ttl=run.token_ttl,
    )  # fmt: skip
    launched = time.time()
    await asyncio.sleep(0.02)  # the ticker wakes and records the gap launch()'s last blocking call left
    ticker.cancel()
    try:
        code = await handle.wait(120)
        stdout, stderr = handle.logs()
        output = time.time()
        if code != 0:
            raise RuntimeError(f"sandbox {sandbox_id} exited {code}:\n{stdout!r}\n{stderr!r}")
    finally:
        teardown = time.time()
        await handle.close()
    probe = parse_probe(stdout.decode())
    return {
        "create": MARKS["created"] - t0,
        "gateway": MARKS["gateway"] - MARKS["created"],
        "container": MARKS["started"] - MARKS["gateway"],
        "launched": launched - t0,
        "stall": max(stalls, default=0.0),
        "to_first_byte": probe.first_byte - MARKS["started"],
        "ttfb": probe.ttfb,
        "total": probe.first_byte - t0,
        "output": output - t0,
        "gateway_stop": MARKS["gateway_stopped"] - teardown,
        "destroy": MARKS["destroyed"] - MARKS["gateway_stopped"],
        "teardown": MARKS["destroyed"] - teardown,
    }


def inprocess_once(topo: Topology, client: docker.DockerClient, image: str, sandbox_id: str, workdir: Path):
    state = workdir / f"state-{sandbox_id}"  # a fresh state dir (broker keys) per sandbox, as `airlock run` has
    state.mkdir()
    try:
        return in_netns(topo.gw, lambda: asyncio.run(_inprocess(client, image, sandbox_id, state)))
    finally:
        shutil.rmtree(state, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ part 2

LEFT_KINDS = ("containers", "networks", "fence tables", "bridges")


def counts(left: dict[str, list[str]]) -> str:
    return " / ".join(str(len(left[k])) for k in LEFT_KINDS)


def leftovers(topo: Topology, client: docker.DockerClient) -> dict[str, list[str]]:
    tables = topo.run(topo.gw, ["nft", "list", "tables"]).stdout.split("\n")
    bridges = topo.run(topo.gw, ["ip", "-o", "link", "show", "type", "bridge"]).stdout.splitlines()
    return {
        "containers": [c["Names"][0] for c in client.api.containers(all=True, filters={"label": LABEL})],
        "networks": [n.name for n in client.networks.list(filters={"label": LABEL})],
        "fence tables": [t.strip() for t in tables if "airlock_" in t],
        "bridges": [b.split(": ")[1] for b in bridges if ": alb" in b],
    }


def concurrent(
    topo: Topology,
    env: dict[str, str],
    client: docker.DockerClient,
    image: str,
    net: FakeNet,
    procs: list[subprocess.Popen[str]],
    count: int,
    requests: int,
) -> dict[str, Any]:
    script = LOOP.format(n=requests)
    ids = [f"{topo.prefix}c{i}" for i in range(count)]
    net.reset()
    alive_max = 0
    exits: dict[int, float] = {}
    t0 = time.time()
    for sandbox_id in ids:
        argv = run_argv(image, sandbox_id, "sh", "-c", script)
        procs.append(topo.popen(topo.gw, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    ours = procs[-count:]
    # Outputs are a few hundred bytes: the pipes never fill, so polling (and reading at the end) is safe.
    deadline = time.monotonic() + 600
    while len(exits) < count:
        if time.monotonic() > deadline:
            raise RuntimeError("the concurrent sandboxes did not finish within 600 s")
        # The low-level call: containers.list() inspects each one, which races with their removal.
        running = client.api.containers(filters={"label": LABEL, "status": "running"})
        alive_max = max(alive_max, len(running))
        for i, proc in enumerate(ours):
            if i not in exits and proc.poll() is not None:
                exits[i] = time.time()
        time.sleep(0.1)
    wall = max(exits.values()) - t0
    starts, ends, codes, failures = [], [], 0, []
    for i, proc in enumerate(ours):
        out, err = proc.communicate(timeout=30)
        lines = out.split()
        ok = sum(1 for line in lines[1:-1] if line == "200")
        codes += ok
        if proc.returncode != 0 or ok != requests:
            failures.append(f"{ids[i]}: exit {proc.returncode}, {ok}/{requests} 200s; {err.strip()[-500:]}")
        with contextlib.suppress(ValueError, IndexError):
            start, end = float(lines[0]), float(lines[-1])
            starts.append(start)
            ends.append(end)
    stats = net.stats()
    http = [r for r in stats["http"] if r["dst"] == f"{ALLOWED_IP}:80"]
    loops = sorted(e - s for s, e in zip(starts, ends, strict=True))
    return {
        "ids": ids,
        "alive_max": alive_max,
        "ok": codes,
        "sent": count * requests,
        "failures": failures,
        "wall": wall,
        "window": (max(ends) - min(starts)) if starts else None,
        "overlap": (min(ends) - max(starts)) if starts else None,
        "loops": loops,
        "fakenet_connections": stats["connections"].get(f"{ALLOWED_IP}:80", 0),
        "fakenet_requests": len(http) + stats["dropped"].get("http", 0),
        "fakenet_dns": ", ".join(
            f"{v} {k.split()[1]}" for k, v in sorted(stats["dns_typed"].items()) if k.split()[0] == "allowed.test"
        ),
        "left": leftovers(topo, client),
        "argv": run_argv(image, ids[0], "sh", "-c", script),
    }


# ------------------------------------------------------------------------------------------------ the run


def run_bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with common.fake_internet(workdir) as (topo, net, _, stoppable):
        # Safety: everything the gateway dials must land in the fake internet.
        for address in (ALLOWED_IP, DNS_SERVER):
            topo.assert_route_inside(topo.gw, address)
        daemon = DockerDaemon(topo, workdir / "docker").start()
        stoppable.append(daemon)
        procs: list[subprocess.Popen[str]] = []
        try:
            return measure(args, workdir, topo, net, daemon, procs)
        finally:
            for proc in procs:  # airlock runs still going: SIGTERM lets each remove its own sandbox
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(10)


def measure(
    args: argparse.Namespace,
    workdir: Path,
    topo: Topology,
    net: FakeNet,
    daemon: DockerDaemon,
    procs: list[subprocess.Popen[str]],
) -> dict[str, Any]:
    """Both parts; `procs` collects the `airlock run`s started, for the caller to stop."""
    client = daemon.client()
    print("  importing the sandbox image ...", file=sys.stderr, flush=True)
    image, tarball = build_image(daemon)
    env = {**os.environ, **daemon.env()}
    info = machine_info(client)

    instrument()
    cli_samples, proc_samples = Samples(), Samples()
    print("  warm-up ...", file=sys.stderr, flush=True)
    cold_cli = cli_once(topo, env, image, f"{topo.prefix}bw")
    cold_proc = inprocess_once(topo, client, image, f"{topo.prefix}pw", workdir)
    for i in range(args.sandboxes):
        print(f"  sandbox {i + 1}/{args.sandboxes} ...", file=sys.stderr, flush=True)
        cli_samples.add(cli_once(topo, env, image, f"{topo.prefix}b{i}"))
        cli_samples.add(startup_once(topo, env))
        proc_samples.add(inprocess_once(topo, client, image, f"{topo.prefix}p{i}", workdir))
    left_sequential = leftovers(topo, client)

    print(f"  {args.concurrent} sandboxes at once, {args.requests} requests each ...", file=sys.stderr, flush=True)
    conc = concurrent(topo, env, client, image, net, procs, args.concurrent, args.requests)
    return {
        "info": info,
        "image": image,
        "tarball": tarball,
        "cli": cli_samples,
        "proc": proc_samples,
        "cold_cli": cold_cli,
        "cold_proc": cold_proc,
        "left_sequential": left_sequential,
        "concurrent": conc,
        "probe_argv": run_argv(image, f"{topo.prefix}b0", "sh", "-c", PROBE),
    }


def report(command: str, args: argparse.Namespace, data: dict[str, Any]) -> str:
    c: Samples = data["cli"]
    p: Samples = data["proc"]
    conc = data["concurrent"]
    n = args.sandboxes
    lines = [
        "# airlock docker sandboxes: start to first byte, and sandboxes at once",
        "",
        f"`{command}`",
        "",
        common.machine_line(data["info"]),
        "",
        f"image `{data['image']}` (scripts/build-test-image, {data['tarball'].stat().st_size / 1e6:.0f} MB rootfs); "
        "dockerd in the gateway namespace of the e2e topology, overlay2; upstream: fakenet's allowed.test",
        "",
        f"## 1. Start to first byte, {n} sandboxes one after another (ms)",
        "",
        "| `airlock run --backend docker ... -- sh -c PROBE`, from launch to | p50 | p95 | min | max |",
        "|---|---:|---:|---:|---:|",
    ]

    def row(label: str, samples: Samples, key: str) -> None:
        lines.append(f"| {label} | " + " | ".join(samples.row(key)) + " |")

    row("the command runs in the container", c, "running")
    row("**first byte of the response, in the container**", c, "first_byte")
    row("`airlock run` has exited (output printed, everything removed)", c, "exit")
    row("  of which: after the body, until it exited (wait, logs, teardown)", c, "after_body")
    row("  curl's own time to first byte (through the proxy)", c, "ttfb")
    row("for comparison, alone: `ip netns exec` + Python + airlock's imports", c, "startup")
    lines += [
        "",
        "| the same in-process (`airlock.launch.docker_launcher.launch`, then `close()`), phase | p50 | p95 | min | max |",  # noqa: E501
        "|---|---:|---:|---:|---:|",
    ]
    row("network + fence (`DockerSandbox.create`)", p, "create")
    row("gateway start (`Gateway.start`: proxy, DNS, broker)", p, "gateway")
    row("container create + start (`DockerSandbox.start`, docker API)", p, "container")
    row("`launch()` returned (the three above)", p, "launched")
    row("  longest stall of the caller's event loop during `launch()`", p, "stall")
    row("start returned → first byte in the container", p, "to_first_byte")
    row("  curl's own time to first byte (through the proxy)", p, "ttfb")
    row("**total: launch → first byte**", p, "total")
    row("launch → the host has the output (`wait`, `logs`)", p, "output")
    row("teardown: gateway stop", p, "gateway_stop")
    row("teardown: container + network + fence removed (`destroy`)", p, "destroy")
    row("**teardown total**", p, "teardown")
    cold_cli, cold_proc = data["cold_cli"], data["cold_proc"]
    lines += [
        "",
        f"Warm-up (not counted; first sandbox after the image import): `airlock run` first byte "
        f"{cold_cli['first_byte'] * 1000:,.0f} ms, exit {cold_cli['exit'] * 1000:,.0f} ms; in-process first byte "
        f"{cold_proc['total'] * 1000:,.0f} ms. The two ways alternate (CLI, in-process, CLI, ...). Percentiles are "
        "nearest-rank over the samples; phases' p50s need not add up to the total's p50. "
        "The CLI figures include `ip netns exec` and the CLI's Python start-up (mitmproxy imports); in-process, the "
        "policy is loaded and the modules imported before the clock starts.",
        "",
        "PROBE: `" + PROBE + "`",
        "",
        "`airlock run`: `" + shlex.join(str(x) for x in data["probe_argv"]) + "`",
        "",
        f"## 2. {args.concurrent} sandboxes at once, {args.requests} requests each",
        "",
        "| | result |",
        "|---|---:|",
    ]
    loops = conc["loops"]
    per_request = [x / args.requests * 1000 for x in loops]
    left = conc["left"]
    rows = [
        ("sandbox containers running at once (max seen, docker API polled every ~0.1 s)", str(conc["alive_max"])),
        ("**requests answered 200 / sent**", f"**{conc['ok']:,} / {conc['sent']:,}**"),
        (
            "fakenet counted: connections / HTTP requests to allowed.test:80",
            f"{conc['fakenet_connections']:,} / {conc['fakenet_requests']:,}",
        ),
        ("fakenet counted: DNS queries for allowed.test (per gateway once, then cached)", conc["fakenet_dns"]),
        ("wall time, launch → last `airlock run` exited", f"{conc['wall']:.2f} s"),
        ("**requests/s over the wall time**", f"**{conc['ok'] / conc['wall']:,.1f}**"),
        (
            "requests/s while the loops ran (first loop start → last loop end, in the containers)",
            f"{conc['ok'] / conc['window']:,.1f} ({conc['window']:.2f} s)" if conc["window"] else "-",
        ),
        ("all loops running at the same time for", f"{conc['overlap']:.2f} s" if conc["overlap"] else "-"),
        (
            "per sandbox: loop time p50 / max; ms per request p50",
            f"{fmt(percentile(loops, 0.5), 2)} / {fmt(loops[-1] if loops else None, 2)} s; "
            f"{fmt(percentile(sorted(per_request), 0.5), 1)}",
        ),
        (
            "left afterwards: containers / networks / fence tables / bridges",
            counts(left),
        ),
        (
            f"left after part 1 ({2 * n + 2} sandboxes)",
            counts(data["left_sequential"]),
        ),
    ]
    lines += [f"| {label} | {value} |" for label, value in rows]
    for failure in conc["failures"]:
        lines.append(f"\nFAILED: {failure}")
    lines += [
        "",
        "Each `airlock run` has its own embedded gateway (a Python process with mitmproxy): "
        f"{args.concurrent} gateways, {args.concurrent} containers and their curls share the machine's CPUs. "
        "Every curl is a new process and a new connection to its gateway, which opens a new upstream connection.",
        "",
        "`airlock run`: `" + shlex.join(str(x) for x in conc["argv"]) + "` (and so on, in parallel)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--sandboxes", type=int, default=20, help="sandboxes one after another (default 20)")
    parser.add_argument("--concurrent", type=int, default=10, help="sandboxes at once (default 10)")
    parser.add_argument("--requests", type=int, default=50, help="requests per concurrent sandbox (default 50)")
    args = common.parse_args(parser, argv)
    if not (1 <= args.sandboxes <= 99 and 1 <= args.concurrent <= 50 and 1 <= args.requests <= 10_000):
        parser.error("keep --sandboxes in 1..99, --concurrent in 1..50 and --requests in 1..10000")
    if os.geteuid() != 0:
        parser.error("needs root for network namespaces and dockerd")
    problem = docker_problem(also=("debootstrap",))
    if problem:
        parser.error(problem)

    common.interrupt_on_sigterm()
    command = common.command_line("-P", "bench/docker.py")
    common.warn_if_loaded(os.getloadavg()[0], "worse")
    with common.scratch_dir("airlock-bench-docker-") as workdir:
        data = run_bench(args, workdir)
    text = report(command, args, data)
    common.emit(text, args.output)
    return 1 if data["concurrent"]["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
