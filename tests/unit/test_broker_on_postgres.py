"""The broker service suite (test_broker_service.py) again, its brokers keeping their state in PostgreSQL (a fresh
database of the test run's server each) — but for the tests of what only a SQLite file does (a lock held by
another connection, its store threads)."""

from __future__ import annotations

import pytest

import test_broker_service
from test_broker_service import *  # noqa: F403  # every test of the suite, collected here too

pytestmark = [pytest.mark.postgres, pytest.mark.tmpfs]

SQLITE_ONLY = (
    "test_a_locked_store_never_stalls_the_event_loop",
    "test_a_store_locked_longer_than_its_timeout_is_503",
    "test_store_calls_never_run_on_the_event_loop_thread",
)
for _name in SQLITE_ONLY:
    assert hasattr(test_broker_service, _name), _name
    del globals()[_name]


@pytest.fixture
def broker_database(postgres_database: str) -> str:
    return postgres_database
