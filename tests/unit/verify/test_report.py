"""`airlock verify`'s verdicts as a user reads them: the matrix, the JSON (valid under
docs/verify-report.schema.json), the JUnit XML, the exit code; how a check is judged when its attempt is missing or
the policy gives it nothing to try; the privilege checks' judgement of the processes the host sees; the targets a
policy gives the fake internet."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from airlock.cli import verify as cli_verify
from airlock.cli.common import load_policy_file
from airlock.policy import parse_policy
from airlock.verify import checks, probe, processes, report, usage
from airlock.verify.checks import (
    CHECKS,
    PROBE_ARGV,
    PROBE_MARK,
    TMP_FILL,
    BrokerRecord,
    CheckVerdict,
    Evidence,
    Limits,
    OtherSandbox,
    Sandboxed,
    TimedRun,
    judge,
)
from airlock.verify.processes import NAMESPACES, Process
from airlock.verify.runner import Request
from airlock.verify.targets import UNLISTED, BrokerTarget, Targets, targets
from airlock.verify.usage import Usage

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = Draft202012Validator(json.loads((ROOT / "docs" / "verify-report.schema.json").read_text()))
RUN = report.Run("netns", "/etc/airlock/policy.yaml", "default", "auto", 12.34)
BY_ID = {check.id: check for check in CHECKS}
NETNS_ONLY = ("namespace", "write-inside", "setuid")  # in the groups the docker backend judges


def _outcomes(*results: tuple[str, checks.Result]) -> list[CheckVerdict]:
    return [CheckVerdict(BY_ID[name], result, f"evidence of {name}", "what the probe saw") for name, result in results]


def _evidence(tmp_path: Path, probe: dict[str, str], **stats: object) -> Evidence:
    counters = {"connections": {}, "udp": {}, "dns_log": [], "sni": [], "http": []} | stats
    alias_targets = Targets(("pypi.org",), (UNLISTED,), "github.com")
    return Evidence("n0nce", alias_targets, probe, counters, {}, tmp_path, tmp_path, tmp_path / "tmp", {})


def test_the_matrix_shows_each_check_its_result_and_evidence():
    text = report.matrix(_outcomes(("udp", "held"), ("metadata-name", "failed"), ("write-inside", "error")))
    lines = text.splitlines()
    assert lines[0].split() == ["check", "result", "must", "/", "evidence"]
    assert lines[1].split()[:2] == ["network/udp", "held"] and lines[2].strip() == "evidence: evidence of udp"
    assert lines[3].split()[:2] == ["network/metadata-name", "FAILED"]
    assert lines[5].split()[:2] == ["files/write-inside", "ERROR"]
    assert lines[-1] == "1 held, 1 failed, 1 error"


@pytest.mark.parametrize(
    ("results", "code"),
    [
        ((("udp", "held"), ("icmp", "held"), ("metadata-name", "n/a")), 0),
        ((("udp", "held"), ("icmp", "failed")), 1),
        ((("udp", "failed"), ("icmp", "error")), 2),  # a check that could not run outweighs one that failed
        ((), 2),  # nothing verified is not a pass
    ],
)
def test_the_exit_code_is_0_only_when_every_check_that_applies_held(results, code):
    assert report.exit_code(_outcomes(*results)) == code


def test_the_json_is_valid_under_its_schema_and_says_each_verdict():
    outcomes = _outcomes(("udp", "held"), ("icmp", "failed"), ("write-inside", "error"), ("metadata-name", "n/a"))
    verdicts = report.as_json(RUN, outcomes)
    SCHEMA.validate(verdicts)
    assert verdicts["exit_code"] == 2 and verdicts["summary"] == {"held": 1, "failed": 1, "error": 1, "n/a": 1}
    assert verdicts["checks"][1] == {
        "group": "network", "id": "icmp", "must": BY_ID["icmp"].must, "result": "failed",
        "evidence": "evidence of icmp", "probe": "what the probe saw",
    }  # fmt: skip


def test_the_schema_refuses_a_result_it_does_not_know():
    verdicts = report.as_json(RUN, _outcomes(("udp", "held")))
    verdicts["checks"][0]["result"] = "passed"
    assert not SCHEMA.is_valid(verdicts)


def test_the_junit_xml_has_a_suite_per_group_and_a_failure_or_error_per_check_that_did_not_hold():
    outcomes = _outcomes(("udp", "held"), ("icmp", "failed"), ("write-inside", "error"), ("metadata-name", "n/a"))
    root = ET.fromstring(report.as_junit(RUN, outcomes))
    assert (root.get("tests"), root.get("failures"), root.get("errors"), root.get("skipped")) == ("4", "1", "1", "1")
    suites = {suite.get("name"): suite for suite in root}
    assert list(suites) == ["airlock verify network", "airlock verify files"]
    cases = {case.get("name"): case for suite in root for case in suite}
    assert cases["icmp"].find("failure").get("message") == "evidence of icmp"
    assert cases["write-inside"].find("error") is not None and cases["metadata-name"].find("skipped") is not None
    assert cases["udp"].find("failure") is None and cases["udp"].get("classname") == "airlock.verify.network"


def test_a_check_whose_attempt_the_probe_did_not_make_is_an_error_not_a_pass(tmp_path: Path):
    outcome = judge(BY_ID["udp"], _evidence(tmp_path, probe={}))
    assert (outcome.result, outcome.evidence) == ("error", "the probe made no such attempt: the check could not run")


def test_a_check_is_judged_by_what_reached_the_fake_internet_not_by_what_the_probe_saw(tmp_path: Path):
    probe = {"metadata-name": "CONNECT github.com:443: HTTP/1.1 403 Forbidden"}
    reached = _evidence(tmp_path, probe, connections={"169.254.169.254:443": 2})
    outcome = judge(BY_ID["metadata-name"], reached)
    assert (outcome.result, outcome.evidence) == ("failed", "2 connections at 169.254.169.254:443")
    assert judge(BY_ID["metadata-name"], _evidence(tmp_path, probe)).result == "held"


def test_a_check_the_policy_gives_nothing_to_try_is_not_applicable(tmp_path: Path):
    evidence = _evidence(tmp_path, probe={})
    lone = Evidence(**{**evidence.__dict__, "targets": Targets(("pypi.org",), (UNLISTED,), None)})
    outcome = judge(BY_ID["metadata-name"], lone)
    assert outcome.result == "n/a" and "two hosts" in outcome.evidence


def test_the_default_policy_gives_each_allowed_host_an_upstream_and_each_denied_name_a_canary():
    found = targets(load_policy_file(None).profile())
    assert found.allowed == (
        "pypi.org", "files.pythonhosted.org", "github.com", "api.github.com", "codeload.github.com",
    )  # fmt: skip
    assert found.metadata_alias == "raw.githubusercontent.com"
    assert found.rebind == "objects.githubusercontent.com"
    assert found.zone()["objects.githubusercontent.com"] == [("REBIND", "192.0.2.10 10.1.2.3")]
    assert found.canaries == (UNLISTED, "gist.github.com", "gist.githubusercontent.com")
    assert found.zone()["raw.githubusercontent.com"] == [("A", "169.254.169.254")]


def test_a_wildcard_rule_is_tried_as_a_name_under_it_and_an_allowed_canary_is_no_canary():
    policy = parse_policy(
        "version: 1\ndefault_profile: p\nprofiles:\n  p:\n    allow:\n      - host: '*.airlock-verify.example'\n",
        "p.yaml",
    )
    found = targets(policy.profile())
    assert found.allowed == ("airlock-verify.airlock-verify.example",) and found.canaries == ()


def test_the_command_line_offers_the_groups_the_checks_have():
    assert cli_verify.GROUPS == checks.GROUPS == tuple(dict.fromkeys(check.group for check in CHECKS))


def _process(pid: int, ppid: int, cmdline: tuple[str, ...], **status: str) -> Process:
    base = {"Uid": "65534\t65534\t65534\t65534", "Gid": "65534\t65534\t65534\t65534", "CapEff": "0" * 16,
            "CapPrm": "0" * 16, "CapAmb": "0" * 16, "NoNewPrivs": "1", "Seccomp": "2", "TracerPid": "0"}  # fmt: skip
    namespaces = {name: f"{name}:[1]" for name in NAMESPACES}
    return Process(pid, ppid, cmdline, base | status, namespaces, (), ())


PROBE = _process(10, 9, (*PROBE_ARGV, "source", "{}", PROBE_MARK))
LAUNCHER = _process(9, 1, ("bwrap", *PROBE.cmdline), Uid="0\t0\t0\t0", Seccomp="0")  # the launcher's, not judged


@pytest.mark.parametrize(
    ("sleeper", "result"),
    [
        (_process(11, 10, ("/var/tmp/x/bin/setuid-sleep", "30")), "held"),
        (_process(11, 10, ("/var/tmp/x/bin/setuid-sleep", "30"), Uid="65534\t0\t0\t0"), "failed"),
        (_process(11, 10, ("/var/tmp/x/bin/capability-sleep", "30"), CapPrm="0000000000202080"), "failed"),
    ],
    ids=["nothing-gained", "root-gained", "capabilities-gained"],
)
def test_the_setuid_check_judges_by_the_ids_and_capabilities_the_host_sees(tmp_path: Path, sleeper, result):
    evidence = _evidence(tmp_path, {"setuid": "started"})
    seen = Evidence(**{**evidence.__dict__, "sandboxed": Sandboxed([LAUNCHER, PROBE, sleeper], 0)})
    assert judge(BY_ID["setuid"], seen).result == result


def test_a_privilege_check_whose_child_was_not_seen_is_an_error(tmp_path: Path):
    evidence = _evidence(tmp_path, {"namespaces": "userns: PermissionError"})
    seen = Evidence(**{**evidence.__dict__, "sandboxed": Sandboxed([LAUNCHER, PROBE], 0)})
    outcome = judge(BY_ID["namespaces"], seen)
    assert outcome.result == "error" and "child was not seen" in outcome.evidence


def test_the_listing_names_each_check_of_the_groups_asked_for_and_what_must_happen():
    lines = report.listing(checks.selected(["privilege", "destruction"])).splitlines()
    assert [line.split()[0] for line in lines] == [
        f"{check.group}/{check.id}" for check in CHECKS if check.group in ("privilege", "destruction")
    ]
    assert lines[0].endswith(BY_ID["setuid"].must)


def test_the_page_of_verify_tells_how_each_check_is_judged():
    page = (ROOT / "docs" / "verify.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in page.splitlines() if line.startswith("| `")}
    assert rows == {f"{check.group}/{check.id}" for check in CHECKS}


# --------------------------------------------------------------------------------------------------- every check fails

KINDS = ("userns", "netns", "mountns", "mount", "ptrace", "raw-socket", "packet-socket", "io_uring", "bpf",
         "userfaultfd", "perf_event", "add_key", "keyctl")  # fmt: skip


REACHED = [{"host": "pypi.org", "target": "/airlock-verify/n0nce/reach", "tls": True}]
REBOUND = [{"qname": "api.github.com", "qtype": "A"}] * 2  # the gateway asked twice: the second answer internal
LIMITS = Limits(1.0, 512 << 20, 256, host_cpus=2)
COUNTERS = {  # the sandbox's cgroup once the resource attempts are made, at the default limits
    "cpu_quota": 100_000, "cpu_period": 100_000, "nr_throttled": 9, "throttled_usec": 800_000, "oom_kill": 1,
    "memory_peak": 512 << 20, "memory_max": 512 << 20, "memory_now": 40 << 20, "pids_refused": 1, "pids_now": 3,
    "pids_max": 256,
}  # fmt: skip


BROKER_TARGET = BrokerTarget("acme/app", "main", "acme/other", "comment_on_pull_request")
HEAD = "agent/airlock-verify-n0nce-"  # the broker probe's branches: HEAD + the call's name
MADE = [{"repo": "acme/app", "number": 1, "head": f"{HEAD}first"}]  # the first call's pull request, made once


def _audit(decision: str, status: int, code: str, tool: str = "create_pull_request", **extra: str) -> dict:
    return {"kind": "broker", "method": tool, "decision": decision, "code": code, "extra": {"status": status, **extra}}


AUDIT = {  # the broker's audit lines of the broker group's runs on a sound setup
    "first": [],  # stopped mid-call: the line was never written
    "again": [_audit("allow", 201, "allowed"), _audit("deny", 403, "outside_grant"),
              _audit("deny", 403, "outside_grant", "comment_on_pull_request")],
    "foreign": [_audit("deny", 403, "wrong_sandbox", jti="j1")],
}  # fmt: skip


# The gateway's audit of the placeholder sent to the inspected host (in a header, in the URL): refused twice.
REFUSED = [{"kind": "http", "host": "pypi.org", "path": "/airlock-verify/n0nce/placeholder", "decision": "deny",
            "code": "placeholder_misuse"}] * 2  # fmt: skip
PLACEHOLDER_SENT = {"host": "pypi.org", "target": "/airlock-verify/n0nce/placeholder", "tls": True,
                    "headers": [["X-Api-Key", checks.PLACEHOLDER]]}  # fmt: skip


# The second sandbox once the probe was done: its folder as it was, its gateway's address reached by nothing.
OTHER = OtherSandbox("alx1o", Path("/var/tmp/x/other"), "10.231.0.101", (53, 3128), (53,), "0ther-canary",
                     ("canary", "started"), "0ther-canary", 0)  # fmt: skip


def _other(**fields: object) -> OtherSandbox:
    return OtherSandbox(**{**OTHER.__dict__, **fields})


def _broker(**fields: object) -> BrokerRecord:
    """The broker group's record on a sound setup, but for `fields`."""
    sound = BrokerRecord(BROKER_TARGET, "alx1b", "alx1f", "n0nce", MADE, [], AUDIT, "j1")
    return BrokerRecord(**{**sound.__dict__, **fields})


