"""The one error a gateway that cannot start (or do what it was asked) raises; apart from `airlock.gateway.core`, so
that the settings and the capacity maths raise it without importing the gateway's machinery."""

from airlock.errors import AirlockError


class GatewayError(AirlockError):
    pass
