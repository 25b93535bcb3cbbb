"""The error every sandbox primitive's refusal or failure is (the cgroup's among them), apart from the modules
that raise it."""

from airlock.errors import AirlockError


class SandboxError(AirlockError, RuntimeError):
    pass