def _with(sandboxed: Sandboxed, **fields: object) -> Sandboxed:
    return Sandboxed(**{**sandboxed.__dict__, **fields})


def _counted(tmp_path: Path, **counters: int) -> Evidence:
    return _holding(tmp_path, usage=Usage(COUNTERS | counters, tmp_own=True, tmp_fill=TMP_FILL))


def _child(kind: str, **fields: object) -> Process:
    """A holding child of the probe, as the host sees it (`fields` replace its namespaces, descriptors, mounts)."""
    child = _process(20 + KINDS.index(kind), 10, ("python3", "-I", "-c", "child", f"{probe.CHILD}-{kind}"))
    return Process(**{**child.__dict__, **fields})


def _holding(
    tmp_path: Path, children: dict[str, Process] | None = None, sleeper: dict[str, str] | None = None, **changes: object
) -> Evidence:
    """Evidence on which every check holds, but for `changes` (Evidence's fields; fakenet's under `stats_`), the
    `children` given in place of the probe's own and the marked program's `sleeper` status."""
    work, outside = tmp_path / "work", tmp_path / "outside"
    (work / "airlock-verify").mkdir(parents=True, exist_ok=True)
    outside.mkdir(exist_ok=True)
    (work / "inside-n0nce").write_text("n0nce")
    (work / "airlock-verify" / "after-bomb").write_text("n0nce")
    (work / "airlock-verify" / "env.json").write_text(json.dumps({"AIRLOCK_VERIFY_SECRET": checks.PLACEHOLDER}))
    stats = {"connections": {}, "udp": {}, "dns_log": REBOUND, "sni": ["pypi.org"], "http": REACHED}
    stats |= {key.removeprefix("stats_"): value for key, value in changes.items() if key.startswith("stats_")}
    kids = {kind: _child(kind) for kind in KINDS} | (children or {})
    marked = _process(12, 10, ("/var/tmp/x/bin/setuid-sleep", "30"), **(sleeper or {}))
    evidence = Evidence(
        "n0nce", Targets(("pypi.org",), (UNLISTED,), "github.com", "api.github.com", BROKER_TARGET, "pypi.org"),
        {c.attempt: "tried" for c in CHECKS if c.attempt},
        stats, {"from_sandbox": 0, "icmp_echo": 0, "ipv6_frames": 0}, work, outside, tmp_path / "host-tmp",
        {"the --secret": b"s3cret", "the host's environment": b"h0st", "the fake internet's CA key": b"k3y",
         "the service-account token": b"t0ken"},
        {}, Sandboxed([LAUNCHER, PROBE, marked, *kids.values()], 0, keys=(2, 2)), limits=LIMITS,
        usage=Usage(COUNTERS, tmp_own=True, tmp_fill=TMP_FILL), timed=TimedRun(124, 2.9, []),
        docker_socket_connections=0, broker=_broker(), audit=REFUSED, other=OTHER,
    )  # fmt: skip
    return Evidence(**{**evidence.__dict__, **{k: v for k, v in changes.items() if not k.startswith("stats_")}})


