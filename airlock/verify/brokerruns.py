"""The broker group's runs: the fake GitHub in the fake internet, an App installed on the grant's owner, and three
short `airlock run`s sharing one broker state directory (signing keys, idempotency records) and audience, as one
gateway's sandboxes do. The first opens a pull request with an Idempotency-Key and is killed (SIGKILL, its gateway
with it) while GitHub holds its answer: the pull request made, the broker's outcome never written. The second, the
same sandbox again, repeats the call with the same key and tries outside its grant (another repository, another
tool); the third, another sandbox, presents the first's token, which the host picked up from the first's working
directory. What is judged is what the fake GitHub recorded and the broker's audit lines."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airlock.sandbox.netns import resolve_user

from . import brokerprobe
from .checks import PROBE_ARGV, BrokerRecord
from .control import stop_proc
from .fakegithub_client import FakeGitHub, make_app_key
from .targets import BrokerTarget
from .topology import Topology

APP_ID, INSTALLATION_ID = 4242, 777
HANG_SECONDS = 30.0  # how long the fake GitHub holds its answer to the first call (the run is killed meanwhile)
RUN_SECONDS = 60.0
# One audience for the three runs, as one gateway's (or a fleet's) sandboxes share theirs: the token another sandbox
# presents is then one the broker would take, but for whose it is (not merely for another broker).
AUDIENCE = "http://broker.airlock-verify.test:8080"

RunArgv = Callable[[str, Path], list[str]]  # sandbox id, working directory -> `airlock run` (the command to follow)
Leftovers = Callable[[str], list[str]]  # sandbox id -> what of it is still there


def broker_runs(
    topology: Topology, cert: Path, key: Path, private: Path, base: Path, target: BrokerTarget, nonce: str,
    run_argv: RunArgv, leftovers: Leftovers,
) -> BrokerRecord:  # fmt: skip
    app_key = private / "github" / "app.pem"
    github = FakeGitHub(cert, key, owner=target.repo.split("/")[0], app_key_path=app_key)
    try:
        github.start(topology, private / "github", APP_ID, make_app_key(app_key), INSTALLATION_ID)  # RuntimeError
        return _runs(topology, github, private, base, target, nonce, run_argv, leftovers)
    finally:
        github.stop()


def _runs(
    topology: Topology, github: FakeGitHub, private: Path, base: Path, target: BrokerTarget, nonce: str,
    run_argv: RunArgv, leftovers: Leftovers,
) -> BrokerRecord:  # fmt: skip
    options = [
        "--github-api", github.api_url, "--github-app-id", str(APP_ID), "--github-app-key", str(github.app_key_path),
        "--github-timeout", f"{HANG_SECONDS + 10:g}", "--state-dir", str(private / "broker-state"),
        "--audience", AUDIENCE,
    ]  # fmt: skip
    audits = {run: private / f"broker-audit-{run}.jsonl" for run in ("first", "again", "foreign")}

    def argv(run: str, sandbox_id: str, work: Path) -> list[str]:
        return [*run_argv(sandbox_id, work), *options, "--audit", str(audits[run])]

    first, foreign = f"{topology.prefix}b", f"{topology.prefix}f"
    record = BrokerRecord(target, first, foreign, nonce)
    github.set(hang=True, hang_after_create=True, hang_seconds=HANG_SECONDS)
    work = _workdir(base / "broker-1")
    created = record.pull_request("first")
    proc = _start(topology, argv("first", first, work), work, {"hold": True, "calls": [created]}, private)
    _wait(lambda: any(pr["head"] == created["body"]["head"] for pr in github.prs()) or proc.poll() is not None)
    # Killed mid-call, its gateway with it: the pull request made, the broker's outcome never written. Its watchdog
    # removes the sandbox; the same sandbox starts again once that is done.
    proc.kill()
    proc.wait()
    _wait(lambda: not leftovers(first))
    token = work / brokerprobe.FOLDER / brokerprobe.TOKEN_FILE
    leaked = token.read_text().strip() if token.exists() else ""
    github.set(hang=False, hang_after_create=False)
    calls = [record.pull_request("repeat"), *record.outside()]
    _finish(_start(topology, argv("again", first, work), work, {"calls": calls}, private))
    stolen = _workdir(base / "broker-2")
    _finish(_start(topology, argv("foreign", foreign, stolen), stolen,
                   {"calls": [record.pull_request("foreign", leaked)]}, private))  # fmt: skip
    stats = github.stats()
    return BrokerRecord(
        target, first, foreign, nonce, stats["prs"], stats["comments"],
        {run: _audit_lines(path) for run, path in audits.items()}, _jti(leaked),
        {**_answers(work), **_answers(stolen)},
    )  # fmt: skip


def _workdir(path: Path) -> Path:
    path.mkdir(mode=0o755)
    pw = resolve_user(None)  # whom `airlock run` runs the command as
    os.chown(path, pw.pw_uid, pw.pw_gid)
    return path


def _start(
    topology: Topology, argv: list[str], work: Path, config: dict[str, Any], private: Path
) -> subprocess.Popen[Any]:
    argv = [*argv, "--", *PROBE_ARGV, Path(brokerprobe.__file__).read_text(), json.dumps(config)]
    env = os.environ | {"TMPDIR": str(private / "tmp")}
    return topology.popen(topology.gw, argv, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _finish(proc: subprocess.Popen[Any]) -> None:
    try:
        proc.wait(RUN_SECONDS)
    except subprocess.TimeoutExpired:
        stop_proc(proc)


def _wait(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + RUN_SECONDS
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)


def _audit_lines(path: Path) -> list[dict[str, Any]]:
    """The broker's audit lines (its requests) of one run."""
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if line.get("kind") == "broker"]


def _jti(token: str) -> str | None:
    """The token's id, read from its claims (not verified: it only names the token in the audit lines)."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return None
    jti = claims.get("jti") if isinstance(claims, dict) else None
    return str(jti) if jti else None


def _answers(work: Path) -> dict[str, str]:
    found = {}
    for path in sorted((work / brokerprobe.FOLDER).glob("*.json")):
        try:
            answer = json.loads(path.read_text())
            found[path.stem] = f"{answer.get('status')} {str(answer.get('body'))[:160]}"
        except (OSError, ValueError):
            continue
    return found
