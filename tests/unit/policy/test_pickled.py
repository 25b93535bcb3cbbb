"""A policy pickled in one process decides the same in another: its keyed rule tables are placed by hash(), which
each process seeds differently."""

from __future__ import annotations

import pickle
import subprocess
import sys

from airlock.policy import decide, parse_policy

POLICY = (
    """version: 1
profiles:
  default:
    allow:
"""
    + "".join(f"      - host: h{i}.test\n        ports: [443]\n" for i in range(200))
    + """      - host: "*.wild.test"
      - cidr: 198.51.100.0/24
        ports: [80]
    deny:
      - host: h7.test
"""
)
QUESTIONS = [(f"h{i}.test", 443) for i in range(0, 200, 7)] + [
    ("h7.test", 443), ("h1.test", 80), ("a.wild.test", 80), ("198.51.100.9", 80), ("198.51.101.9", 80), ("x.test", 443)
]  # fmt: skip
ASK = """
import pickle, sys
from airlock.policy import decide
policy, questions = pickle.loads(sys.stdin.buffer.read())
print([decide(policy.profile("default"), host, port).allow for host, port in questions])
"""


def test_a_pickled_policy_decides_the_same_in_a_process_with_another_hash_seed() -> None:
    policy = parse_policy(POLICY, "p.yaml")
    here = [decide(policy.profile("default"), host, port).allow for host, port in QUESTIONS]
    assert True in here and False in here
    blob = pickle.dumps((policy, QUESTIONS))
    for seed in ("1", "2", "12345"):
        there = subprocess.run(
            [sys.executable, "-c", ASK], input=blob, capture_output=True, check=True, env={"PYTHONHASHSEED": seed}
        )
        assert there.stdout.decode().strip() == str(here), there.stderr.decode()[-2000:]
    assert pickle.loads(pickle.dumps(policy)).hash == policy.hash
