"""TLS inspection's building blocks: the gateway's name-constrained CA (`ca`), the secrets it injects (`secrets`),
the scrubbing of those secrets out of what the sandbox receives (`scrub`), and the trust bundle the sandbox gets
(`trust`). Library code only, no proxy hooks.

This module imports nothing: `airlock.inspection.secrets` (which the broker reads its `--secret`s with) must not
pull in `cryptography` or mitmproxy."""

from airlock.errors import AirlockError


class InspectionError(AirlockError, ValueError):
    """A CA, secret, placeholder or trust bundle airlock refuses to make or read."""
