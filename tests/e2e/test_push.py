"""push_branch end to end: the agent's commits leave the sandbox as a git bundle, and the broker pushes them to the
fake GitHub over HTTPS with installation tokens narrowed to the repository (contents: read to fetch the base,
contents: write to push), then opens the pull request. Refused pushes never reach the fake's receive-pack."""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airlock.sandbox.workdir import QUARANTINE_ROOT
from airlock.verify.fakegit import IDENTITY
from airlock.verify.fakegithub_client import FakeGitHub
from airlock.verify.topology import GW_IP, Topology

from gateway_proc import AIRLOCK, GatewayProcess
from netclient import in_netns

BROKER = (GW_IP, 8080)
PUSH_GRANT = "push_branch:acme/app:head=agent/*"
PR_GRANT = "create_pull_request:acme/app:base=main,head=agent/*"
READ_GRANT = "get_pull_request:acme/app"
COMMENT_GRANT = "comment_on_pull_request:acme/app"
GRANTS = (PUSH_GRANT, PR_GRANT, READ_GRANT, COMMENT_GRANT)  # what the walk-through's agent is given
NOBODY_UID = 65534


def issue(gw: GatewayProcess, *grants: str) -> str:
    argv = [AIRLOCK, "token", "issue", "--state-dir", gw.workdir / "state", "--sandbox", "sbx", "--ttl", "10m"]
    for grant in grants or (PUSH_GRANT, PR_GRANT):
        argv += ["--grant", grant]
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _post(path: str, token: str, body: Any) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(*BROKER, timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    conn.request("POST", path, json.dumps(body), headers)
    response = conn.getresponse()
    answer = response.status, json.loads(response.read() or b"null")
    conn.close()
    return answer


def push(topology: Topology, token: str, bundle: bytes, branch: str = "agent/x") -> tuple[int, Any]:
    """push_branch from inside the sandbox namespace."""
    body = {"repo": "acme/app", "branch": branch, "bundle": base64.b64encode(bundle).decode()}
    return in_netns(topology.sbx, _post, "/v1/tools/push_branch", token, body)


def git(*args: str, cwd: Path, data: bytes | None = None) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}
    result = subprocess.run(["git", *args], cwd=cwd, input=data, capture_output=True, env=env | IDENTITY, check=False)
    assert result.returncode == 0, f"git {args}: {result.stderr.decode()}"
    return result.stdout.decode().strip()


class Work:
    """A clone of the fake's acme/app (the same base commit), where the test plays the agent."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def commit(self, name: str, branch: str | None = None, content: str | None = None) -> str:
        if branch:
            git("checkout", "-q", "-B", branch, cwd=self.path)
        (self.path / name).write_text(content or f"{name}\n")
        git("add", name, cwd=self.path)
        git("commit", "-q", "-m", f"add {name}", cwd=self.path)
        return git("rev-parse", "HEAD", cwd=self.path)

    def bundle(self, *revisions: str) -> bytes:
        out = self.path.parent / "out.bundle"
        git("bundle", "create", "-q", str(out), *(revisions or ("main..HEAD",)), cwd=self.path)
        return out.read_bytes()


@pytest.fixture
def work(fake_github: FakeGitHub, tmp_path: Path) -> Work:
    git("clone", "-q", fake_github.git()["app"]["path"], str(tmp_path / "work"), cwd=tmp_path)
    return Work(tmp_path / "work")


def push_records(gateway: GatewayProcess) -> list[dict[str, Any]]:
    """The gateway's audit lines of push_branch calls, once there is one (they are written in batches)."""
    deadline = time.monotonic() + 3
    while not (records := [r for r in gateway.audit() if r["kind"] == "broker" and r["method"] == "push_branch"]):
        assert time.monotonic() < deadline, "no push_branch audit line"
        time.sleep(0.05)
    return records


def receive_packs(fake_github: FakeGitHub) -> list[dict[str, Any]]:
    return [c for c in fake_github.calls("/acme/") if c["path"].endswith("/git-receive-pack")]


