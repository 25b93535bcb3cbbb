"""What every broker surface answers with: a result, or a `BrokerError` carrying a stable code and an honest
status (the REST API sends both as they are; MCP sends the same code in a tool error, or, for a refusal of the
token itself, in a JSON-RPC error at the same HTTP status).

Refusals of the token carry a Bearer challenge (RFC 6750 §3): 401 with `error="invalid_token"` for a token that is
malformed, expired, revoked or for another audience, 401 with none for a request without one (§3.1), and 403 with
`error="insufficient_scope"` and the tool as `scope` for a call outside the token's grants."""

from __future__ import annotations

import math
import re
from typing import Any

type Result = tuple[int, dict[str, Any], dict[str, str]]  # status, body, headers

REALM = "airlock-broker"
# RFC 6750 §3: error_description and scope are %x20-21 / %x23-5B / %x5D-7E (no `"`, no `\`, no control characters).
_NOT_IN_CHALLENGE = re.compile(r"[^\x20\x21\x23-\x5b\x5d-\x7e]")


class BrokerError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        details: dict[str, Any] | None = None,
        quiet: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}
        self.details = details or {}  # further fields of the error body, e.g. the path of a bad input
        # A protocol's ordinary answer rather than a refusal (an MCP client finding out what the server offers):
        # audited as allowed, with its code and status, and not told as a denial.
        self.quiet = quiet

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.details}

    @property
    def challenges(self) -> bool:
        """Whether this refuses the token itself (MCP answers it at the HTTP layer, as its authorization says)."""
        return "WWW-Authenticate" in self.headers


def bearer_challenge(error: str | None = None, description: str | None = None, scope: str | None = None) -> str:
    """A `WWW-Authenticate` value for the broker's tokens (RFC 6750 §3)."""
    parts = [f'realm="{REALM}"']
    for name, value in (("error", error), ("error_description", description), ("scope", scope)):
        if value is not None:
            parts.append(f'{name}="{_NOT_IN_CHALLENGE.sub("?", value)}"')
    return "Bearer " + ", ".join(parts)


def unauthorized(code: str, message: str) -> BrokerError:
    """401 for a request without a token (`missing_token`: a challenge without an error code) or with one that is
    not acceptable (`error="invalid_token"`)."""
    challenge = bearer_challenge() if code == "missing_token" else bearer_challenge("invalid_token", message)
    return BrokerError(401, code, message, {"WWW-Authenticate": challenge})


def outside_grant(message: str, tool: str) -> BrokerError:
    """403 for a call the token's grants do not cover: the scope it would need is a grant of `tool`."""
    return BrokerError(
        403, "outside_grant", message, {"WWW-Authenticate": bearer_challenge("insufficient_scope", message, tool)}
    )


def rate_limited(what: str, per_minute: float, burst: int, wait: float) -> BrokerError:
    """429 with the limit as it is (the rate and the burst it allows) and when to try again."""
    retry = max(1, math.ceil(wait))
    message = f"{what} are limited to {per_minute:g} a minute, at most {burst} at once; retry in {retry} s"
    return BrokerError(429, "rate_limited", message, {"Retry-After": str(retry)}, {"retry_after": retry})
