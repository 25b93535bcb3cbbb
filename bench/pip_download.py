"""`pip download` of 20 real wheels from a local HTTPS simple index: straight, through squid, through airlock
(passed through) and through airlock inspecting the index (TLS ended and re-made by the gateway), side by side in
one interleaved run.

    sudo .venv/bin/python -P bench/pip_download.py [--rounds 5] [--wheels N] [--output F]

The wheels are the newest ones of this environment's own dependencies found in the machine's local package
folders (/opt/pypi/files, /opt/pypi-more/files, /opt/wheels: real wheels of real projects), the largest first, for
this interpreter. A PEP 503 index of them is served over HTTPS (the test CA's leaf) on 192.0.2.10:4443 in the fake
internet; pip (this environment's, `--isolated`, no cache, no configuration, no local folders) downloads them all with
`--no-deps` into a fresh folder each round, from the sandbox namespace through each proxy (`allowed.test:4443`),
or from the gateway namespace straight to the address (direct). Each round's wall time is pip's whole run; a
proxy's CPU is its process tree's user + system time over the round. The server counts the bytes it sent, so a run
that read a wheel from anywhere else fails.

All traffic stays inside the namespaces of airlock/verify/topology.py; every process is started here and stopped by
PID, the namespaces deleted at the end. Needs root and squid (apt-get install -y squid).
"""

from __future__ import annotations

import argparse
import hashlib
import html
import http.server
import os
import re
import shutil
import ssl
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.append(str(REPO / "bench"))

from peers import Squid, tree_user_system_seconds  # noqa: E402

from airlock.verify.topology import GW_IP, Topology  # noqa: E402

import common  # noqa: E402
from common import UPSTREAM_IP  # noqa: E402
from gateway_proc import GatewayProcess  # noqa: E402

LOCAL_FOLDERS = (Path("/opt/pypi/files"), Path("/opt/pypi-more/files"), Path("/opt/wheels"))
INDEX_PORT = 4443
PORTS = {"squid": 3190, "airlock": 3191, "airlock, inspected": 3192}
GATEWAY_FLAGS = ("--dns-port", "0", "--broker-port", "0", "--transparent-port", "0")
POLICY = """version: 1
profiles:
  default:
    allow:
      - host: allowed.test
        ports: [{port}]{inspect}
"""
_TAGS = re.compile(r"-(py3|py2\.py3|cp3\d+)-(none|abi3|cp3\d+)-(any|manylinux[^-]*x86_64[^-]*)\.whl$")


def own_wheels(n: int) -> list[Path]:
    """The largest `n` wheels, one per project, of what this environment has installed, found locally."""
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    found: dict[str, Path] = {}
    for dist in metadata.distributions():
        name = re.sub(r"[-_.]+", "_", dist.metadata["Name"]).lower()
        for folder in LOCAL_FOLDERS:
            for wheel in folder.glob(f"*-{dist.version}-*.whl") if folder.is_dir() else ():
                stem = re.sub(r"[-_.]+", "_", wheel.name.split("-", 1)[0]).lower()
                if stem == name and _installable(wheel.name, python):
                    found.setdefault(name, wheel)
    return sorted(found.values(), key=lambda p: p.stat().st_size, reverse=True)[:n]


def _installable(filename: str, python: str) -> bool:
    """Whether this interpreter installs the wheel: pure Python, its own CPython's, or the stable ABI of one before."""
    tags = _TAGS.search(filename)
    if tags is None:
        return False
    interpreter, abi, _ = tags.groups()
    if abi == "none":
        return interpreter in ("py3", "py2.py3")
    if abi == "abi3":
        return interpreter.startswith("cp3") and int(interpreter[3:]) <= int(python[3:])
    return interpreter == abi == python


def make_index(wheels: list[Path], root: Path) -> None:
    """A PEP 503 simple index of `wheels` in `root` (simple/<project>/ and files/), each link with its sha256."""
    (root / "files").mkdir(parents=True)
    for wheel in wheels:
        shutil.copy(wheel, root / "files" / wheel.name)
        project = re.sub(r"[-_.]+", "-", wheel.name.split("-", 1)[0]).lower()
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        page = root / "simple" / project
        page.mkdir(parents=True)
        link = html.escape(f"../../files/{wheel.name}#sha256={digest}")
        (page / "index.html").write_text(f'<!DOCTYPE html><html><body><a href="{link}">{wheel.name}</a></body></html>')