def test_push_fetches_with_a_read_token_and_pushes_with_a_write_token(
    topology: Topology, gateway: GatewayProcess, fake_github: FakeGitHub, work: Work
) -> None:
    work.commit("a.txt", branch="agent/x")
    tip = work.commit("b.txt")
    status, body = push(topology, issue(gateway), work.bundle())
    assert (status, body) == (200, {"sha": tip, "ref": "refs/heads/agent/x", "previous": None}), body
    assert fake_github.git()["app"]["refs"]["refs/heads/agent/x"] == tip
    asked = [c["body"] for c in fake_github.calls("/app/installations/", "POST")]
    assert asked == [
        {"repositories": ["app"], "permissions": {"contents": "read"}},
        {"repositories": ["app"], "permissions": {"contents": "write"}},
    ]
    (pushed,) = fake_github.pushes()
    assert (pushed["credential"], pushed["repositories"]) == ("installation", ["app"])
    assert pushed["permissions"] == {"contents": "write", "metadata": "read"}
    reads = [c for c in fake_github.calls("/acme/app.git/") if c["path"].endswith("git-upload-pack")]
    read_token = next(t["token"] for t in fake_github.tokens() if t["permissions"].get("contents") == "read")
    assert reads and {c["token"] for c in reads} == {read_token}
    # What the security team sees: one audit line, the bundle by hash and size; no credential anywhere.
    (record,) = push_records(gateway)
    assert (record["decision"], record["host"], record["extra"]["sha"]) == ("allow", "acme/app", tip)
    assert record["extra"]["bundle_bytes"] > 0 and len(record["extra"]["bundle_sha256"]) == 64
    text = gateway.audit_path.read_text() + gateway.log()
    for token in fake_github.tokens():
        assert token["token"] not in text
        assert base64.b64encode(f"x-access-token:{token['token']}".encode()).decode() not in text


def upload_packs(fake_github: FakeGitHub) -> int:
    return sum(1 for c in fake_github.calls("/acme/app.git/", "POST") if c["path"].endswith("/git-upload-pack"))


def test_a_second_push_to_the_repository_fetches_nothing(
    topology: Topology, gateway: GatewayProcess, fake_github: FakeGitHub, work: Work
) -> None:
    token = issue(gateway)
    work.commit("a.txt", branch="agent/a")
    assert push(topology, token, work.bundle(), "agent/a")[0] == 200
    first = upload_packs(fake_github)
    git("checkout", "-q", "-B", "agent/b", "main", cwd=work.path)
    tip = work.commit("b.txt")
    status, body = push(topology, token, work.bundle(), "agent/b")
    assert (status, body["sha"]) == (200, tip), body
    # The first push listed the branches and fetched the base (unless an earlier test's push to the repository
    # left it in the broker's cache); the second only lists them: its base is cached.
    assert first >= 1 and upload_packs(fake_github) - first == 1
    bare = Path(fake_github.git()["app"]["path"])
    assert git("log", "--format=%s", "main..agent/b", cwd=bare).splitlines() == ["add b.txt"]


def test_an_installation_token_github_stopped_taking_is_replaced_once(
    topology: Topology, gateway: GatewayProcess, fake_github: FakeGitHub, work: Work
) -> None:
    token = issue(gateway)
    work.commit("a.txt", branch="agent/x")
    assert push(topology, token, work.bundle())[0] == 200
    issued = len(fake_github.tokens())
    fake_github.expire_tokens()  # the broker still holds them, cached for an hour
    tip = work.commit("b.txt")
    status, body = push(topology, token, work.bundle())
    assert (status, body["sha"]) == (200, tip), body
    assert len(fake_github.tokens()) == issued + 2  # a fresh read and a fresh write token


