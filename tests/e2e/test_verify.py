"""`airlock verify` end to end, as a user runs it on the host: its own fake internet, a real sandbox in it, the
matrix. It holds on the default setup (with a pull-request grant, for the broker's checks), and fails exactly the
checks a weakened setup breaks: without filesystem isolation the file checks (another sandbox's folder too), the
/tmp fill and what bubblewrap hides (a pod's token, the docker socket), with a policy that opens more ports of an
allowed host the other-port check, with one that opens the internal network the rebinding check. With a policy that
inspects an allowed host, the placeholder the probe sends there is refused. A check that could not run is an error
(exit 2), never a pass."""

from __future__ import annotations

import json
import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

from jsonschema import Draft202012Validator

from airlock.verify.checks import CHECKS

from gateway_proc import AIRLOCK, POLICIES

NOT_RUN = "a check could not run (see ERROR above): nothing is verified"
SCHEMA = Draft202012Validator(
    json.loads((Path(__file__).resolve().parents[2] / "docs" / "verify-report.schema.json").read_text())
)
OPEN_PORTS_POLICY = (POLICIES / "open-ports.yaml").read_text()  # more ports of an allowed host than 443
# Opens the internal address the fake DNS rebinds an allowed name to.
INTERNAL_POLICY = """\
version: 1
default_profile: default
profiles:
  default:
    allow:
      - host: pypi.org
      - host: files.pythonhosted.org
      - host: github.com
      - cidr: 10.1.2.0/24
        ports: [80, 443]
"""

# Inspects an allowed host and injects nothing there: a placeholder sent to it is one sent where its secret is not.
INSPECTED_POLICY = """\
version: 1
default_profile: default
profiles:
  default:
    allow:
      - host: pypi.org
        inspect: true
      - host: files.pythonhosted.org
      - host: github.com
"""


