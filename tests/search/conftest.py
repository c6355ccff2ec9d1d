"""Fixtures the search tests share."""

from __future__ import annotations

import postgres_server
import pytest


@pytest.fixture(scope="session")
def postgres_url():
    """A real PostgreSQL server for the session's tests (skipped, with the reason, where none can run)."""
    reason = postgres_server.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with postgres_server.server() as url:
        yield url
