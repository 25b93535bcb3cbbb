"""What every broker surface answers with: a result, or a `BrokerError` carrying a stable code and an honest
status (the REST API sends both as they are; MCP sends the same code in a tool error)."""

from __future__ import annotations

from typing import Any

type Result = tuple[int, dict[str, Any], dict[str, str]]  # status, body, headers


class BrokerError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}
        self.details = details or {}  # further fields of the error body, e.g. the path of a bad input

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.details}
