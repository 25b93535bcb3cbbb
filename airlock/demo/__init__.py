"""`airlock demo`: every walk-through of the docs on a laptop, in a fake world of its own (airlock.demo.world)."""
