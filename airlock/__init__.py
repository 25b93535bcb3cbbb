"""airlock: egress gateway and credential broker for AI-agent sandboxes (wiring, CLI, sandbox backends)."""

from airlock.errors import AirlockError

__all__ = ["AirlockError"]
