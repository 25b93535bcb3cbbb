"""The broker group's probe, run in a sandbox by `airlock verify` (the standard library alone, by the system's
`python3`): it makes the tool calls its configuration names against `$AIRLOCK_BROKER_URL`, with the sandbox's own
token or one handed to it, and writes what each answered (and its own token, as a sandbox leaking it would) into
`airlock-verify-broker/` of its working directory. What it writes is shown beside the verdicts, never the verdict:
those are judged by the fake GitHub's records and the broker's audit lines.

Configuration (argv[1], JSON): `calls`, each `{name, tool, body, key, token}` (`key` the Idempotency-Key or null,
`token` null for the sandbox's own); `hold`, to wait after the calls until the sandbox is stopped."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

FOLDER = "airlock-verify-broker"
TOKEN_FILE = "token"  # the sandbox's own token, where the host picks it up


def call(url: str, token: str, tool: str, body: dict[str, Any], key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    if key:
        headers["Idempotency-Key"] = key
    request = urllib.request.Request(f"{url}/v1/tools/{tool}", json.dumps(body).encode(), headers, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the broker is the gateway's own address
    try:
        with opener.open(request, timeout=60) as answer:
            return {"status": answer.status, "body": answer.read(4096).decode(errors="replace")}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read(4096).decode(errors="replace")}
    except OSError as e:
        return {"status": None, "body": f"{type(e).__name__}: {e}"}


def main() -> None:
    config = json.loads(sys.argv[1])
    out = Path(FOLDER)
    out.mkdir(exist_ok=True)
    own = Path(os.environ.get("AIRLOCK_TOKEN_FILE", "/nonexistent")).read_text().strip()
    (out / TOKEN_FILE).write_text(own)
    url = os.environ["AIRLOCK_BROKER_URL"]
    for each in config["calls"]:
        (out / f"{each['name']}.started").touch()
        answer = call(url, each["token"] or own, each["tool"], each["body"], each["key"])
        (out / f"{each['name']}.json").write_text(json.dumps(answer))
    if config.get("hold"):
        time.sleep(300)


if __name__ == "__main__":
    main()