def serve(root: Path, cert: Path, key: Path, port: int, sent_log: Path) -> None:
    """The index over HTTPS (HTTP/1.1, kept alive), appending each answer's bytes to `sent_log`."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:
            pass

        def copyfile(self, source, outputfile) -> None:  # type: ignore[no-untyped-def]
            before = source.tell()
            super().copyfile(source, outputfile)
            with sent_log.open("a") as log:
                log.write(f"{self.path} {source.tell() - before}\n")

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = http.server.ThreadingHTTPServer((UPSTREAM_IP, port), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.serve_forever()


class IndexServer(common.ListeningServer):
    name, ss_flags, poll_s = "index", "-Hltn", 0.1

    def __init__(self, topo: Topology, workdir: Path, root: Path, cert: Path, key: Path) -> None:
        super().__init__(topo, workdir, INDEX_PORT, "index.log")
        self.root, self.cert, self.key, self.sent_log = root, cert, key, workdir / "index-sent.log"

    def start(self, timeout: float = 30) -> IndexServer:
        argv = [sys.executable, "-P", __file__, "--serve", self.root, "--cert", self.cert, "--key", self.key]
        with self.log_path.open("wb") as log:
            self.proc = self.topo.popen(self.topo.net, [*argv, "--sent-log", self.sent_log], stdout=log,
                                        stderr=log)  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.topo.run(self.topo.net, ["ss", self.ss_flags, f"sport = :{self.port}"]).stdout.strip():
                return self
            time.sleep(self.poll_s)
        raise RuntimeError(f"the index did not listen: {self.log_path.read_text()}")

    def sent(self) -> int:
        if not self.sent_log.exists():
            return 0
        return sum(int(line.rsplit(" ", 1)[1]) for line in self.sent_log.read_text().splitlines())


@dataclass
class Column:
    name: str
    ns: str
    index: str
    proxy: str | None
    ca: Path
    pid: int | None
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)


def pip_download(topo: Topology, column: Column, wheels: list[Path], dest: Path) -> float:
    """pip downloads every wheel through the column's route; its wall time."""
    shutil.rmtree(dest, ignore_errors=True)
    requirements = [f"{w.name.split('-')[0]}=={w.name.split('-')[1]}" for w in wheels]
    proxy = ["--proxy", column.proxy] if column.proxy else []
    argv = ["env", "-i", f"PATH={os.environ.get('PATH', '')}", "PIP_CONFIG_FILE=/dev/null",
            sys.executable, "-m", "pip", "--isolated", "--no-cache-dir", "--disable-pip-version-check", "-q",
            "download", "--no-deps", "--only-binary", ":all:", "-d", dest, "-i", column.index, "--cert", column.ca,
            *proxy, *requirements]  # fmt: skip
    started = time.monotonic()
    proc = topo.run(column.ns, argv, timeout=300)
    wall = time.monotonic() - started
    got = sorted(p.name for p in dest.glob("*.whl"))
    if proc.returncode != 0 or got != sorted(w.name for w in wheels):
        raise RuntimeError(f"pip via {column.name}: exit {proc.returncode}, {len(got)}/{len(wheels)} wheels: "
                           f"{proc.stderr.strip()[-800:]}")  # fmt: skip
    return wall


def start_gateway(topo: Topology, workdir: Path, name: str, inspect: bool, upstream_ca: Path) -> GatewayProcess:
    gwdir = workdir / name.replace(", ", "-")
    gwdir.mkdir()
    policy = gwdir / "policy.yaml"
    policy.write_text(POLICY.format(port=INDEX_PORT, inspect="\n        inspect: true" if inspect else ""))
    extra = ("--proxy-port", str(PORTS[name]), *GATEWAY_FLAGS, "--upstream-ca", str(upstream_ca))
    gateway = GatewayProcess(topo, gwdir, policy, extra)
    assert gateway.start().proc is not None
    return gateway