def _written(tmp_path: Path, name: str, data: bytes) -> Path:
    (tmp_path / "work" / "airlock-verify").mkdir(parents=True, exist_ok=True)
    (tmp_path / "work" / "airlock-verify" / name).write_bytes(data)
    return tmp_path


def _outside(tmp_path: Path, name: str) -> Path:
    (tmp_path / "outside").mkdir(parents=True, exist_ok=True)
    (tmp_path / "outside" / f"{name}-n0nce").write_text("n0nce")
    return tmp_path


BREAKS = {  # check -> the evidence a setup that breaks it leaves
    "allowed-host-reached": lambda t: _holding(t, stats_http=[]),
    "direct-tcp": lambda t: _holding(t, stats_connections={"192.0.2.10:22": 1}),
    "udp": lambda t: _holding(t, stats_udp={"9999": 1}),
    "icmp": lambda t: _holding(t, packets={"icmp_echo": 1}),
    "ipv6": lambda t: _holding(t, packets={"ipv6_frames": 3}),
    "dns-other-resolver": lambda t: _holding(t, stats_dns_log=[*REBOUND, {"qname": f"r-n0nce.{UNLISTED}"}]),
    "dns-encrypted": lambda t: _holding(t, stats_connections={"192.0.2.53:853": 1}),
    "dns-unlisted": lambda t: _holding(t, stats_dns_log=[*REBOUND, {"qname": f"u-n0nce.{UNLISTED}"}]),
    "metadata-literal": lambda t: _holding(t, stats_connections={"169.254.169.254:80": 1}),
    "metadata-spellings": lambda t: _holding(t, stats_connections={"169.254.169.254:8080": 1}),
    "metadata-name": lambda t: _holding(t, stats_connections={"169.254.169.254:443": 1}),
    "dns-rebinding": lambda t: _holding(t, stats_connections={"10.1.2.3:443": 1}),
    "connect-denied": lambda t: _holding(t, stats_connections={"203.0.113.66:443": 1}),
    "sni-fronting": lambda t: _holding(t, stats_sni=[UNLISTED]),
    "host-fronting": lambda t: _holding(
        t, stats_http=[*REACHED, {"host": f"{UNLISTED}:80", "target": "/", "tls": False}]
    ),
    "other-port": lambda t: _holding(t, stats_connections={"192.0.2.10:9999": 1}),
    "gateway-ports": lambda t: _holding(t, gateway_canaries={"connections": {"10.231.0.1:22": 1}, "udp": {}}),
    "write-inside": lambda t: _holding(t, workdir=t / "elsewhere"),
    "write-outside": lambda t: _holding(_outside(t, "direct")),
    "write-symlink": lambda t: _holding(_outside(t, "symlink")),
    "write-proc-root": lambda t: _holding(_outside(t, "proc1")),
    "gateway-state": lambda t: _holding(_written(t, "state.bin", b"-----BEGIN PRIVATE KEY-----")),
    "secret-placeholder": lambda t: _holding(_written(t, "secret.bin", b"s3cret")),
    "placeholder-elsewhere": lambda t: _holding(t, stats_http=[*REACHED, PLACEHOLDER_SENT], audit=REFUSED[:1]),
    "host-environment": lambda t: _holding(_written(t, "host.bin", b"HOME=/root h0st")),
    "other-sandbox": lambda t: _holding(t, other=_other(found="n0nce")),  # its canary overwritten
    "service-account": lambda t: _holding(_written(t, "service-account.bin", b"t0ken")),
    "setuid": lambda t: _holding(t, sleeper={"Uid": "65534\t0\t0\t0"}),
    "no-new-privs": lambda t: _holding(t, sleeper={"Seccomp": "0"}),
    "namespaces": lambda t: _holding(t, {"userns": _child("userns", namespaces=PROBE.namespaces | {"user": "u:[2]"})}),
    "mount": lambda t: _holding(t, {"mount": _child("mount", mount_points=("/w/airlock-verify/mnt-n0nce",))}),
    "ptrace": lambda t: _holding(t, sleeper={"TracerPid": "10"}),
    "raw-sockets": lambda t: _holding(t, sandboxed=_with(_holding(t).sandboxed, raw_sockets=1)),
    "kernel-objects": lambda t: _holding(t, {"io_uring": _child("io_uring", descriptors=("anon_inode:[io_uring]",))}),
    "keyctl": lambda t: _holding(t, sandboxed=_with(_holding(t).sandboxed, keys=(2, 3))),  # a key made
    "docker-socket": lambda t: _holding(t, docker_socket_connections=1),
    "cpu": lambda t: _counted(t, cpu_quota=-1, nr_throttled=0),  # no quota: never throttled
    "memory": lambda t: _counted(t, oom_kill=0, memory_peak=600 << 20),  # the hog held more than the limit
    "fork-bomb": lambda t: _counted(t, pids_refused=0, pids_max=-1),  # no limit: the bomb ran to its own cap
    "tmp-fill": lambda t: _holding(t, usage=Usage(COUNTERS, tmp_own=False, tmp_fill=TMP_FILL)),  # the host's /tmp
    "timeout": lambda t: _holding(t, timed=TimedRun(0, 301.0, ["process 4242"])),  # ran to its end, a child left
    "idempotent-retry": lambda t: _holding(t, broker=_broker(prs=[*MADE, {**MADE[0], "number": 2}])),  # made twice
    "outside-grant": lambda t: _holding(
        t,
        broker=_broker(  # another repository's pull request made
            prs=[*MADE, {"repo": "acme/other", "number": 1, "head": f"{HEAD}other-repo"}],
            audit=AUDIT | {"again": [_audit("allow", 201, "allowed"), *AUDIT["again"][::2]]},
        ),
    ),
    "foreign-token": lambda t: _holding(
        t,
        broker=_broker(  # the stolen token took
            prs=[*MADE, {"repo": "acme/app", "number": 2, "head": f"{HEAD}foreign"}],
            audit=AUDIT | {"foreign": [_audit("allow", 201, "allowed", jti="j1")]},
        ),
    ),
    "namespace": lambda t: _holding(t, leftovers={"namespace": ["airlock-alx1v"]}),
    "container": lambda t: _holding(t, backend="docker", leftovers={"container": ["container airlock-alx1v"]}),
    "fence": lambda t: _holding(t, leftovers={"fence": ["table inet airlock_n_alx1v"]}),
    "cgroup": lambda t: _holding(t, leftovers={"cgroup": ["/sys/fs/cgroup/airlock/alx1v"]}),
    "state-dir": lambda t: _holding(t, leftovers={"state-dir": ["/var/tmp/x/private/tmp/airlock-run-1"]}),
}


