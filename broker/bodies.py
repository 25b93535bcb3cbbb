"""Request bodies as JSON objects, within limits: the size is capped before and while a body is read, and its
nesting before it is parsed (the parser recurses, and is linear in everything else)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from .errors import BrokerError
from .shapes import JsonLimitError, loads

MAX_REQUEST_BYTES = 128 * 1024  # every body but push_branch's
MAX_REQUEST_DEPTH = 8  # the deepest request, a token's grants, nests 3 deep
THREADED_BODY = 1024 * 1024  # bodies larger than this are parsed and decoded off the event loop


async def json_object(request: web.Request, limit: int = MAX_REQUEST_BYTES) -> dict[str, Any]:
    body = await parsed(await read_body(request, limit))
    if not isinstance(body, dict):
        raise BrokerError(422, "invalid_json", "the request body must be a JSON object")
    return body


async def read_body(request: web.Request, limit: int) -> bytes:
    too_large = BrokerError(413, "too_large", f"request bodies are limited to {limit} bytes")
    if (request.content_length or 0) > limit:
        raise too_large  # refused unread
    data = bytearray()
    async for chunk in request.content.iter_chunked(64 * 1024):
        data += chunk
        if len(data) > limit:
            raise too_large
    return bytes(data)


async def parsed(data: bytes, max_depth: int = MAX_REQUEST_DEPTH) -> Any:
    """Any JSON value, nested at most `max_depth` deep; megabytes of bundle are scanned and parsed while the loop
    serves others."""
    if len(data) > THREADED_BODY:
        return await asyncio.to_thread(_parsed, data, max_depth)
    return _parsed(data, max_depth)


def _parsed(data: bytes, max_depth: int) -> Any:
    try:
        return loads(data, max_depth)
    except JsonLimitError:
        raise BrokerError(400, "too_deep", f"JSON bodies nest at most {max_depth} levels deep") from None
    except ValueError:  # UnicodeDecodeError, and too many digits in a number, are ValueErrors too
        raise BrokerError(422, "invalid_json", "the request body must be a JSON object") from None
