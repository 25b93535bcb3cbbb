"""The broker tests' fixtures: `make` (a broker before a fake GitHub, both on 127.0.0.1) and the App key,
credentials and store (`broker_database`) it uses, from broker_env.py (the command line's tools-log tests import
them from there too)."""

from broker_env import app_key, broker_database, credentials, make

__all__ = ["app_key", "broker_database", "credentials", "make"]  # fixtures, used by name
