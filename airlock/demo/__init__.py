"""`airlock demo`: every walk-through of the docs on a laptop, in a fake world of its own (airlock.demo.world)."""

from airlock.errors import AirlockError


class DemoError(AirlockError):
    """The demo's world, or a desk in it, could not be built."""
