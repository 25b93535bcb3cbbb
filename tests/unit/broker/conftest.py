"""The broker tests' fixtures: `make` (a broker before a fake GitHub, both on 127.0.0.1) and the App key and
credentials it uses, from broker_env.py (the command line's tools-log tests import them from there too); and the
store it keeps its state in, `broker_database`: every test of this folder that makes a broker runs on both stores,
a SQLite file of its own and a fresh database of the test run's PostgreSQL server."""

import pytest

from broker_env import app_key, credentials, make

__all__ = ["app_key", "credentials", "make"]  # fixtures, used by name


@pytest.fixture(params=[None, pytest.param("postgresql", marks=pytest.mark.postgres)], ids=["sqlite", "postgresql"])
def broker_database(request: pytest.FixtureRequest) -> str | None:
    return None if request.param is None else str(request.getfixturevalue("postgres_database"))
