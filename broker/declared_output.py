"""What both executors share: reading an answer within the tool's max_output, and the error past it."""

from __future__ import annotations

from typing import Protocol

from .errors import BrokerError

TOO_LARGE_CODE = "output_too_large"
CHUNK = 64 * 1024


class Stream(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


class TooLarge(BrokerError):
    def __init__(self, what: str, limit: int) -> None:
        super().__init__(502, TOO_LARGE_CODE, f"{what} is larger than the tool's max_output ({limit} bytes)")


async def read_capped(stream: Stream, limit: int, what: str) -> bytes:
    """Everything `stream` sends, or TooLarge as soon as it has sent more than `limit` bytes (reading stops)."""
    data = bytearray()
    while chunk := await stream.read(min(CHUNK, limit + 1 - len(data))):
        data += chunk
        if len(data) > limit:
            raise TooLarge(what, limit)
    return bytes(data)


async def read_kept(stream: Stream, keep: int) -> bytes:
    """The first `keep` bytes `stream` sends; the rest is read and dropped (a writer must never block on a full
    pipe nobody reads)."""
    data = bytearray()
    while chunk := await stream.read(CHUNK):
        data += chunk[: keep - len(data)]
    return bytes(data)