def test_every_check_holds_on_evidence_of_a_sound_setup(tmp_path: Path):
    evidence = _holding(tmp_path)
    only_docker = {"container"}
    assert {check.id: judge(check, evidence).result for check in CHECKS} == {
        check.id: "n/a" if check.id in only_docker else "held" for check in CHECKS
    }


def test_on_the_docker_backend_the_checks_of_groups_its_run_does_not_gather_are_not_applicable(tmp_path: Path):
    evidence = _holding(tmp_path, backend="docker")
    results = {check.id: judge(check, evidence) for check in CHECKS}
    assert {i for i, o in results.items() if o.result == "held"} == {
        c.id for c in CHECKS if c.group in checks.DOCKER_GROUPS and c.id not in NETNS_ONLY
    }
    assert results["namespace"].evidence.endswith("(destruction/container)")
    assert results["write-inside"].evidence.endswith("it works in its own /tmp")
    assert {o.evidence for o in results.values() if o.check.group not in checks.DOCKER_GROUPS} == {checks.NOT_ON_DOCKER}
    # never held, not even on evidence that would fail it: the docker run gathers none of it
    assert judge(BY_ID["foreign-token"], BREAKS["foreign-token"](tmp_path / "docker")).result == "failed"
    broken = Evidence(**{**BREAKS["foreign-token"](tmp_path / "docker").__dict__, "backend": "docker"})
    outcome = judge(BY_ID["foreign-token"], broken)
    assert (outcome.result, outcome.evidence) == ("n/a", checks.NOT_ON_DOCKER)
    for check in ("write-outside", "gateway-state", "no-new-privs", "tmp-fill", "timeout"):  # judged as on netns
        leaked = Evidence(**{**BREAKS[check](tmp_path / check).__dict__, "backend": "docker"})
        assert judge(BY_ID[check], leaked).result == "failed"


