"""A storage URL with a password that works without a database server: SQLite behind a login.

Importing this module registers the SQLAlchemy dialect ``sqlite+password``:
``sqlite+password://USER:PASSWORD@localhost/FILE.db`` opens ``FILE.db`` (relative to the working
directory) when the user and password are :data:`USER` and :data:`PASSWORD`, and refuses the
connection as a server does otherwise. A search given such a URL handles it as it would a
PostgreSQL one; the tests grep its output for the password.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects import registry
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import URL

USER = "dapple"
PASSWORD = "hunter2-Kq7vX"
ENV = "DAPPLE_TEST_DB_PASSWORD"
"""The environment variable the tests pass the password in, for configs that refer to it."""


def url(path: str, password: str = PASSWORD, user: str = USER) -> str:
    return f"sqlite+password://{user}:{password}@localhost/{path}"


class PasswordSQLite(SQLiteDialect_pysqlite):
    """pysqlite, with a login checked when a connection opens."""

    supports_statement_cache = True

    def create_connect_args(self, url: URL) -> Any:
        self._login = (url.username, url.password)
        return super().create_connect_args(URL.create(url.drivername, database=url.database, query=url.query))

    def connect(self, *cargs: Any, **cparams: Any) -> Any:
        if self._login != (USER, PASSWORD):
            raise self.loaded_dbapi.OperationalError(f'password authentication failed for user "{self._login[0]}"')
        return super().connect(*cargs, **cparams)


registry.register("sqlite.password", __name__, "PasswordSQLite")
