"""How fast the scrubber masks the injected secrets out of a response body: MB/s over a 10 MB body, whole
(`Scrubber.scrub`) and streamed in 64 KiB chunks (`Scrubber.stream`, mitmproxy's `flow.response.stream`), for 1, 4
and 16 secrets; beside it, the single alternation of every form in one regular expression, which the scrubber does
not use (its reason: see airlock/inspection/scrub.py).

    .venv/bin/python bench/scrub.py [--mb 10] [--rounds 5] [--output F]

In-process, no network, no root. The body is JSON text with base64 blobs, holding none of the secrets (the common
case: every byte is looked at, nothing is masked); a last row holds a secret every 64 KiB. Best of `rounds`.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

from airlock.inspection.scrub import Scrubber

CHUNK = 64 * 1024


def _body(size: int, rng: random.Random) -> bytes:
    record = json.dumps({"id": "msg_01XFDUDYJgAACzvnptvVoYEL", "role": "assistant", "text": "Hello! " * 20,
                         "data": base64.b64encode(rng.randbytes(300)).decode()}).encode() + b"\n"  # fmt: skip
    return (record * (size // len(record) + 1))[:size]


def _secrets(count: int, rng: random.Random) -> list[str]:
    return [f"sk-live-{base64.urlsafe_b64encode(rng.randbytes(24)).decode()}/{n}+x" for n in range(count)]


def _best(rounds: int, work: Callable[[], object]) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def _streamed(scrubber: Scrubber, body: bytes) -> bytes:
    stream = scrubber.stream()
    return b"".join([*(stream(body[i : i + CHUNK]) for i in range(0, len(body), CHUNK)), stream(b"")])


def _alternation(scrubber: Scrubber) -> re.Pattern[bytes]:
    """Every form's pattern in one alternation (longest first), what one regular expression over all would be."""
    patterns = sorted((form.pattern.pattern for form in scrubber._forms), key=len, reverse=True)
    return re.compile(b"|".join(patterns))


def measure(mb: int, rounds: int) -> list[tuple[str, float, float, float]]:
    rng = random.Random(14)
    body = _body(mb * 10**6, rng)
    rows = []
    for count in (1, 4, 16):
        scrubber = Scrubber(_secrets(count, rng))
        assert scrubber.scrub(body) is body and _streamed(scrubber, body) == body
        alternation = _alternation(scrubber)
        whole = _best(rounds, lambda s=scrubber: s.scrub(body))
        streamed = _best(rounds, lambda s=scrubber: _streamed(s, body))
        single = _best(rounds, lambda a=alternation: sum(1 for _ in a.finditer(body)))
        rows.append((f"{count} secret{'s' * (count > 1)}, none in the body", whole, streamed, single))
    secrets = _secrets(4, rng)
    scrubber = Scrubber(secrets)
    holding = b"".join(body[i : i + CHUNK - 60] + secrets[0].encode() for i in range(0, len(body), CHUNK))[: len(body)]
    whole = _best(rounds, lambda: scrubber.scrub(holding))
    streamed = _best(rounds, lambda: _streamed(scrubber, holding))
    rows.append(("4 secrets, one every 64 KiB", whole, streamed, float("nan")))
    return [(name, mb / w, mb / s, mb / a) for name, w, s, a in rows]


def report(mb: int, rounds: int) -> str:
    lines = [
        f"## Scrubbing a {mb} MB body (MB/s, best of {rounds})",
        "",
        "| secrets | scrub (whole body) | stream (64 KiB chunks) | one alternation of all forms |",
        "|---|---|---|---|",
    ]
    for name, whole, streamed, single in measure(mb, rounds):
        alternation = "—" if single != single else f"{single:,.0f}"  # NaN: not measured
        lines.append(f"| {name} | {whole:,.0f} | {streamed:,.0f} | {alternation} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    text = report(args.mb, args.rounds)
    print(text, end="")
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
