"""The root of every error airlock reports to its user (the command line prints it as one line, exit 2).

A leaf module with no imports: `airlock/__init__.py` runs before any `airlock.*` package, so the policy core and
the wiring alike may import it without importing anything above them."""


class AirlockError(Exception):
    """Something airlock refuses or cannot do, said so that the user can act on it."""