def test_a_token_without_a_push_grant_never_reaches_git(
    topology: Topology, gateway: GatewayProcess, fake_github: FakeGitHub, work: Work
) -> None:
    work.commit("a.txt", branch="agent/x")
    status, body = push(topology, issue(gateway, PR_GRANT), work.bundle())
    assert (status, body["error"]) == (403, "outside_grant"), body
    assert fake_github.calls() == []


def evil_tree(work: Work) -> bytes:
    config = git("hash-object", "-w", "--stdin", cwd=work.path, data=b"[core]\n\thooksPath = /tmp/evil\n")
    inner = git("mktree", cwd=work.path, data=f"100644 blob {config}\tconfig\n".encode())
    listing = git("ls-tree", "main", cwd=work.path) + f"\n040000 tree {inner}\t.git\n"
    tree = git("mktree", cwd=work.path, data=listing.encode())
    commit = git("commit-tree", "-p", "main", "-m", "innocent", tree, cwd=work.path)
    git("update-ref", "refs/heads/agent/x", commit, cwd=work.path)
    return work.bundle("main..agent/x")


def missing_base(work: Work) -> bytes:
    work.commit("local-only.txt", branch="agent/x")
    work.commit("a.txt")
    return work.bundle("HEAD~1..HEAD")


def two_refs(work: Work) -> bytes:
    work.commit("a.txt", branch="agent/a")
    work.commit("b.txt", branch="agent/b")
    return work.bundle("agent/a", "agent/b", "^main")


def truncated(work: Work) -> bytes:
    work.commit("a.txt", branch="agent/x", content="x" * 5000)
    bundle = work.bundle()
    return bundle[: len(bundle) - 100]


@pytest.mark.parametrize(
    ("build", "status", "code"),
    [(evil_tree, 422, "bundle_rejected"), (missing_base, 422, "missing_prerequisites"),
     (two_refs, 422, "bundle_refs"), (truncated, 422, "invalid_bundle")],
    ids=["dot-git-in-a-tree", "missing-prerequisites", "two-refs", "truncated"],
)  # fmt: skip
def test_refused_bundles_never_reach_receive_pack(
    topology: Topology, gateway: GatewayProcess, fake_github: FakeGitHub, work: Work, build: Any, status: int, code: str
) -> None:
    answer, body = push(topology, issue(gateway), build(work))
    assert (answer, body["error"]) == (status, code), body
    assert receive_packs(fake_github) == [] and fake_github.pushes() == []
    assert set(fake_github.git()["app"]["refs"]) == {"refs/heads/main"}


