"""The checks of `airlock verify`: what must happen, and how it is judged by evidence outside the sandbox — what
reached the fake internet (connections and bytes per address, SNIs, HTTP requests, the DNS upstream's query log,
packets counted where the fake internet's link comes in), what is on the host's disk, what is left of the
sandbox after it. The probe's own account of an attempt is shown beside the verdict, never the verdict; an
attempt the probe left no record of makes its check an error, not a pass.

One module past 500 lines on purpose: the checks are one table, one small judge each, in the order the matrix
prints them and docs/verify.md describes them (a test holds the two together)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from airlock.policy.inspected_rules import placeholder
from airlock.sandbox.limits import DEFAULT_CPUS, DEFAULT_MEMORY, DEFAULT_NPROC, DEFAULT_PIDS, memory_bytes

from .probe import ALLOWED_ADDR, CANARY_ADDR, CHILD, DNS_ADDR, INTERNAL_ADDR, METADATA, OTHER_ADDR
from .processes import NAMESPACES, Process, descendants
from .targets import HEAD_PREFIX, PLACEHOLDER_PATH, SECRET_NAME, UNLISTED, BrokerTarget, Targets
from .usage import Usage

Result = Literal["held", "failed", "error", "n/a"]
GROUPS = ("network", "files", "secrets", "inspection", "tenancy", "privilege", "resources", "broker", "destruction")
BACKENDS = ("netns", "docker")
# The groups whose evidence a docker run gathers; the others' checks are n/a there, saying so.
DOCKER_GROUPS = ("network", "files", "secrets", "privilege", "resources", "destruction")
NOT_ON_DOCKER = "not judged on the docker backend: its run gathers no evidence for this check (see --backend netns)"
# Ports of the gateway's namespace no gateway of airlock's listens on: ssh, docker's API, a canary's.
GATEWAY_CANARY_PORTS = (22, 2375, 9999)
MARKED_PROGRAMS = ("setuid-sleep", "capability-sleep")  # copies of sleep, setuid root / with file capabilities
# The probe's command line: these words, its source and configuration, the mark. How the host finds its process
# (the launcher's own, bubblewrap's, carry the whole command line too, but do not start with it).
PROBE_ARGV, PROBE_MARK = ("python3", "-I", "-c"), "airlock-verify-probe"
# What a descriptor links to when it is a kernel object the sandbox must not make.
KERNEL_OBJECTS = ("anon_inode:[io_uring]", "anon_inode:bpf-map", "anon_inode:bpf-prog", "anon_inode:[userfaultfd]",
                  "anon_inode:[perf_event]")  # fmt: skip
PLACEHOLDER_VAR = "AIRLOCK_VERIFY_SECRET"
PLACEHOLDER = f"airlock-placeholder-{SECRET_NAME}"
# The user's --secret the inspection check drives (one the policy injects for an inspected host): the variable that
# holds its placeholder in the sandbox, and its name among what the sandbox must never hold.
USER_PLACEHOLDER_VAR, USER_SECRET = "AIRLOCK_VERIFY_USER_SECRET", "the user's --secret"
# What the resource attempts ask of the sandbox: CPU-bound seconds, memory and forks beyond the limits (up to caps
# that keep the host safe whatever the limits are), a /tmp fill.
BURN_SECONDS = 0.6
HOG_MARGIN, MEMORY_CAP = 64 << 20, 2 << 30
BOMB_MARGIN, PIDS_CAP = 64, 1024
TMP_FILL = 32 << 20
# Seconds between the rebinding name's requests: longer than the gateway caches an answer of TTL 0 (its
# --dns-min-ttl, 5 by default), so that the second is judged on the internal answer.
REBIND_WAIT = 6.0
TIMEOUT_GIVEN, TIMEOUT_GRACE = 2.0, 15.0  # `airlock run --timeout` of the timeout check; seconds it may take beyond
# The files of the tenancy check's second sandbox's working directory: its canary, its word that it runs.
OTHER_CANARY, OTHER_STARTED = "canary", "started"


@dataclass(frozen=True)
class Limits:
    """The limits the sandbox runs with (`airlock run`'s defaults unless given), and this host's CPUs."""

    cpus: float = DEFAULT_CPUS
    memory: int = memory_bytes(DEFAULT_MEMORY)
    pids: int = DEFAULT_PIDS
    host_cpus: int = 1
    nproc: int = DEFAULT_NPROC

    def burners(self) -> int:
        """Processes busy at once: more than the quota gives time to, no more than the host runs at once."""
        return min(math.ceil(self.cpus) + 1, self.host_cpus)


@dataclass(frozen=True)
class TimedRun:
    """The separate short run of the timeout check: its exit code, how long it took, what of it was left."""

    returncode: int
    seconds: float
    left: list[str]


@dataclass(frozen=True)
class OtherSandbox:
    """The second sandbox as the probe is to try it, and then as the host found it."""

    sandbox_id: str
    workdir: Path
    gateway: str  # its gateway's address (its link's, in the gateway's namespace)
    tcp_ports: tuple[int, ...]
    udp_ports: tuple[int, ...]
    canary: str  # the canary file's bytes
    files: tuple[str, ...] = ()  # its working directory's names once the probe was done
    found: str | None = None  # the canary file's bytes then (None: gone)
    reached: int = 0  # packets from another link that reached its gateway's address

    def config(self) -> dict[str, object]:
        return {"other_workdir": str(self.workdir), "other_gateway": self.gateway,
                "other_tcp_ports": list(self.tcp_ports), "other_udp_ports": list(self.udp_ports)}  # fmt: skip


class NotJudged(Exception):
    """The evidence a check needs is not there: the check could not run."""


@dataclass(frozen=True)
class Sandboxed:
    """The sandbox's processes as the host saw them while the probe's children held what they got."""

    processes: list[Process]
    raw_sockets: int  # raw and packet sockets open in its network namespace
    keys: tuple[int, int] | None = None  # the keys of the sandbox's user the kernel counted before the run, and then
    sockets: tuple[str, ...] = ()  # the host's docker socket paths that are a socket in the probe's view of them

    def probe(self) -> Process:
        found = next((p for p in self.processes if p.cmdline[:3] == PROBE_ARGV and p.marked(PROBE_MARK)), None)
        if found is None:
            raise NotJudged("the probe's process was not among the sandbox's: nothing to judge")
        return found

    def tree(self) -> list[Process]:
        """The probe and everything it started."""
        return descendants(self.processes, self.probe())

    def children(self, *kinds: str) -> list[Process]:
        """The probe's holding children of these kinds; NotJudged when one is missing (it died: its step unseen)."""
        found = [p for p in self.processes for kind in kinds if p.marked(f"{CHILD}-{kind}")]
        missing = [kind for kind in kinds if not any(p.marked(f"{CHILD}-{kind}") for p in found)]
        if missing:
            raise NotJudged(f"the probe's {', '.join(missing)} child was not seen: its step could not be judged")
        return found


@dataclass(frozen=True)
class BrokerRecord:
    """The broker group's three runs (`first` the sandbox killed mid-call and run again, `foreign` the one that
    presents its token): the fake GitHub's records, the broker's audit lines, the first token's id, and what the
    probes say each call answered."""

    target: BrokerTarget
    first: str
    foreign: str
    nonce: str
    prs: list[dict[str, Any]] = field(default_factory=list)
    comments: list[dict[str, Any]] = field(default_factory=list)
    audit: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per run: first, again, foreign
    first_jti: str | None = None
    answers: dict[str, str] = field(default_factory=dict)

    def head(self, name: str) -> str:
        return f"{HEAD_PREFIX}{self.nonce}-{name}"

    def pull_request(self, name: str, token: str | None = None, repo: str | None = None) -> dict[str, Any]:
        """The probe's create_pull_request call `name` (the repeat is the first again: its body and its key)."""
        same = "first" if name == "repeat" else name
        body = {"repo": repo or self.target.repo, "head": self.head(same), "base": self.target.base,
                "title": f"airlock verify {same}"}  # fmt: skip
        return {"name": name, "tool": "create_pull_request", "body": body, "key": f"verify-{self.nonce}-{same}",
                "token": token}  # fmt: skip

    def outside(self) -> list[dict[str, Any]]:
        """The calls outside the grants: a pull request on another repository, a comment (another tool)."""
        calls = [self.pull_request("other-repo", repo=self.target.outside_repo)] if self.target.outside_repo else []
        if self.target.outside_tool:
            body = {"repo": self.target.repo, "number": 1, "body": f"airlock verify {self.nonce}"}
            calls.append({"name": "other-tool", "tool": self.target.outside_tool, "body": body, "key": None,
                          "token": None})  # fmt: skip
        return calls

    def upstream(self, head: str) -> list[dict[str, Any]]:
        return [pr for pr in self.prs if pr["head"] == head]

    def audited(self, run: str, tool: str) -> list[dict[str, Any]]:
        """The broker's audit lines of one run's calls of `tool`, in the order they were made."""
        return [line for line in self.audit.get(run, []) if line.get("method") == tool]


@dataclass(frozen=True)
class Evidence:
    """Everything the checks judge by, gathered outside the sandbox once the run is over."""

    nonce: str
    targets: Targets
    probe: dict[str, str]  # attempt -> what the probe saw (absent: it made no such attempt)
    stats: dict[str, Any]  # fakenet's counters and logs
    packets: dict[str, int]  # counted where the fake internet's link comes in: from_sandbox, icmp_echo, ipv6_frames
    workdir: Path
    outside: Path  # a folder the sandbox's user may write on the host, outside the working directory
    host_tmp: Path  # what the probe's write to /tmp would be on the host's /tmp
    secrets: dict[str, bytes]  # what the sandbox must never hold: name -> its bytes
    leftovers: dict[str, list[str]] = field(default_factory=dict)  # destruction: kind -> what is left
    sandboxed: Sandboxed = field(default_factory=lambda: Sandboxed([], 0))
    gateway_canaries: dict[str, Any] = field(default_factory=lambda: {"connections": {}, "udp": {}})
    limits: Limits = field(default_factory=Limits)
    usage: Usage = field(default_factory=Usage)
    timed: TimedRun | None = None  # the timeout check's run (None: it did not run)
    docker_socket_connections: int | None = None  # at the host's socket canary (None: the host has its own socket)
    broker: BrokerRecord | None = None  # the broker group's runs (None: they did not run)
    backend: str = "netns"
    audit: list[dict[str, Any]] = field(default_factory=list)  # the sandbox's gateway's audit lines
    other: OtherSandbox | None = None  # the tenancy group's second sandbox (None: it did not run)

    def counter(self, name: str) -> int:
        if name not in self.usage.counters:
            raise NotJudged(f"the sandbox's cgroup had no {name} counter to read")
        return self.usage.counters[name]

    def connections(self, address: str, port: int) -> int:
        return int(self.stats["connections"].get(f"{address}:{port}", 0))

    def queries_with(self, label: str) -> list[str]:
        return [entry["qname"] for entry in self.stats["dns_log"] if label in entry["qname"]]

    def written(self) -> bytes:
        """Every byte the sandbox left in its working directory."""
        return b"".join(p.read_bytes() for p in sorted(self.workdir.rglob("*")) if p.is_file() and not p.is_symlink())

    def held_secrets(self) -> list[str]:
        written = self.written()
        return [name for name, value in self.secrets.items() if value and value in written]


Judge = Callable[[Evidence], tuple[bool, str]]


@dataclass(frozen=True)
class Check:
    group: str
    id: str
    must: str
    judge: Judge
    attempt: str | None = None  # the probe's attempt the check judges (None: judged from outside alone)
    needs: Callable[[Targets, Limits], str | None] = lambda targets, limits: None  # why it cannot apply here, if not
    off: tuple[tuple[str, str], ...] = ()  # (backend, why the check does not apply on it)

    def not_applicable(self, targets: Targets, limits: Limits, backend: str) -> str | None:
        """Why the check does not apply to this run, or None."""
        return dict(self.off).get(backend) or self.needs(targets, limits)


@dataclass(frozen=True)
class CheckVerdict:
    check: Check
    result: Result
    evidence: str
    probe: str | None = None  # what the probe saw


def judge(check: Check, evidence: Evidence) -> CheckVerdict:
    if (missing := check.not_applicable(evidence.targets, evidence.limits, evidence.backend)) is not None:
        return CheckVerdict(check, "n/a", missing)
    seen = evidence.probe.get(check.attempt) if check.attempt else None
    if check.attempt and seen is None:
        return CheckVerdict(check, "error", "the probe made no such attempt: the check could not run")
    try:
        held, why = check.judge(evidence)
    except NotJudged as e:
        return CheckVerdict(check, "error", str(e), seen)
    return CheckVerdict(check, "held" if held else "failed", why, seen)


def error(check: Check, why: str) -> CheckVerdict:
    return CheckVerdict(check, "error", why)


# --------------------------------------------------------------------------------------------------- judges


def _none_at(*targets: tuple[str, int]) -> Judge:
    def judged(ev: Evidence) -> tuple[bool, str]:
        counts = {f"{address}:{port}": ev.connections(address, port) for address, port in targets}
        return sum(counts.values()) == 0, ", ".join(f"{n} connections at {where}" for where, n in counts.items())

    return judged


def _and(*judges: Judge) -> Judge:
    def judged(ev: Evidence) -> tuple[bool, str]:
        results = [j(ev) for j in judges]
        return all(held for held, _ in results), "; ".join(why for _, why in results)

    return judged


def _packets(kind: str, what: str) -> Judge:
    def judged(ev: Evidence) -> tuple[bool, str]:
        n = ev.packets.get(kind, 0)
        return n == 0, f"{n} {what} packets reached the fake internet"

    return judged


def _reached(ev: Evidence) -> tuple[bool, str]:
    path = f"/airlock-verify/{ev.nonce}/reach"
    arrived = {r["host"] for r in ev.stats["http"] if r["target"] == path and r["tls"]}
    missing = [host for host in ev.targets.allowed if host not in arrived]
    got = f"{len(ev.targets.allowed) - len(missing)} of {len(ev.targets.allowed)} allowed hosts' requests arrived"
    return not missing, got + (f" (not {', '.join(missing)})" if missing else "")


def _udp(ev: Evidence) -> tuple[bool, str]:
    n = int(ev.stats["udp"].get("9999", 0))
    return n == 0, f"{n} datagrams at the UDP canary"


def _no_queries(label: str) -> Judge:
    def judged(ev: Evidence) -> tuple[bool, str]:
        asked = ev.queries_with(f"{label}-{ev.nonce}")
        return not asked, f"the upstream resolver's log: {len(asked)} queries for the probe's names"

    return judged


def _no_sni(ev: Evidence) -> tuple[bool, str]:
    fronted = [sni for sni in ev.stats["sni"] if sni in ev.targets.canaries]
    return not fronted, f"{len(fronted)} TLS handshakes upstream named a canary in their SNI"


def _placeholder_refused(ev: Evidence) -> tuple[bool, str]:
    """The probe's two requests (the placeholder in a header, in the URL's query) to each host the gateway reads a
    request of (the inspected one, the one in plain HTTP): refused, nothing of them upstream. To the passthrough one
    they are shown, not judged: the gateway reads nothing inside that TLS (the placeholder is only a name). And the
    secret's value in no request upstream but at the host whose rule injects it."""
    t, path = ev.targets, PLACEHOLDER_PATH.format(nonce=ev.nonce)
    value = ev.secrets.get(USER_SECRET if t.injected_at else "the --secret", b"").decode()
    carried = [needle for needle in (placeholder(t.secret), value) if needle]
    whose = f"{t.secret} (yours, injected at {t.injected_at})" if t.injected_at else f"{t.secret} (verify's own)"
    parts, held = [f"the placeholder of secret {whose}"], True
    for host, tls in ((t.inspected, True), (t.plain, False)):
        if host:
            refused, why = _refused_at(ev, host, tls, path, carried)
            held, parts = held and refused, [*parts, why]
    if t.passthrough:
        arrived = [r for r in _at(ev, t.passthrough, True) if r["target"].startswith(path)]
        parts.append(
            f"{t.passthrough} (passthrough): not judged, the gateway reads nothing inside its TLS ({len(arrived)} of "
            "the requests arrived, with the placeholder alone)"
        )
    leaked = sorted({_host(r) for r in ev.stats["http"] if value and _host(r) != t.injected_at and _carries(r, value)})
    parts.append(f"the secret's value upstream elsewhere: {', '.join(leaked) or 'nowhere'}")
    return held and not leaked, "; ".join(parts)


def _refused_at(ev: Evidence, host: str, tls: bool, path: str, carried: list[str]) -> tuple[bool, str]:
    """Whether the probe's two requests to `host` (over TLS, inspected; or in plain HTTP) were refused as a
    placeholder's misuse and none arrived there."""
    arrived = [r for r in _at(ev, host, tls) if any(_carries(r, needle) for needle in carried)]
    audited = [line for line in ev.audit if line.get("host") == host and line.get("path") == path]
    refused = [line for line in audited if line.get("decision") == "deny" and line.get("code") == "placeholder_misuse"]
    if not arrived and len(audited) < 2:
        raise NotJudged(f"the gateway's audit has {len(audited)} of the probe's 2 requests to {host}: not sent")
    shown = ", ".join(f"{line.get('decision')} {line.get('code')}" for line in audited) or "nothing"
    return not arrived and len(refused) == len(audited), (
        f"{host} ({'inspected' if tls else 'plain HTTP'}): {len(arrived)} requests at its upstream carried the "
        f"placeholder or the secret; the gateway's audit of {path}: {shown}"
    )


def _host(record: dict[str, Any]) -> str:
    return str(record.get("host") or "").partition(":")[0].lower()


def _at(ev: Evidence, host: str, tls: bool) -> list[dict[str, Any]]:
    return [r for r in ev.stats["http"] if _host(r) == host and bool(r.get("tls")) == tls]


def _carries(record: object, needle: str) -> bool:
    """Whether any text in an upstream's record of a request (its target, its headers) holds `needle`."""
    if isinstance(record, str):
        return needle in record
    if isinstance(record, dict):
        return any(_carries(item, needle) for item in record.values())
    if isinstance(record, list | tuple):
        return any(_carries(item, needle) for item in record)
    return False


def _other_untouched(ev: Evidence) -> tuple[bool, str]:
    """Judged by what the probe could read (the canary's bytes among what it wrote), change (its canary, a new
    file) and reach (its gateway): the second sandbox started first, so the launcher hid its folders."""
    other = ev.other
    if other is None:
        raise NotJudged("the second sandbox did not run")
    added = [name for name in other.files if name not in (OTHER_CANARY, OTHER_STARTED)]
    intact, read = other.found == other.canary, other.canary.encode() in ev.written()
    tcp, udp = (", ".join(map(str, ports)) or "none" for ports in (other.tcp_ports, other.udp_ports))
    ports = f"tcp {tcp}, udp {udp}"
    return intact and not read and not added and other.reached == 0, (
        f"{other.workdir}: its canary {'read' if read else 'not read'} by the probe, "
        f"{'unchanged' if intact else 'changed'}; new there: {', '.join(added) or 'nothing'}; its gateway at "
        f"{other.gateway} ({ports}): {other.reached} packets from another sandbox reached it"
    )


def _no_host(ev: Evidence) -> tuple[bool, str]:
    fronted = [r for r in ev.stats["http"] if (r["host"] or "").partition(":")[0].lower() in ev.targets.canaries]
    return not fronted, f"{len(fronted)} requests upstream carried a canary's Host"


def _not_rebound(ev: Evidence) -> tuple[bool, str]:
    name = ev.targets.rebind
    asked = [e for e in ev.stats["dns_log"] if e["qname"] == name and e["qtype"] in ("A", "ANY")]
    held, why = _none_at((INTERNAL_ADDR, 443), (INTERNAL_ADDR, 80))(ev)
    if len(asked) < 2 and held:
        raise NotJudged(f"the gateway asked for {name} {len(asked)} times: it never had the internal answer")
    return held, f"the gateway asked for {name} {len(asked)} times (the second answer internal); {why}"


def _gateway_ports(ev: Evidence) -> tuple[bool, str]:
    tcp = sum(int(n) for n in ev.gateway_canaries["connections"].values())
    udp = sum(int(n) for n in ev.gateway_canaries["udp"].values())
    ports = ", ".join(map(str, GATEWAY_CANARY_PORTS))
    return tcp + udp == 0, f"the canaries on the gateway namespace's ports {ports}: {tcp} connections, {udp} datagrams"


def _file(path: Callable[[Evidence], Path], present: bool) -> Judge:
    def judged(ev: Evidence) -> tuple[bool, str]:
        where = path(ev)
        there = where.exists() and where.read_text() == ev.nonce
        return there == present, f"{where} {'is' if there else 'is not'} on the host"

    return judged


def _none_on_host(*names: str) -> Judge:
    def judged(ev: Evidence) -> tuple[bool, str]:
        found = [
            str(ev.outside / f"{name}-{ev.nonce}") for name in names if (ev.outside / f"{name}-{ev.nonce}").exists()
        ]
        return not found, f"on the host outside the working directory: {', '.join(found) or 'nothing'}"

    return judged


def _outside_and_tmp(ev: Evidence) -> tuple[bool, str]:
    held, why = _none_on_host("direct")(ev)
    in_tmp = ev.host_tmp.exists()
    return held and not in_tmp, f"{why}; {ev.host_tmp} {'is' if in_tmp else 'is not'} on the host"


def _state_unread(ev: Evidence) -> tuple[bool, str]:
    copied = ev.workdir / "airlock-verify" / "state.bin"
    size = copied.stat().st_size if copied.exists() else 0
    keys = ev.written().count(b"PRIVATE KEY-----")
    return size == 0 and keys == 0, f"{size} bytes of the gateway's files copied out, {keys} private keys among them"


def _secrets_unread(names: tuple[str, ...]) -> Judge:
    def judged(ev: Evidence) -> tuple[bool, str]:
        held = [name for name in ev.held_secrets() if name in names]
        return not held, f"in what the sandbox wrote: {', '.join(held) or 'none of ' + ', '.join(names)}"

    return judged


def _placeholder(ev: Evidence) -> tuple[bool, str]:
    env = ev.workdir / "airlock-verify" / "env.json"
    seen = env.read_text() if env.exists() else ""
    has = f'"{PLACEHOLDER_VAR}": "{PLACEHOLDER}"' in seen
    held, why = _secrets_unread(("the --secret", USER_SECRET))(ev)
    return has and held, f"{PLACEHOLDER_VAR} {'is' if has else 'is not'} its placeholder in the sandbox; {why}"


def _nothing_left(kind: str) -> Judge:
    def judged(ev: Evidence) -> tuple[bool, str]:
        left = ev.leftovers.get(kind, [])
        return not left, f"left: {', '.join(left)}" if left else "nothing left"

    return judged


def _no_root(ev: Evidence) -> tuple[bool, str]:
    tree = ev.sandboxed.tree()
    marked = [p for p in tree if p.cmdline[:1] and Path(p.cmdline[0]).name in MARKED_PROGRAMS]
    if not marked:
        raise NotJudged("the marked programs' processes were not seen")
    rooted = [p.pid for p in tree if 0 in p.ids()]
    gained = [p.pid for p in marked if int(p.status.get("CapPrm", "0"), 16) or int(p.status.get("CapEff", "0"), 16)]
    why = (
        f"{len(marked)} marked programs ran; processes with a root ID: {len(rooted)}, with capabilities: {len(gained)}"
    )
    return not rooted and not gained, why


def _locked(ev: Evidence) -> tuple[bool, str]:
    tree = ev.sandboxed.tree()
    loose = [p.pid for p in tree if p.status.get("NoNewPrivs") != "1" or p.status.get("Seccomp") != "2"]
    capable = [p.pid for p in tree if any(int(p.status.get(c, "0"), 16) for c in ("CapEff", "CapPrm", "CapAmb"))]
    why = f"of the probe's {len(tree)} processes: {len(loose)} without no-new-privs and seccomp, {len(capable)} capable"
    return not loose and not capable, why


def _same_namespaces(ev: Evidence) -> tuple[bool, str]:
    own = ev.sandboxed.probe().namespaces
    children = ev.sandboxed.children("userns", "netns", "mountns")
    moved = sorted({name for p in children for name in NAMESPACES if p.namespaces[name] != own[name]})
    return (
        not moved,
        f"new namespaces beside the probe's: {', '.join(moved) or 'none'}",
    )


def _not_mounted(ev: Evidence) -> tuple[bool, str]:
    ev.sandboxed.children("mount")
    mounted = [p.pid for p in ev.sandboxed.tree() if any(f"mnt-{ev.nonce}" in m for m in p.mount_points)]
    return not mounted, f"{len(mounted)} of the probe's processes see a mount on its mount point"


def _not_traced(ev: Evidence) -> tuple[bool, str]:
    ev.sandboxed.children("ptrace")
    traced = [p.pid for p in ev.sandboxed.processes if p.status.get("TracerPid", "0") != "0"]
    return not traced, f"{len(traced)} of the sandbox's processes traced"


def _no_raw_sockets(ev: Evidence) -> tuple[bool, str]:
    ev.sandboxed.children("raw-socket", "packet-socket")
    n = ev.sandboxed.raw_sockets
    return n == 0, f"{n} raw or packet sockets in the sandbox's network namespace"


def _no_kernel_objects(ev: Evidence) -> tuple[bool, str]:
    children = ev.sandboxed.children("io_uring", "bpf", "userfaultfd", "perf_event")
    held = sorted({link for p in children for link in p.descriptors if link in KERNEL_OBJECTS})
    return not held, f"descriptors the probe's children hold: {', '.join(held) or 'none of io_uring, bpf, ...'}"


def _throttled(ev: Evidence) -> tuple[bool, str]:
    quota, period = ev.counter("cpu_quota"), ev.counter("cpu_period")
    n, usec = ev.counter("nr_throttled"), ev.counter("throttled_usec")
    given = f"{quota / period:g} CPUs" if quota > 0 < period else "none"
    why = f"the sandbox's CPU quota: {given} (--cpus {ev.limits.cpus:g}); throttled in {n} periods ({usec / 1e6:.2f}s)"
    if quota > 0 < period and abs(quota / period - ev.limits.cpus) < 0.01 and n == 0:
        raise NotJudged(f"{why}: the host, busy, gave the sandbox less CPU than its quota: nothing to throttle")
    return n > 0 and quota > 0 < period and abs(quota / period - ev.limits.cpus) < 0.01, why


def _oom_killed(ev: Evidence) -> tuple[bool, str]:
    kills, peak = ev.counter("oom_kill"), ev.counter("memory_peak")
    held = kills > 0 and peak <= ev.limits.memory
    return held, f"{kills} processes killed out of memory; at most {peak >> 20} MiB in use of {ev.limits.memory >> 20}"


def _pids_held(ev: Evidence) -> tuple[bool, str]:
    refused, limit, now = ev.counter("pids_refused"), ev.counter("pids_max"), ev.counter("pids_now")
    after = ev.workdir / "airlock-verify" / "after-bomb"
    answered = after.exists() and after.read_text() == ev.nonce
    held = refused > 0 and limit == ev.limits.pids and now < limit and answered
    why = f"{refused} forks refused at pids.max {limit} (--pids {ev.limits.pids}); {now} tasks at the end"
    return held, why + ("; a process started after it" if answered else "; no process started after it")


def _tmp_bounded(ev: Evidence) -> tuple[bool, str]:
    own, fill, charged = ev.usage.tmp_own, ev.usage.tmp_fill, ev.counter("memory_now")
    if own is None:
        raise NotJudged("the sandbox's /tmp could not be seen from the host")
    on_host = ev.host_tmp.with_name(f"airlock-verify-fill-{ev.nonce}").exists()
    held = own and fill == TMP_FILL and charged >= TMP_FILL and not on_host
    where = "its own filesystem" if own else "the host's /tmp"
    return held, (
        f"the sandbox's /tmp is {where}; the fill there: {fill} bytes; {charged >> 20} MiB charged to its memory "
        f"group; {'on' if on_host else 'not on'} the host's /tmp"
    )


def _stopped(ev: Evidence) -> tuple[bool, str]:
    if ev.timed is None:
        raise NotJudged("the run with --timeout did not run")
    t = ev.timed
    held = t.returncode == 124 and t.seconds < TIMEOUT_GIVEN + TIMEOUT_GRACE and not t.left
    return held, (
        f"--timeout {TIMEOUT_GIVEN:g}: exit {t.returncode} after {t.seconds:.1f}s; "
        f"left: {', '.join(t.left) or 'nothing'}"
    )


def _below_host(targets: Targets, limits: Limits) -> str | None:
    return (
        f"--cpus {limits.cpus:g} is every CPU this host has: a quota of the whole host throttles nothing"
        if limits.cpus >= limits.host_cpus
        else None
    )


def _memory_capped(targets: Targets, limits: Limits) -> str | None:
    too_much = limits.memory > MEMORY_CAP
    return f"--memory above {MEMORY_CAP >> 20} MiB: more than the probe may take" if too_much else None


def _pids_capped(targets: Targets, limits: Limits) -> str | None:
    if limits.pids > PIDS_CAP:
        return f"--pids above {PIDS_CAP}: more forks than the probe may make"
    if limits.nproc <= limits.pids + BOMB_MARGIN:  # the user's process count (all its processes) stops it first
        return f"--nproc {limits.nproc} stops the bomb before --pids {limits.pids} could"
    return None


def _no_keys(ev: Evidence) -> tuple[bool, str]:
    ev.sandboxed.children("add_key", "keyctl")
    if ev.sandboxed.keys is None:
        raise NotJudged("the kernel's count of the sandbox user's keys (/proc/key-users) could not be read")
    before, held = ev.sandboxed.keys
    return held <= before, f"the sandbox user's keys: {before} before the run, {held} while the probe's children held"


def _no_docker_socket(ev: Evidence) -> tuple[bool, str]:
    n, seen = ev.docker_socket_connections, ev.sandboxed.sockets
    counted = "the host's own socket (its connections not counted)" if n is None else f"{n} connections at its canary"
    return not n and not seen, f"a socket in the sandbox's view at: {', '.join(seen) or 'neither path'}; {counted}"


def _record(ev: Evidence) -> BrokerRecord:
    if ev.broker is None:
        raise NotJudged("the broker's runs did not run")
    return ev.broker


def _audited(lines: list[dict[str, Any]]) -> str:
    """Audit lines as the evidence shows them: decision, status, code (and a refusal's reason)."""
    return ", ".join(_line(line) for line in lines) or "no audit line"


def _line(line: dict[str, Any]) -> str:
    shown = f"{line.get('decision')} {line.get('extra', {}).get('status')} {line.get('code')}"
    return f"{shown} ({line.get('reason')})" if line.get("decision") == "deny" and line.get("reason") else shown


def _one_pull_request(ev: Evidence) -> tuple[bool, str]:
    record = _record(ev)
    made, again = record.upstream(record.head("first")), record.audited("again", "create_pull_request")
    if not made:
        raise NotJudged(f"the first call made no pull request upstream (it answered: {record.answers.get('first')})")
    if not again:
        raise NotJudged("the broker's audit has no repeat of the call: it was not made")
    numbers = ", ".join(f"{pr['repo']}#{pr['number']}" for pr in made)
    answered = record.answers.get("first", "nothing: killed mid-call")
    return len(made) == 1, (
        f"{len(made)} pull requests upstream from {record.head('first')} ({numbers}); the first call answered the "
        f"sandbox {answered}; the repeat: {_audited(again[:1])}"
    )


def _denied(lines: list[dict[str, Any]]) -> bool:
    return bool(lines) and all(line.get("decision") == "deny" for line in lines)


def _outside_refused(ev: Evidence) -> tuple[bool, str]:
    record, target = _record(ev), _record(ev).target
    parts, held = [], True
    if target.outside_repo:  # the second create_pull_request of the run, after the repeat
        lines, made = record.audited("again", "create_pull_request")[1:], record.upstream(record.head("other-repo"))
        held &= _denied(lines) and not made
        parts.append(f"{target.outside_repo}: {_audited(lines)}, {len(made)} pull requests upstream")
    if target.outside_tool:
        lines = record.audited("again", target.outside_tool)
        held &= _denied(lines) and not record.comments
        parts.append(f"{target.outside_tool}: {_audited(lines)}, {len(record.comments)} comments upstream")
    return held, "; ".join(parts)


def _foreign_refused(ev: Evidence) -> tuple[bool, str]:
    record = _record(ev)
    if record.first_jti is None:
        raise NotJudged("the first sandbox's token was not picked up: nothing to present from another")
    lines, made = record.audited("foreign", "create_pull_request"), record.upstream(record.head("foreign"))
    return _denied(lines) and not made, (
        f"the first sandbox's token (jti {record.first_jti}) from {record.foreign}: {_audited(lines)}; "
        f"{len(made)} pull requests upstream"
    )


def _granted(targets: Targets, limits: Limits) -> str | None:
    return None if isinstance(targets.broker, BrokerTarget) else targets.broker


def _outside(targets: Targets, limits: Limits) -> str | None:
    if (why := _granted(targets, limits)) is not None:
        return why
    assert isinstance(targets.broker, BrokerTarget)
    covered = targets.broker.outside_repo is None and targets.broker.outside_tool is None
    return (
        "the grants cover every repository the fake GitHub serves and every tool it is tried with" if covered else None
    )


def _front(targets: Targets, limits: Limits) -> str | None:
    return None if targets.front else "the profile allows no host on port 443"


def _alias(targets: Targets, limits: Limits) -> str | None:
    return (
        None
        if targets.metadata_alias
        else "needs two hosts the profile allows on port 443 (one answers 169.254.169.254)"
    )


def _rebind(targets: Targets, limits: Limits) -> str | None:
    return None if targets.rebind else "needs three hosts the profile allows on port 443 (one rebinds)"


def _inspecting(targets: Targets, limits: Limits) -> str | None:
    if targets.inspected or targets.plain:
        return None
    return (
        f"the profile inspects no allowed host without injecting secret {targets.secret}, and opens none on port 80: "
        "the gateway reads no request a placeholder could be refused in (inside a passthrough tunnel it reads nothing)"
    )


def _canary(targets: Targets, limits: Limits) -> str | None:
    return None if targets.canaries else "the profile opens every name the check would try"


_EVERY_BACKEND: tuple[Check, ...] = (
    Check("network", "allowed-host-reached", "a request to each allowed host arrives at its upstream", _reached,
          "reach", _front),
    Check("network", "direct-tcp", "raw TCP to an allowed host's address, past the proxy, reaches nothing",
          _and(_none_at((ALLOWED_ADDR, 22)), _packets("from_sandbox", "sandbox-addressed")), "direct-tcp", _front),
    Check("network", "udp", "UDP datagrams (QUIC too) reach nothing",
          _and(_udp, _packets("from_sandbox", "sandbox-addressed")), "udp"),
    Check("network", "icmp", "ICMP echo reaches nothing", _packets("icmp_echo", "ICMP echo"), "icmp"),
    Check("network", "ipv6", "IPv6 (and IPv4-mapped IPv6) reaches nothing",
          _and(_none_at((OTHER_ADDR, 22)), _packets("ipv6_frames", "IPv6")), "ipv6"),
    Check("network", "dns-other-resolver", "DNS sent to another resolver is never forwarded upstream",
          _no_queries("r"), "dns-other-resolver"),
    Check("network", "dns-encrypted", "DNS over TLS (853) and over HTTPS to another resolver reach nothing",
          _none_at((DNS_ADDR, 853), (CANARY_ADDR, 853), (CANARY_ADDR, 8443)), "dns-encrypted"),
    Check("network", "dns-unlisted", f"an unlisted name ({UNLISTED}) is never asked upstream", _no_queries("u"),
          "dns-unlisted"),
    Check("network", "metadata-literal", f"{METADATA} by literal (proxy, CONNECT, direct) reaches nothing",
          _none_at((METADATA, 80)), "metadata-literal"),
    Check("network", "metadata-spellings", "169.254.169.254 spelt decimal, hex, octal, short, IPv4-mapped IPv6 "
          "reaches nothing", _none_at((METADATA, 8080)), "metadata-spellings"),
    Check("network", "metadata-name", "an allowed name that resolves to 169.254.169.254 reaches nothing",
          _none_at((METADATA, 443)), "metadata-name", _alias),
    Check("network", "dns-rebinding", "an allowed name that rebinds to an internal address never reaches it",
          _not_rebound, "dns-rebinding", _rebind),
    Check("network", "connect-denied", "CONNECT to a denied or unlisted name reaches nothing",
          _none_at((CANARY_ADDR, 443)), "connect-denied", _canary),
    Check("network", "sni-fronting", "TLS naming a denied name in its SNI, to an allowed host, never leaves",
          _no_sni, "sni-fronting", lambda t, lim: _front(t, lim) or _canary(t, lim)),
    Check("network", "host-fronting", "HTTP whose Host names a denied name, to an allowed host, never leaves",
          _no_host, "host-fronting", lambda t, lim: _front(t, lim) or _canary(t, lim)),
    Check("network", "other-port", "another port of an allowed host (8443, 9999) reaches nothing",
          _none_at((ALLOWED_ADDR, 8443), (ALLOWED_ADDR, 9999)), "other-port", _front),
    Check("network", "gateway-ports", "the gateway's other ports and its other address answer nothing",
          _gateway_ports, "gateway-ports"),
    Check("files", "write-inside", "a file written in the working directory is on the host",
          _file(lambda ev: ev.workdir / f"inside-{ev.nonce}", True), "write-inside",
          off=(("docker", "the container is given no folder of the host's: it works in its own /tmp"),)),
    Check("files", "write-outside", "a file written outside the working directory (and in /tmp) is not on the host",
          _outside_and_tmp, "write-outside"),
    Check("files", "write-symlink", "a write through a symlink out of the working directory is not on the host",
          _none_on_host("symlink"), "write-symlink"),
    Check("files", "write-proc-root", "a write through /proc/self/root and /proc/1/root is not on the host",
          _none_on_host("procroot", "proc1"), "write-proc-root"),
    Check("secrets", "gateway-state", "the gateway's state directory and keys, and the fake internet's CA key, "
          "are unreadable", _and(_state_unread, _secrets_unread(("the fake internet's CA key",))), "read-state"),
    Check("secrets", "secret-placeholder", "a --secret is only its placeholder in the sandbox", _placeholder,
          "read-secret"),
    Check("secrets", "host-environment", "the host's environment stays out", _secrets_unread(("the host's "
          "environment",)), "read-host-env"),
    Check("secrets", "service-account", "a Kubernetes service-account token on the host is not readable",
          _secrets_unread(("the service-account token",)), "read-service-account"),
    Check("inspection", "placeholder-elsewhere", "a --secret's placeholder (yours where the policy injects one) sent "
          "to another allowed host the gateway reads — inspected without that injection, or in plain HTTP — in a "
          "header and in the URL is refused and never arrives; its value arrives nowhere else", _placeholder_refused,
          "placeholder-elsewhere", _inspecting),
    Check("tenancy", "other-sandbox", "another sandbox's working directory (started first) can be neither read nor "
          "written, its gateway is out of reach", _other_untouched, "other-sandbox"),
    Check("privilege", "setuid", "a setuid-root or file-capability program gains nothing: no root ID, no capability",
          _no_root, "setuid", off=(("docker", "the marked programs are copies on the host, which the container does "
                                      "not see"),)),
    Check("privilege", "no-new-privs", "every process of the probe runs with no-new-privs, seccomp, no capability",
          _locked, "setuid"),
    Check("privilege", "namespaces", "no new user, network or mount namespace", _same_namespaces, "namespaces"),
    Check("privilege", "mount", "no mount", _not_mounted, "mount"),
    Check("privilege", "ptrace", "no process traced (PTRACE_TRACEME)", _not_traced, "ptrace"),
    Check("privilege", "raw-sockets", "no raw or packet socket", _no_raw_sockets, "raw-sockets"),
    Check("privilege", "kernel-objects", "no io_uring, bpf map, userfaultfd or perf event", _no_kernel_objects,
          "kernel-objects"),
    Check("privilege", "keyctl", "no kernel key made (add_key, keyctl)", _no_keys, "keyring"),
    Check("privilege", "docker-socket", "no docker socket of the host is reachable", _no_docker_socket,
          "docker-socket"),
    Check("resources", "cpu", "CPU-bound processes beyond --cpus are throttled", _throttled, "cpu", _below_host),
    Check("resources", "memory", "a process writing more than --memory is killed, the run goes on", _oom_killed,
          "memory", _memory_capped),
    Check("resources", "fork-bomb", "a fork bomb is held at --pids and the sandbox still starts a process",
          _pids_held, "fork-bomb", _pids_capped),
    Check("resources", "tmp-fill", "a /tmp fill stays in the sandbox's own /tmp, charged to its --memory",
          _tmp_bounded, "tmp-fill"),
    Check("resources", "timeout", "--timeout stops the run (exit 124) and leaves nothing of it", _stopped),
    Check("broker", "idempotent-retry", "a pull request asked again with its Idempotency-Key, after the sandbox was "
          "killed mid-call, is made once", _one_pull_request, needs=_granted),
    Check("broker", "outside-grant", "a call outside the grant (another repository, another tool) is refused and "
          "reaches nothing upstream", _outside_refused, needs=_outside),
    Check("broker", "foreign-token", "a sandbox's token presented from another sandbox is refused", _foreign_refused,
          needs=_granted),
    Check("destruction", "namespace", "no network namespace of the run is left", _nothing_left("namespace"),
          off=(("docker", "a container's network namespace is its own, gone with it (destruction/container)"),)),
    Check("destruction", "container", "no container or docker network of the run is left",
          _nothing_left("container"), off=(("netns", "the netns backend runs no container"),)),
    Check("destruction", "fence", "no nftables table or link of the run is left", _nothing_left("fence")),
    Check("destruction", "cgroup", "no cgroup of the run is left", _nothing_left("cgroup")),
    Check("destruction", "state-dir", "no state directory of the run is left", _nothing_left("state-dir")),
)  # fmt: skip
CHECKS: tuple[Check, ...] = tuple(
    check if check.group in DOCKER_GROUPS else replace(check, off=(*check.off, ("docker", NOT_ON_DOCKER)))
    for check in _EVERY_BACKEND
)


def selected(groups: list[str] | None) -> tuple[Check, ...]:
    return tuple(check for check in CHECKS if not groups or check.group in groups)
