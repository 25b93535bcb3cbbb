"""Sandbox backends and the kernel fence that makes the gateway their only route."""