def _verify(tmp_path: Path, *options: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    report = tmp_path / "verify.json"
    argv = [AIRLOCK, "verify", "--json", str(report), *options]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    verdicts = json.loads(report.read_text()) if report.exists() else {}
    return done, verdicts


def _results(verdicts: dict) -> dict[str, str]:
    return {check["id"]: check["result"] for check in verdicts["checks"]}


# A CPU quota this shared test host still lets the sandbox exceed when it is busy: at the default 1 CPU a host busy
# with other work may never give the sandbox a quota's worth, and the cpu check then says it could not judge.
QUOTA = ("--cpus", "0.25")
GRANT = ("--grant", "create_pull_request:acme/app")  # the broker group's runs need a pull-request grant


def _host_canary_paths() -> list[bool]:
    return [Path(p).exists() for p in ("/run/docker.sock", "/run/secrets", "/run/secrets/kubernetes.io")]


def _leftover_folders() -> set[Path]:
    return set(Path("/var/tmp").glob("airlock-verify-*"))


def test_verify_holds_every_check_on_the_default_setup(tmp_path: Path):
    before = _leftover_folders()
    junit = tmp_path / "verify.xml"
    done, verdicts = _verify(tmp_path, "--junit", str(junit), *GRANT, *QUOTA)
    assert done.returncode == 0, done.stdout + done.stderr
    SCHEMA.validate(verdicts)
    # the docker backend's container and network; a placeholder refused where the default policy inspects no host
    not_here = {"container", "placeholder-elsewhere"}
    assert _results(verdicts) == {check.id: "n/a" if check.id in not_here else "held" for check in CHECKS}
    assert verdicts["summary"] == {"held": len(CHECKS) - 2, "failed": 0, "error": 0, "n/a": 2}
    for check in CHECKS:  # the matrix names each check and its verdict
        assert f"{check.group}/{check.id}" in done.stdout
    suites = ET.parse(junit).getroot()
    assert (suites.get("tests"), suites.get("failures"), suites.get("errors")) == (str(len(CHECKS)), "0", "0")
    assert suites.get("skipped") == "2"
    assert _leftover_folders() == before
    evidence = {check["id"]: check["evidence"] for check in verdicts["checks"]}
    assert evidence["idempotent-retry"].startswith("1 pull requests upstream from agent/airlock-verify-")
    assert "deny 403 outside_grant" in evidence["outside-grant"] and "0 comments upstream" in evidence["outside-grant"]
    assert "deny 403 wrong_sandbox" in evidence["foreign-token"], evidence["foreign-token"]
    assert evidence["placeholder-elsewhere"].startswith("the profile inspects no allowed host")
    assert "its canary not read by the probe, unchanged; new there: nothing" in evidence["other-sandbox"]
    assert evidence["other-sandbox"].endswith(": 0 packets from another sandbox reached it"), evidence["other-sandbox"]


def test_verify_with_an_inspected_host_sees_the_placeholder_sent_there_refused(tmp_path: Path):
    policy = tmp_path / "inspected.yaml"
    policy.write_text(INSPECTED_POLICY)
    done, verdicts = _verify(tmp_path, "--policy", str(policy), "--only", "inspection")
    assert done.returncode == 0, done.stdout + done.stderr
    evidence = {check["id"]: check["evidence"] for check in verdicts["checks"]}
    assert _results(verdicts)["placeholder-elsewhere"] == "held", evidence
    # the header's and the URL's, each refused
    assert (
        evidence["placeholder-elsewhere"].startswith(
            "the placeholder of secret verify (verify's own); pypi.org (inspected): 0 requests at its upstream carried "
            "the placeholder or the secret; the gateway's audit of /airlock-verify/"
        )
        and "placeholder: deny placeholder_misuse, deny placeholder_misuse; " in evidence["placeholder-elsewhere"]
    )


USER_SECRET_POLICY = (POLICIES / "user-secret.yaml").read_text()  # model_api injected at api.model.example


def test_verify_drives_the_users_injected_secret_to_every_other_host_the_gateway_reads(tmp_path: Path):
    policy, secret = tmp_path / "user-secret.yaml", tmp_path / "model-key"
    policy.write_text(USER_SECRET_POLICY)
    secret.write_text("sk-user-model-key-5e2a\n")
    secret.chmod(0o600)
    done, verdicts = _verify(tmp_path, "--policy", str(policy), "--secret", f"model_api=file:{secret}",
                             "--only", "inspection", "--only", "secrets")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert set(_results(verdicts).values()) == {"held"}, done.stdout
    evidence = next(check["evidence"] for check in verdicts["checks"] if check["id"] == "placeholder-elsewhere")
    assert evidence.startswith("the placeholder of secret model_api (yours, injected at api.model.example); "), evidence
    refused = "placeholder: deny placeholder_misuse, deny placeholder_misuse"
    for host in ("pypi.org (inspected): 0 requests", "github.com (plain HTTP): 0 requests"):
        assert f"{host} at its upstream carried the placeholder or the secret" in evidence, evidence
    assert evidence.count(refused) == 2, evidence
    assert (
        "files.pythonhosted.org (passthrough): not judged, the gateway reads nothing inside its TLS (2 of " in evidence
    )
    assert evidence.endswith("the secret's value upstream elsewhere: nowhere"), evidence
    assert "sk-user-model-key-5e2a" not in done.stdout + done.stderr + json.dumps(verdicts)


def test_verify_refuses_a_secret_it_cannot_read_or_a_policy_injecting_one_not_given_before_building_anything(
    tmp_path: Path,
):
    policy = tmp_path / "user-secret.yaml"
    policy.write_text(USER_SECRET_POLICY)
    done, verdicts = _verify(tmp_path, "--policy", str(policy))
    assert (done.returncode, verdicts) == (2, {})
    assert done.stderr == (
        f"airlock: {policy} injects secret 'model_api': give it as `airlock run` needs it (--secret "
        "model_api=file:PATH), or verify a policy without the injection\n"
    )
    done, verdicts = _verify(tmp_path, "--secret", f"model_api=file:{tmp_path / 'missing'}")
    assert (done.returncode, verdicts) == (2, {})
    missing = tmp_path / "missing"
    assert done.stderr == f"airlock: --secret model_api: file {missing}: cannot read it: No such file or directory\n"


def test_verify_without_a_pull_request_grant_says_the_broker_group_does_not_apply(tmp_path: Path):
    done, verdicts = _verify(tmp_path, "--only", "broker")
    assert done.returncode == 0, done.stdout + done.stderr
    SCHEMA.validate(verdicts)
    assert set(_results(verdicts).values()) == {"n/a"} and verdicts["summary"]["n/a"] == 3
    assert all(check["evidence"].startswith("no --grant create_pull_request") for check in verdicts["checks"])


def test_verify_without_filesystem_isolation_fails_exactly_the_checks_of_what_bubblewrap_hides(tmp_path: Path):
    groups = ("--only", "files", "--only", "secrets", "--only", "tenancy", "--only", "privilege", "--only", "resources")
    canaries_before = _host_canary_paths()
    done, verdicts = _verify(tmp_path, "--isolation", "none", *groups, *QUOTA)
    assert done.returncode == 1, done.stdout + done.stderr
    SCHEMA.validate(verdicts)
    failed = {check for check, result in _results(verdicts).items() if result != "held"}
    hidden = {"service-account", "docker-socket"}  # the pod's token and the docker socket, in sight
    written = {"write-outside", "write-symlink", "write-proc-root", "other-sandbox"}  # the other sandbox's folder too
    assert failed == {*written, "tmp-fill", *hidden}, done.stdout
    socket = next(check for check in verdicts["checks"] if check["id"] == "docker-socket")
    assert socket["evidence"].endswith("2 connections at its canary")
    fill = next(check for check in verdicts["checks"] if check["id"] == "tmp-fill")
    assert fill["evidence"].startswith("the sandbox's /tmp is the host's /tmp")
    assert not list(Path("/tmp").glob("airlock-verify-fill-*")), "the fill is removed from the host's /tmp"
    assert _host_canary_paths() == canaries_before  # the host canaries too
    assert "FAILED" in done.stdout


def test_verify_with_a_policy_that_opens_other_ports_fails_the_other_port_check(tmp_path: Path):
    policy = tmp_path / "open-ports.yaml"
    policy.write_text(OPEN_PORTS_POLICY)
    done, verdicts = _verify(tmp_path, "--policy", str(policy), "--only", "network")
    assert done.returncode == 1, done.stdout + done.stderr
    results = _results(verdicts)
    assert {check for check, result in results.items() if result != "held"} == {"other-port"}, done.stdout
    other = next(check for check in verdicts["checks"] if check["id"] == "other-port")
    assert other["evidence"] == "1 connections at 192.0.2.10:8443, 1 connections at 192.0.2.10:9999"


def test_verify_with_a_policy_that_opens_the_internal_network_fails_the_rebinding_check(tmp_path: Path):
    policy = tmp_path / "internal.yaml"
    policy.write_text(INTERNAL_POLICY)
    done, verdicts = _verify(tmp_path, "--policy", str(policy), "--only", "network")
    assert done.returncode == 1, done.stdout + done.stderr
    assert {check for check, result in _results(verdicts).items() if result != "held"} == {"dns-rebinding"}
    rebinding = next(check for check in verdicts["checks"] if check["id"] == "dns-rebinding")
    assert "the gateway asked for files.pythonhosted.org 2 times" in rebinding["evidence"], rebinding
    assert "0 connections at 10.1.2.3:443" not in rebinding["evidence"]


def test_verify_says_a_resource_check_beyond_what_its_probe_may_take_is_not_applicable(tmp_path: Path):
    every_cpu = str(len(os.sched_getaffinity(0)))
    done, verdicts = _verify(tmp_path, "--only", "resources", "--cpus", every_cpu, "--memory", "4g", "--pids", "2000")
    assert done.returncode == 0, done.stdout + done.stderr
    results = _results(verdicts)
    assert results == {"cpu": "n/a", "memory": "n/a", "fork-bomb": "n/a", "tmp-fill": "held", "timeout": "held"}
    assert "n/a" in done.stdout and verdicts["summary"]["n/a"] == 3


def test_verify_reports_a_check_that_could_not_run_as_an_error(tmp_path: Path):
    # Four processes: the probe cannot start its threads, so it attempts nothing and nothing may pass.
    done, verdicts = _verify(tmp_path, "--pids", "4", "--only", "files")
    assert done.returncode == 2, done.stdout + done.stderr
    assert set(_results(verdicts).values()) == {"error"}
    assert done.stderr.splitlines()[-1] == f"airlock: error: {NOT_RUN}"


def test_verify_refuses_a_policy_that_would_open_metadata_before_building_anything(tmp_path: Path):
    policy = tmp_path / "metadata.yaml"
    policy.write_text(OPEN_PORTS_POLICY + "      - cidr: 169.254.169.254/32\n        ports: [80]\n")
    done, verdicts = _verify(tmp_path, "--policy", str(policy))
    assert (done.returncode, verdicts) == (2, {})
    assert done.stderr == (
        f"{policy}:11: cidr '169.254.169.254/32' covers cloud metadata / link-local addresses, which never open\n"
    )