def test_the_placeholder_check_fails_on_the_secret_arriving_and_errs_when_nothing_was_refused_or_arrived(
    tmp_path: Path,
):
    check = BY_ID["placeholder-elsewhere"]
    secret_sent = {**PLACEHOLDER_SENT, "headers": [["X-Api-Key", "s3cret"]]}  # the gateway put the secret in
    assert judge(check, _holding(tmp_path, stats_http=[*REACHED, secret_sent])).result == "failed"
    unrefused = judge(check, _holding(tmp_path, audit=[]))
    assert unrefused.result == "error" and "has 0 of the probe's 2 requests to pypi.org" in unrefused.evidence
    let_through = [REFUSED[0], {**REFUSED[0], "decision": "allow", "code": "allowed"}]  # one never refused
    assert judge(check, _holding(tmp_path, audit=let_through)).result == "failed"
    held = judge(check, _holding(tmp_path))
    assert held.evidence == (
        "the placeholder of secret verify (verify's own); pypi.org (inspected): 0 requests at its upstream carried "
        "the placeholder or the secret; the gateway's audit of /airlock-verify/n0nce/placeholder: deny "
        "placeholder_misuse, deny placeholder_misuse; the secret's value upstream elsewhere: nowhere"
    )


# The user's secret `model_api`, injected at api.model.example; pypi.org inspected without it, github.com open on
# port 80 (plain HTTP), files.pythonhosted.org passed through.
USER_POLICY = (Path(__file__).resolve().parents[2] / "e2e" / "policies" / "user-secret.yaml").read_text()
USER_VALUE = "sk-model-0123456789"
USER_PLACEHOLDER = "airlock-placeholder-model_api"


