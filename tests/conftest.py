"""Shared fixtures: stores on SQLite and on a real PostgreSQL, fresh per test.

PostgreSQL comes from FLEET_TEST_PG_URL, else the server on 127.0.0.1:5432 (database `test`);
`scripts/ensure-postgres.sh`, run by `make test`, makes sure one is up. A missing server fails
the PostgreSQL tests instead of skipping them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from controlplane.data import DATA_DIR
from controlplane.store import migrate
from controlplane.store.db import normalize_url
from controlplane.store.writer import SqlStore

PG_ADMIN_URL = normalize_url(os.environ.get("FLEET_TEST_PG_URL", "postgresql://127.0.0.1:5432/test"))
# Metric fixtures the project ships beside its traces (see controlplane/data/NOTICE.md).
FIXTURES = DATA_DIR / "fixtures"


@pytest.fixture(scope="session")
def pg_admin() -> Iterator[str]:
    """Admin URL of a reachable PostgreSQL; fails loudly when there is none."""
    engine = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        pytest.fail(f"PostgreSQL at {PG_ADMIN_URL} is not reachable ({exc}); run scripts/ensure-postgres.sh")
    finally:
        engine.dispose()
    yield PG_ADMIN_URL


def _fresh_pg_database(admin_url: str, options: str = "") -> tuple[str, str]:
    name = f"fleet_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" {options}'))
    admin.dispose()
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False), name


def _drop_pg_database(admin_url: str, name: str) -> None:
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def pg_url(pg_admin: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database, dropped after the test."""
    url, name = _fresh_pg_database(pg_admin)
    yield url
    _drop_pg_database(pg_admin, name)


@pytest.fixture
def pg_url_blind_to_punctuation(pg_admin: str) -> Iterator[str]:
    """A fresh PostgreSQL database whose default collation ignores punctuation, as glibc's en_US does."""
    url, name = _fresh_pg_database(pg_admin, "TEMPLATE template0 LOCALE 'C.UTF-8' LOCALE_PROVIDER icu "
                                             "ICU_LOCALE 'en-US-u-ka-shifted'")
    yield url
    _drop_pg_database(pg_admin, name)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite file."""
    return f"sqlite:///{tmp_path / 'fleet.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database on each supported backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fleet.db'}"
    else:
        admin = request.getfixturevalue("pg_admin")
        url, name = _fresh_pg_database(admin)
        yield url
        _drop_pg_database(admin, name)


@pytest.fixture
def store(db_url: str) -> Iterator[SqlStore]:
    """A migrated store on each backend."""
    migrate.upgrade(db_url)
    s = SqlStore.open(db_url)
    yield s
    s.close()


@pytest.fixture
def sqlite_store(sqlite_url: str) -> Iterator[SqlStore]:
    """A migrated SQLite store, for tests about the loop rather than the backend."""
    migrate.upgrade(sqlite_url)
    s = SqlStore.open(sqlite_url)
    yield s
    s.close()
