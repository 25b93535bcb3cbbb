"""The verdicts of `airlock verify` as the matrix it prints, as JSON (docs/verify-report.schema.json) and as JUnit XML;
and its exit code: 0 only when every check that applies held, 2 when one could not run, else 1."""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .checks import Check, CheckVerdict

SCHEMA_VERSION = 1
EXIT_HELD, EXIT_FAILED, EXIT_ERROR = 0, 1, 2
_MARK = {"held": "held", "failed": "FAILED", "error": "ERROR", "n/a": "n/a"}


@dataclass(frozen=True)
class Run:
    """What was verified, and how."""

    backend: str
    policy: str
    profile: str
    isolation: str
    seconds: float


def exit_code(outcomes: list[CheckVerdict]) -> int:
    results = {outcome.result for outcome in outcomes}
    if "error" in results or not outcomes:
        return EXIT_ERROR
    return EXIT_FAILED if "failed" in results else EXIT_HELD


def summary(outcomes: list[CheckVerdict]) -> dict[str, int]:
    counts = Counter(outcome.result for outcome in outcomes)
    return {result: counts.get(result, 0) for result in ("held", "failed", "error", "n/a")}


def matrix(outcomes: list[CheckVerdict], width: int = 120) -> str:
    """One row per check: group/id, what must happen, the result, the evidence (wrapped beneath)."""
    name_width = max((len(f"{o.check.group}/{o.check.id}") for o in outcomes), default=10)
    lines = [f"{'check':<{name_width}}  {'result':<6}  must / evidence"]
    indent = " " * (name_width + 10)
    for o in outcomes:
        lines.append(f"{o.check.group + '/' + o.check.id:<{name_width}}  {_MARK[o.result]:<6}  {o.check.must}")
        lines += textwrap.wrap(f"evidence: {o.evidence}", width, initial_indent=indent, subsequent_indent=indent)
    counts = summary(outcomes)
    lines.append(", ".join(f"{n} {result}" for result, n in counts.items() if n) or "no checks")
    return "\n".join(lines)


def listing(checks: tuple[Check, ...]) -> str:
    """`--list`: each check and what must happen."""
    width = max(len(f"{c.group}/{c.id}") for c in checks)
    return "\n".join(f"{c.group + '/' + c.id:<{width}}  {c.must}" for c in checks)


def as_json(run: Run, outcomes: list[CheckVerdict]) -> dict[str, Any]:
    return {
        "version": SCHEMA_VERSION,
        "backend": run.backend,
        "policy": run.policy,
        "profile": run.profile,
        "isolation": run.isolation,
        "seconds": round(run.seconds, 1),
        "exit_code": exit_code(outcomes),
        "summary": summary(outcomes),
        "checks": [
            {
                "group": o.check.group, "id": o.check.id, "must": o.check.must, "result": o.result,
                "evidence": o.evidence, "probe": o.probe,
            }
            for o in outcomes
        ],
    }  # fmt: skip


def write_json(path: str, run: Run, outcomes: list[CheckVerdict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(as_json(run, outcomes), f, indent=2)
        f.write("\n")


def as_junit(run: Run, outcomes: list[CheckVerdict]) -> str:
    """JUnit XML: one suite per group, one case per check; failed is a failure, error an error, n/a skipped."""
    counts = summary(outcomes)
    root = ET.Element(
        "testsuites", name="airlock verify", tests=str(len(outcomes)), failures=str(counts["failed"]),
        errors=str(counts["error"]), skipped=str(counts["n/a"]), time=f"{run.seconds:.1f}",
    )  # fmt: skip
    for group in dict.fromkeys(o.check.group for o in outcomes):
        members = [o for o in outcomes if o.check.group == group]
        inner = summary(members)
        suite = ET.SubElement(
            root, "testsuite", name=f"airlock verify {group}", tests=str(len(members)),
            failures=str(inner["failed"]), errors=str(inner["error"]), skipped=str(inner["n/a"]),
        )  # fmt: skip
        for o in members:
            case = ET.SubElement(suite, "testcase", classname=f"airlock.verify.{group}", name=o.check.id)
            text = f"{o.check.must}\nevidence: {o.evidence}" + (f"\nprobe: {o.probe}" if o.probe else "")
            if o.result == "failed":
                ET.SubElement(case, "failure", message=o.evidence).text = text
            elif o.result == "error":
                ET.SubElement(case, "error", message=o.evidence).text = text
            elif o.result == "n/a":
                ET.SubElement(case, "skipped", message=o.evidence)
            else:
                ET.SubElement(case, "system-out").text = text
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(path: str, run: Run, outcomes: list[CheckVerdict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(as_junit(run, outcomes))