def _user_secret_run(tmp_path: Path, **changes: object) -> Evidence:
    """Evidence of a sound run with the user's secret, but for `changes` (fakenet's requests under `http`)."""
    found = targets(parse_policy(USER_POLICY).profile(), secrets=["other_key", "model_api"])
    path = "/airlock-verify/n0nce/placeholder"
    refused = [{"kind": "http", "host": host, "path": path, "decision": "deny", "code": "placeholder_misuse"}
               for host in ("pypi.org", "github.com") for _ in range(2)]  # fmt: skip
    passed = [{"host": "files.pythonhosted.org", "target": target, "tls": True, "headers": headers}
              for target, headers in ((path, [["X-Api-Key", USER_PLACEHOLDER]]), (f"{path}?key={USER_PLACEHOLDER}",
                                                                                  []))]  # fmt: skip
    injected = {"host": "api.model.example", "target": "/v1", "tls": True,
                "headers": [["Authorization", f"Bearer {USER_VALUE}"]]}  # fmt: skip
    secrets = {"the --secret": b"s3cret", checks.USER_SECRET: USER_VALUE.encode()}
    return _holding(
        tmp_path, targets=found, audit=refused, secrets=secrets,
        stats_http=[*REACHED, *passed, injected, *changes.pop("http", [])], **changes,
    )  # fmt: skip


def test_the_placeholder_check_drives_the_users_injected_secret_where_the_gateway_reads_the_request():
    found = targets(parse_policy(USER_POLICY).profile(), secrets=["other_key", "model_api"])
    assert (found.secret, found.injected_at, found.inspected) == ("model_api", "api.model.example", "pypi.org")
    assert (found.plain, found.passthrough) == ("github.com", "files.pythonhosted.org")
    assert targets(parse_policy(USER_POLICY).profile()).secret == "verify"  # no --secret: verify's own
    assert targets(parse_policy(USER_POLICY).profile(), secrets=["other_key"]).injected_at is None  # injected nowhere
    # an inspected host whose http: refuses the probe's path first is not where the placeholder is judged
    narrowed = USER_POLICY.replace(
        "      - host: pypi.org\n        inspect: true\n",
        "      - host: pypi.org\n        inspect: true\n        http: [{methods: [GET], paths: [/simple/**]}]\n",
    )
    assert targets(parse_policy(narrowed).profile(), secrets=["model_api"]).inspected is None


def test_the_placeholder_check_with_the_users_secret_holds_and_fails_where_the_value_or_placeholder_arrives(
    tmp_path: Path,
):
    check = BY_ID["placeholder-elsewhere"]
    held = judge(check, _user_secret_run(tmp_path))
    assert held.result == "held", held.evidence
    assert held.evidence == (
        "the placeholder of secret model_api (yours, injected at api.model.example); pypi.org (inspected): 0 requests "
        "at its upstream carried the placeholder or the secret; the gateway's audit of /airlock-verify/n0nce/"
        "placeholder: deny placeholder_misuse, deny placeholder_misuse; github.com (plain HTTP): 0 requests at its "
        "upstream carried the placeholder or the secret; the gateway's audit of /airlock-verify/n0nce/placeholder: "
        "deny placeholder_misuse, deny placeholder_misuse; files.pythonhosted.org (passthrough): not judged, the "
        "gateway reads nothing inside its TLS (2 of the requests arrived, with the placeholder alone); the secret's "
        "value upstream elsewhere: nowhere"
    )
    plain_through = {"host": "github.com", "target": f"/airlock-verify/n0nce/placeholder?key={USER_PLACEHOLDER}",
                     "tls": False, "headers": []}  # fmt: skip
    leaked = {"host": "example.org", "target": "/", "tls": True, "headers": [["X-Key", USER_VALUE]]}
    for broken in ([plain_through], [leaked]):
        outcome = judge(check, _user_secret_run(tmp_path, http=broken))
        assert outcome.result == "failed", broken
    assert judge(check, _user_secret_run(tmp_path, http=[leaked])).evidence.endswith("elsewhere: example.org")