def test_non_fast_forward_and_concurrent_pushes(
    topology: Topology, gateway: GatewayProcess, fake_github: FakeGitHub, work: Work
) -> None:
    token = issue(gateway)
    work.commit("one.txt", branch="agent/one")
    one = work.bundle()
    git("checkout", "-q", "-B", "agent/two", "main", cwd=work.path)
    work.commit("two.txt")
    two = work.bundle()
    results: list[tuple[int, Any]] = []
    threads = [threading.Thread(target=lambda b=b: results.append(push(topology, token, b))) for b in (one, two)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert sorted(status for status, _ in results) == [200, 409], results
    winner = next(body for status, body in results if status == 200)
    assert fake_github.git()["app"]["refs"]["refs/heads/agent/x"] == winner["sha"]
    assert len(fake_github.pushes()) == 1  # the loser was refused before pushing: never a force
    assert next(body for status, body in results if status == 409)["error"] == "non_fast_forward"


# ------------------------------------------------------------------------------------------- from airlock run

AGENT_SCRIPT = """set -e
git checkout -q -b agent/fix-1
echo fix > fix.txt && git add fix.txt && git -c user.name=Agent -c user.email=agent@example.test commit -qm 'Fix it'
echo more >> README.md && git -c user.name=Agent -c user.email=agent@example.test commit -qam 'Say more'
git bundle create -q /tmp/out.bundle main..HEAD
printf '{"repo":"acme/app","branch":"agent/fix-1","bundle":"%s"}' "$(base64 -w0 /tmp/out.bundle)" > /tmp/push.json
AUTH="Authorization: Bearer $(cat "$AIRLOCK_TOKEN_FILE")"
curl -sS -H "$AUTH" -H 'Content-Type: application/json' --data-binary @/tmp/push.json \\
     "$AIRLOCK_BROKER_URL/v1/tools/push_branch"; echo
curl -sS -H "$AUTH" -H 'Content-Type: application/json' \\
     -d '{"repo":"acme/app","head":"agent/fix-1","base":"main","title":"Fix it"}' \\
     "$AIRLOCK_BROKER_URL/v1/tools/create_pull_request" > /tmp/pr.json; cat /tmp/pr.json; echo
NUMBER=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["number"])' < /tmp/pr.json)
curl -sS -H "$AUTH" -H 'Content-Type: application/json' -d '{"repo":"acme/app","number":'"$NUMBER"'}' \\
     "$AIRLOCK_BROKER_URL/v1/tools/get_pull_request"; echo
curl -sS -H "$AUTH" -H 'Content-Type: application/json' \\
     -d '{"repo":"acme/app","number":'"$NUMBER"',"body":"CI is red on lint; fixing."}' \\
     "$AIRLOCK_BROKER_URL/v1/tools/comment_on_pull_request"; echo
curl -sS -H "$AUTH" "$AIRLOCK_BROKER_URL/v1/tools"; echo
git rev-parse HEAD
"""
CHECK_RUNS = [
    {"name": "build", "status": "completed", "conclusion": "success"},
    {"name": "lint", "status": "completed", "conclusion": "failure"},
    {"name": "e2e", "status": "queued", "conclusion": None},
]


@pytest.fixture
def agent_repo(topology: Topology, fake_github: FakeGitHub) -> Iterator[Path]:
    """The agent's working directory: a clone of the fake's acme/app, owned by the sandbox's user (nobody)."""
    root = Path(tempfile.mkdtemp(prefix=f"{topology.prefix}-push-", dir="/var/tmp"))
    folder = root / "app"
    git("clone", "-q", fake_github.git()["app"]["path"], str(folder), cwd=root)
    git("remote", "remove", "origin", cwd=folder)
    for path in [root, *root.rglob("*")]:
        os.chown(path, NOBODY_UID, NOBODY_UID, follow_symlinks=False)
    yield folder
    shutil.rmtree(root, ignore_errors=True)
    for leftover in QUARANTINE_ROOT.glob(f"{topology.prefix}*"):
        shutil.rmtree(leftover, ignore_errors=True)


def test_an_agent_in_airlock_run_pushes_its_commits_and_opens_a_pull_request(
    run_in_gw: Any, fake_github: FakeGitHub, broker_args: tuple[str, ...], agent_repo: Path, tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    fake_github.set(check_runs=CHECK_RUNS)
    options = ("--state-dir", str(tmp_path / "state"), "--audit", str(audit), *(f"--grant={g}" for g in GRANTS),
               *broker_args)  # fmt: skip
    result = run_in_gw("sh", "-c", AGENT_SCRIPT, cwd=agent_repo, options=options, timeout=120)
    assert result.returncode == 0, result.stderr
    assert_walked_through(result.stdout, result.stderr, fake_github, audit)
    # The call log has each tool call as the security team reads it, the push's bundle by hash and size.
    log = subprocess.run([AIRLOCK, "tools", "log", "--json", "--state-dir", str(tmp_path / "state")],
                         capture_output=True, text=True, check=True, timeout=30)  # fmt: skip
    calls = [json.loads(line) for line in log.stdout.splitlines()]
    assert [(c["tool"], c["status"]) for c in calls] == [
        ("push_branch", 200), ("create_pull_request", 201), ("get_pull_request", 200),
        ("comment_on_pull_request", 201),
    ]  # fmt: skip
    (push,) = [json.loads(line) for line in audit.read_text().splitlines() if '"method":"push_branch"' in line]
    kept = {"sha256": push["extra"]["bundle_sha256"], "bytes": push["extra"]["bundle_bytes"]}
    assert calls[0]["input"] == {"repo": "acme/app", "branch": "agent/fix-1", "bundle": kept}
    assert {c["sandbox"] for c in calls} == {push["sandbox"]}
    assert calls[1]["result"]["number"] == calls[2]["input"]["number"]
    for secret in [t["token"] for t in fake_github.tokens()]:
        assert secret not in log.stdout


def assert_walked_through(stdout: str, stderr: str, fake_github: FakeGitHub, audit: Path) -> None:
    """What AGENT_SCRIPT printed, what the fake GitHub has, what the audit says, after the agent ran it."""
    pushed, pull, status, comment, tools, head = stdout.strip().splitlines()[-6:]
    assert json.loads(pushed) == {"sha": head, "ref": "refs/heads/agent/fix-1", "previous": None}, stderr
    assert json.loads(pull)["head"] == "agent/fix-1" and json.loads(pull)["existing"] is False
    number = json.loads(pull)["number"]
    assert json.loads(status) == {
        "number": number, "url": f"https://api.github.test/repos/acme/app/pulls/{number}",
        "html_url": f"https://github.test/acme/app/pull/{number}", "state": "open", "draft": False, "merged": False,
        "mergeable": True, "head": "agent/fix-1", "head_sha": head, "base": "main",
        "checks": {"total": 3, "counts": {"success": 1, "failure": 1, "pending": 1}, "failing": ["lint"],
                   "complete": True},
    }, status  # fmt: skip
    (posted,) = fake_github.comments()
    assert json.loads(comment) == {"id": posted["id"], "html_url": posted["comment"]["html_url"], "number": number}
    assert (posted["number"], posted["body"], posted["credential"]) == (number, "CI is red on lint; fixing.",
                                                                      "installation")  # fmt: skip
    assert (posted["permissions"], posted["repositories"]) == ({"pull_requests": "write", "metadata": "read"}, ["app"])
    assert [t["name"] for t in json.loads(tools)["tools"]] == [
        "create_pull_request", "push_branch", "get_pull_request", "comment_on_pull_request",
    ]  # fmt: skip
    # The fake's repository has exactly the agent's two commits on the branch, and the pull request points there.
    bare = Path(fake_github.git()["app"]["path"])
    assert fake_github.git()["app"]["refs"]["refs/heads/agent/fix-1"] == head
    assert git("log", "--format=%s", "main..agent/fix-1", cwd=bare).splitlines() == ["Say more", "Fix it"]
    (pr,) = fake_github.prs()
    assert (pr["head"], pr["head_sha"], pr["base"], pr["credential"]) == ("agent/fix-1", head, "main", "installation")
    # The audit: the sandbox's broker calls, allowed, the push by bundle hash and size.
    records = [json.loads(line) for line in audit.read_text().splitlines() if '"kind":"broker"' in line]
    assert [(r["method"], r["decision"], r["extra"]["status"]) for r in records] == [
        ("push_branch", "allow", 200), ("create_pull_request", "allow", 201), ("get_pull_request", "allow", 200),
        ("comment_on_pull_request", "allow", 201), ("list_tools", "allow", 200),
    ]  # fmt: skip
    assert records[0]["extra"]["sha"] == head
    assert set(records[0]["extra"]) == {"jti", "status", "branch", "bundle_sha256", "bundle_bytes", "sha", "ref",
                                        "previous"}  # fmt: skip
    # One token per step, each with one permission besides metadata (the comment reuses the pull request's).
    held = [sorted(t["permissions"].items()) for t in fake_github.tokens()]
    assert sorted(held) == sorted(sorted([("metadata", "read"), permission]) for permission in [
        ("contents", "read"), ("contents", "write"), ("pull_requests", "write"), ("pull_requests", "read"),
        ("checks", "read"),
    ])  # fmt: skip
    for secret in [t["token"] for t in fake_github.tokens()]:
        assert secret not in stdout + stderr + audit.read_text()
