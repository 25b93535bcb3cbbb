"""What the walk-throughs of the docs ask the reader to type and to have, as `airlock demo` prints and writes them:
each block word for word the one its page marks `<!-- walkthrough: NAME -->` (tests/unit/test_demo.py holds them
equal), so that what the demo says to type is what the docs say."""

from __future__ import annotations

from dataclasses import dataclass

# The blocks, by their mark in the docs.
BLOCKS = {
    "pull-request/operator": r""".venv/bin/airlock run --workdir app --grant 'push_branch:acme/app:head=agent/*' \
     --grant 'create_pull_request:acme/app:base=main' --github-app-id 4242 --github-app-key app.pem \
     --audit audit.jsonl -- ./agent.sh
""",
    "pull-request/agent": r"""#!/bin/sh -e
git checkout -b agent/fix-1
echo 'Fixed.' >> README.md && git commit -qam 'Fix it'
git bundle create /tmp/out.bundle main..HEAD                  # only the new commits; main is already on GitHub
AUTH="Authorization: Bearer $(cat "$AIRLOCK_TOKEN_FILE")"
curl -sS -w '\n' "$AIRLOCK_BROKER_URL/v1/tools" -H "$AUTH"   # what this token may call, with input schemas
printf '{"repo":"acme/app","branch":"agent/fix-1","bundle":"%s"}' "$(base64 -w0 /tmp/out.bundle)" > /tmp/push.json
curl -sS -w '\n' "$AIRLOCK_BROKER_URL/v1/tools/push_branch" -H "$AUTH" -H 'Content-Type: application/json' \
     --data-binary @/tmp/push.json
# 200 {"sha": "2907ff03…", "ref": "refs/heads/agent/fix-1", "previous": null}
curl -sS -w '\n' "$AIRLOCK_BROKER_URL/v1/tools/create_pull_request" -H "$AUTH" -H 'Content-Type: application/json' \
     -d '{"repo":"acme/app","head":"agent/fix-1","base":"main","title":"Fix it"}'
# 201 {"number": 1, "html_url": "https://github.com/acme/app/pull/1", "head": "agent/fix-1", ..., "existing": false}
""",
    "api-key/policy": r"""version: 1
profiles:
  default:
    allow:
      - host: api.model.example
        name: model-api
        inspect: true                   # the gateway terminates TLS here, nowhere else
        http:                           # then deny by default within the host
          - {methods: [POST], paths: ["/v1/**"]}
          - {methods: [GET], paths: ["/v1/models"]}
        inject:
          - {header: Authorization, value: "Bearer {secret:model_api}"}
      - host: github.com
        inspect: true
        inject:
          - github: {permissions: {contents: read}}   # git clone/fetch of the repositories the run's grants name
""",
    "api-key/run": r""".venv/bin/airlock run --policy keys.yaml --secret model_api=file:/etc/airlock/model_api.key \
    --placeholder-env OPENAI_API_KEY=model_api --workdir app -- python3 agent.py
""",
    "denied/run": r"""# 1. The agent's run, as the operator started it:
cp configs/default.yaml team.yaml
.venv/bin/airlock run --policy team.yaml --state-dir /tmp/al --audit /tmp/al-audit.jsonl --workdir app -- \
     sh -c 'until curl -fsS https://pkg.example/simple/ >/dev/null; do sleep 2; done; echo reached'
# airlock: denied pkg.example:443 — pkg.example:443 is not in the allowlist · to allow: allow: [{host: pkg.example, ports: [443]}]
# (one line per target, repeated ones de-duplicated; --quiet silences them)
""",
    "denied/add-rule": r"""# 2. In another terminal: the rule to add, from what was denied, merged into the policy with its comments kept
#    (the audit log is root's, 0640 — it holds the hosts and paths the sandbox asked for: as a user, this asks sudo)
.venv/bin/airlock policy suggest /tmp/al-audit.jsonl --merge team.yaml > team.new.yaml
.venv/bin/airlock policy check team.new.yaml && cp team.new.yaml team.yaml
# the run prints "airlock: policy reloaded from /…/team.yaml (sha256:…)" within a second; the next try: reached
""",
    "approvals/policy": r"""version: 1
profiles:
  default:
    on_unlisted: ask                  # hold what no rule lists, for a person to answer
    ask_timeout: 120
    allow:
      - host: pypi.org
""",
    "approvals/run": r"""# 1. The agent's run:
.venv/bin/airlock run --policy ask.yaml --state-dir /tmp/al --workdir app -- \
     sh -c 'curl -fsS https://pkg.example/simple/ >/dev/null && echo reached'
# airlock: sandbox … asks for pkg.example:443 (connect), held 120 s for an answer: /…/airlock approvals approve 3f9c… --admin /tmp/al/admin.sock (or deny)
""",
    "approvals/answer": r"""# 2. In another terminal, while the run waits: what is held, then the answer (ID: the one listed). `--scope policy`
#    writes {host: pkg.example, ports: [443]} into ask.yaml and reloads; the run goes on: reached
.venv/bin/airlock approvals list --state-dir /tmp/al
.venv/bin/airlock approvals approve ID --scope policy --state-dir /tmp/al
""",
}
# The agent of the key walk-through: any program whose SDK sends the key it was given.
AGENT_PY = """import os, urllib.request
request = urllib.request.Request("https://api.model.example/v1/models")
request.add_header("Authorization", "Bearer " + os.environ["OPENAI_API_KEY"])
print(urllib.request.urlopen(request).read().decode().strip())
"""


@dataclass(frozen=True)
class Step:
    """One thing to type: where (the demo's shell, or a second one), and the block."""

    where: str
    block: str


@dataclass(frozen=True)
class Walkthrough:
    title: str
    page: str
    steps: tuple[Step, ...]
    after: str  # what the reader should see


WALKTHROUGHS = {
    "pull-request": Walkthrough(
        "an agent opens a pull request",
        "docs/broker.md#walk-through-an-agent-opens-a-pull-request",
        (Step("in the demo's shell (app/agent.sh is the agent)", "pull-request/operator"),),
        "the agent's three answers (its tools, the push, the pull request #1 on acme/app); audit.jsonl has the calls",
    ),
    "api-key": Walkthrough(
        "an API key the agent never sees",
        "docs/inspection.md#tls-inspection-an-api-key-the-agent-never-sees",
        (Step("in the demo's shell (keys.yaml is the policy, app/agent.py the agent)", "api-key/run"),),
        "api.model.example: the Authorization header held the real key (the agent had a placeholder)",
    ),
    "denied": Walkthrough(
        "an agent was denied: add the rule",
        "docs/policy.md#walk-through-an-agent-was-denied--add-the-rule",
        (
            Step("in the demo's shell", "denied/run"),
            Step("in a second demo shell, while the first waits", "denied/add-rule"),
        ),
        "the first shell's run prints the policy reloaded, then `reached`",
    ),
    "approvals": Walkthrough(
        "approvals: a person answers",
        "docs/policy.md#walk-through-approvals--a-person-answers",
        (
            Step("in the demo's shell (ask.yaml is the policy)", "approvals/run"),
            Step("in a second demo shell, while the first waits (ID: the one listed)", "approvals/answer"),
        ),
        "the rule written into ask.yaml, the policy reloaded, and `reached` in the first shell",
    ),
}