@pytest.mark.parametrize(
    "other",
    [_other(files=("canary", "intruder-n0nce", "started")), _other(found=None), _other(reached=3)],
    ids=["new-file", "canary-gone", "gateway-reached"],
)
def test_the_other_sandbox_check_fails_on_a_file_added_the_canary_gone_or_its_gateway_reached(
    tmp_path: Path, other: OtherSandbox
):
    assert judge(BY_ID["other-sandbox"], _holding(tmp_path, other=other)).result == "failed"


def test_the_other_sandbox_check_fails_on_its_canary_read_and_errs_without_the_second_sandbox(tmp_path: Path):
    held = judge(BY_ID["other-sandbox"], _holding(tmp_path))
    assert held.result == "held" and held.evidence == (
        "/var/tmp/x/other: its canary not read by the probe, unchanged; new there: nothing; its gateway at "
        "10.231.0.101 (tcp 53, 3128, udp 53): 0 packets from another sandbox reached it"
    )
    read = judge(BY_ID["other-sandbox"], _holding(_written(tmp_path, "other.bin", b"0ther-canary")))
    assert read.result == "failed" and read.evidence.startswith("/var/tmp/x/other: its canary read by the probe,")
    missing = judge(BY_ID["other-sandbox"], _holding(tmp_path, other=None))
    assert (missing.result, missing.evidence) == ("error", "the second sandbox did not run")


def test_the_placeholder_check_needs_an_inspected_host_that_does_not_inject_the_secret(tmp_path: Path):
    inspected = parse_policy(
        "version: 1\nprofiles:\n  default:\n    allow:\n      - host: pypi.org\n      - host: api.model.example\n"
        "        inspect: true\n      - host: files.pythonhosted.org\n      - host: github.com\n"
    )
    assert targets(inspected.profile()).inspected == "api.model.example"
    plain = targets(load_policy_file(None).profile())
    outcome = judge(BY_ID["placeholder-elsewhere"], Evidence(**{**_holding(tmp_path).__dict__, "targets": plain}))
    assert plain.inspected is None and outcome.result == "n/a" and "inspects no allowed host" in outcome.evidence


def test_the_docker_backend_probe_makes_only_the_attempts_of_checks_that_apply_there():
    found = targets(load_policy_file(None).profile())
    netns = Request("p.yaml", found, [], CHECKS, Limits())
    docker = Request("p.yaml", found, [], CHECKS, Limits(), Path("/var/cache/image.tar"))
    assert (netns.backend, docker.backend) == ("netns", "docker")
    # the docker run's folder is its own; no second sandbox runs beside it
    assert set(docker.attempts()) == set(netns.attempts()) - {"write-inside", "other-sandbox"}
    files = Request("p.yaml", found, [], checks.selected(["files"]), Limits(), Path("/var/cache/image.tar"))
    assert files.attempts() == ["write-outside", "write-symlink", "write-proc-root"]


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.id)
def test_every_check_fails_on_the_evidence_a_setup_that_breaks_it_leaves(tmp_path: Path, check: checks.Check):
    broken = BREAKS[check.id](tmp_path)
    assert judge(check, broken).result == "failed"
    group = [other for other in CHECKS if other.group == check.group]
    others = [other.id for other in group if judge(other, broken).result not in ("held", "n/a")]
    assert others == [check.id]  # the evidence of one break fails that check alone in its group


# --------------------------------------------------------------------------------------------------- resources


def test_the_rebinding_check_cannot_judge_a_gateway_that_asked_once(tmp_path: Path):
    outcome = judge(BY_ID["dns-rebinding"], _holding(tmp_path, stats_dns_log=REBOUND[:1]))
    assert outcome.result == "error" and "never had the internal answer" in outcome.evidence


@pytest.mark.parametrize(
    ("connections", "seen", "result"),
    [(None, (), "held"), (None, ("/run/docker.sock",), "failed"), (0, ("/var/run/docker.sock",), "failed")],
    ids=["hosts-own-hidden", "hosts-own-in-view", "canary-in-view"],
)
def test_the_docker_socket_check_judges_the_sandboxs_view_of_a_socket_it_cannot_count(
    tmp_path: Path, connections, seen, result
):
    evidence = _holding(tmp_path, docker_socket_connections=connections)
    evidence = Evidence(**{**evidence.__dict__, "sandboxed": _with(evidence.sandboxed, sockets=seen)})
    assert judge(BY_ID["docker-socket"], evidence).result == result


def test_the_keyctl_check_cannot_judge_without_the_kernels_count_of_keys(tmp_path: Path):
    evidence = _holding(tmp_path, sandboxed=_with(_holding(tmp_path).sandboxed, keys=None))
    assert judge(BY_ID["keyctl"], evidence).result == "error"


