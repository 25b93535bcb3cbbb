"""The gateway's errors: GatewayError, for a gateway that cannot start (or do what it was asked), and ApprovalError,
for an answer to a held request that cannot be given. Apart from `airlock.gateway.core`, so that the settings, the
capacity maths and the approvals raise them without importing the gateway's machinery."""

from airlock.errors import AirlockError


class GatewayError(AirlockError):
    pass


class ApprovalError(AirlockError):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