def report(info: dict[str, str], command: str, columns: list[Column], wheels: list[Path], elapsed: float) -> str:
    size = sum(w.stat().st_size for w in wheels) / 1e6
    direct = statistics.median(columns[0].wall_s)
    out = ["## pip download of real wheels", "", common.machine_line(info),
           f"command: `{command}` ({elapsed:.0f} s): {len(wheels)} wheels, {size:.1f} MB, "
           f"{len(columns[0].wall_s)} interleaved rounds", "",
           "| route | pip wall s (median) | x direct | proxy CPU s (median) |", "|---|---:|---:|---:|"]  # fmt: skip
    for c in columns:
        wall = statistics.median(c.wall_s)
        cpu = f"{statistics.median(c.cpu_s):.2f}" if c.cpu_s else "-"
        out.append(f"| {c.name} | {wall:.2f} | {wall / direct:.2f} | {cpu} |")
    out += ["", "wheels: " + ", ".join(w.name for w in wheels)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="pip runs per route, interleaved (default 5)")
    parser.add_argument("--wheels", type=int, default=20, help="how many wheels (default 20)")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the index server, in the fake internet
    parser.add_argument("--cert", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--key", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--sent-log", type=Path, help=argparse.SUPPRESS)
    args = common.parse_args(parser, argv)
    if args.serve:
        serve(args.serve, args.cert, args.key, INDEX_PORT, args.sent_log)
        return 0
    if not (1 <= args.rounds <= 20 and 1 <= args.wheels <= 100):
        parser.error("keep --rounds in 1..20, --wheels in 1..100")
    if os.geteuid() != 0:
        parser.error("needs root for network namespaces")
    if shutil.which("squid") is None and not Path("/usr/sbin/squid").exists():
        parser.error("squid not found (apt-get install -y squid)")
    wheels = own_wheels(args.wheels)
    if len(wheels) < args.wheels:
        parser.error(f"only {len(wheels)} wheels of this environment's projects found in {LOCAL_FOLDERS}")
    common.interrupt_on_sigterm()
    command = common.command_line("-P", "bench/pip_download.py")
    started = time.monotonic()
    info = common.machine_info(pip=metadata.version("pip"))
    with common.scratch_dir("airlock-bench-") as workdir, common.fake_internet(workdir) as (topo, _, ca, procs):
        topo.assert_route_inside(topo.sbx, GW_IP)
        root = Path(tempfile.mkdtemp(prefix="index-", dir=workdir))
        make_index(wheels, root)
        index = IndexServer(topo, workdir, root, ca.leaf_cert, ca.leaf_key).start()
        procs.append(index)
        squid = Squid(topo, workdir, PORTS["squid"]).start()
        procs.append(squid)
        passed = start_gateway(topo, workdir, "airlock", False, ca.ca_cert)
        inspected = start_gateway(topo, workdir, "airlock, inspected", True, ca.ca_cert)
        procs += [passed, inspected]
        (gateway_ca,) = (workdir / "airlock-inspected" / "state" / "ca").glob("*/gateway-ca-*.pem")
        named = f"https://allowed.test:{INDEX_PORT}/simple/"
        columns = [
            Column("direct (gw → index)", topo.gw, f"https://{UPSTREAM_IP}:{INDEX_PORT}/simple/", None, ca.ca_cert,
                   None),
            Column("squid", topo.sbx, named, f"http://{GW_IP}:{squid.port}", ca.ca_cert, squid.pid),
            Column("airlock", topo.sbx, named, f"http://{GW_IP}:{PORTS['airlock']}", ca.ca_cert, passed.proc.pid),
            Column("airlock, inspected", topo.sbx, named, f"http://{GW_IP}:{PORTS['airlock, inspected']}",
                   gateway_ca, inspected.proc.pid),
        ]  # fmt: skip
        dest = workdir / "downloads"
        total = sum(w.stat().st_size for w in wheels)
        for column in columns:  # warm-up, and each route checked to fetch every byte from the index
            before = index.sent()
            pip_download(topo, column, wheels, dest)
            if index.sent() - before < total:
                raise RuntimeError(f"{column.name}: the index sent {index.sent() - before} of {total} bytes")
        for i in range(args.rounds):
            for column in columns if i % 2 == 0 else [columns[0], *reversed(columns[1:])]:
                print(f"  round {i + 1}: {column.name} ...", file=sys.stderr, flush=True)
                cpu0 = sum(tree_user_system_seconds(column.pid)) if column.pid else 0.0
                column.wall_s.append(pip_download(topo, column, wheels, dest))
                if column.pid:
                    column.cpu_s.append(sum(tree_user_system_seconds(column.pid)) - cpu0)
    common.emit(report(info, command, columns, wheels, time.monotonic() - started), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