def test_a_path_in_the_sandboxs_view_follows_its_symlinks_inside_its_root(tmp_path: Path):
    root = Path(f"/proc/{os.getpid()}/root")
    (tmp_path / "run").mkdir()
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "run").symlink_to("../run")
    assert processes.in_root(os.getpid(), f"{tmp_path}/var/run/x") == f"{root}{tmp_path}/run/x"
    assert processes.in_root(os.getpid(), "/var/run/docker.sock") == f"{root}{Path('/var/run').resolve()}/docker.sock"


def test_the_cpu_check_cannot_judge_a_quota_a_busy_host_never_let_the_sandbox_reach(tmp_path: Path):
    outcome = judge(BY_ID["cpu"], _counted(tmp_path, nr_throttled=0))  # the quota is there, never reached
    assert outcome.result == "error" and "less CPU than its quota" in outcome.evidence


def test_the_cpu_check_fails_a_quota_other_than_the_one_asked_for(tmp_path: Path):
    assert judge(BY_ID["cpu"], _counted(tmp_path, cpu_quota=200_000)).result == "failed"


@pytest.mark.parametrize(
    ("check", "limits", "why"),
    [
        ("cpu", Limits(2.0, 512 << 20, 256, host_cpus=2), "every CPU this host has"),
        ("memory", Limits(1.0, 4 << 30, 256, host_cpus=2), "--memory above 2048 MiB"),
        ("fork-bomb", Limits(1.0, 512 << 20, 4096, host_cpus=2), "--pids above 1024"),
        ("fork-bomb", Limits(1.0, 512 << 20, 256, host_cpus=2, nproc=300), "--nproc 300 stops the bomb"),
    ],
)
def test_a_resource_check_beyond_what_the_probe_may_take_is_not_applicable(tmp_path: Path, check, limits, why):
    outcome = judge(BY_ID[check], _holding(tmp_path, limits=limits))
    assert outcome.result == "n/a" and why in outcome.evidence


def _without(evidence: Evidence, name: str) -> Evidence:
    (evidence.workdir / "airlock-verify" / name).unlink()
    return evidence


@pytest.mark.parametrize(
    "broken",
    [
        lambda t: _counted(t, pids_now=256),  # the bomb's forks still hold every slot at the end
        lambda t: _without(_holding(t), "after-bomb"),  # no process started after the bomb
    ],
    ids=["forks-left", "no-process-after"],
)
def test_the_fork_bomb_check_fails_a_sandbox_that_does_not_answer_after_it(tmp_path: Path, broken):
    assert judge(BY_ID["fork-bomb"], broken(tmp_path)).result == "failed"


@pytest.mark.parametrize(
    "timed", [TimedRun(124, 3.0, ["cgroup /sys/fs/cgroup/pids/airlock/alx1t"]), TimedRun(124, 40.0, []), None],
    ids=["something-left", "too-slow", "not-run"],
)  # fmt: skip
def test_the_timeout_check_needs_the_run_stopped_in_time_and_nothing_left(tmp_path: Path, timed):
    assert judge(BY_ID["timeout"], _holding(tmp_path, timed=timed)).result == ("error" if timed is None else "failed")


def test_a_resource_counter_the_host_does_not_keep_makes_its_check_an_error(tmp_path: Path):
    outcome = judge(BY_ID["memory"], _holding(tmp_path, usage=Usage({}, True, TMP_FILL)))
    assert (outcome.result, outcome.evidence) == ("error", "the sandbox's cgroup had no oom_kill counter to read")


@pytest.mark.parametrize(
    ("version", "files", "expected"),
    [
        (2, {"cpu.max": "20000 100000\n", "cpu.stat": "usage_usec 9\nnr_throttled 7\nthrottled_usec 1500\n"},
         {"cpu_quota": 20000, "cpu_period": 100000, "nr_throttled": 7, "throttled_usec": 1500}),
        (1, {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n",
             "cpu.stat": "nr_periods 3\nnr_throttled 2\nthrottled_time 5000000\n"},
         {"cpu_quota": -1, "cpu_period": 100000, "nr_throttled": 2, "throttled_usec": 5000}),
    ],
    ids=["v2", "v1"],
)  # fmt: skip
def test_the_cgroup_counters_read_alike_under_v1_and_v2(tmp_path: Path, version, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert usage.group_counters(tmp_path, version, "cpu") == expected


def test_the_memory_and_pids_counters_read_from_their_v1_files(tmp_path: Path):
    for name, text in {"memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
                       "memory.max_usage_in_bytes": "536870912\n", "memory.limit_in_bytes": "536870912\n",
                       "memory.usage_in_bytes": "1000\n", "pids.events": "max 4\n", "pids.current": "3\n",
                       "pids.max": "max\n"}.items():  # fmt: skip
        (tmp_path / name).write_text(text)
    assert usage.group_counters(tmp_path, 1, "memory") == {
        "oom_kill": 1, "memory_peak": 512 << 20, "memory_max": 512 << 20, "memory_now": 1000,
    }  # fmt: skip
    assert usage.group_counters(tmp_path, 1, "pids") == {"pids_refused": 4, "pids_now": 3, "pids_max": -1}
