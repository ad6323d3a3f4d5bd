"""Engines for the supported stores: SQLite (WAL) by default, PostgreSQL in production."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from controlplane.errors import StoreUnavailable

__all__ = ["make_engine", "normalize_url", "redact", "scratch_database"]


def normalize_url(url: str) -> str:
    """Pick the installed PostgreSQL driver (psycopg 3) when the URL names none."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def redact(url: str) -> str:
    """The URL with any password hidden, for logs and error messages: its own, and one given as a query parameter
    (libpq takes `?password=`, and `sslpassword=` for a client key)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is no number
        return "<unparseable store URL>"
    secret = {k: "***" for k in parsed.query if "password" in k.lower()}
    return parsed.update_query_dict(secret).render_as_string(hide_password=True).replace("%2A%2A%2A", "***")


def make_engine(url: str, *, check: bool = True, existing: bool = False) -> Engine:
    """An engine for `url`; with `check`, a connection is tried so failures surface early; with `existing`, a SQLite
    file that is not there is refused, not made (a mistyped path would leave an empty database behind)."""
    url = normalize_url(url)
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        # Not the URL itself: one that cannot be parsed cannot have its password hidden either.
        why = "its port is not a number" if isinstance(exc, ValueError) else "it is not a database URL"
        raise StoreUnavailable(f"the store URL cannot be read: {why} (e.g. sqlite:///fleet.db or "
                               "postgresql+psycopg://user@host/db)") from None
    kwargs: dict[str, Any] = {}
    if parsed.get_backend_name() == "sqlite":
        kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
        if parsed.database in (None, "", ":memory:"):
            kwargs["poolclass"] = StaticPool  # one shared in-memory database
        elif existing and not parsed.database.startswith("file:") and not Path(parsed.database).exists():
            raise StoreUnavailable(f"store {redact(url)}: no such file; `fleetctl db upgrade --db URL` creates it")
    elif parsed.get_backend_name() == "postgresql":
        kwargs["pool_pre_ping"] = True
        kwargs["connect_args"] = {"connect_timeout": 10}
    try:
        engine = create_engine(url, **kwargs)
    except (ArgumentError, ImportError) as exc:
        raise StoreUnavailable(f"store {redact(url)}: {exc}") from None
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    if check:
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except SQLAlchemyError as exc:
            engine.dispose()
            reason = str(getattr(exc, "orig", None) or exc).strip()[:300]
            raise StoreUnavailable(f"store {redact(url)} is unreachable: {reason}") from None
    return engine


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # WAL lets the dashboard read while the loop writes; NORMAL sync keeps every committed
    # transaction across a process kill (only an OS crash may lose the last few).
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


@contextmanager
def scratch_database(admin_url: str, prefix: str = "fleet_scratch") -> Iterator[str]:
    """A new, empty PostgreSQL database on the server of `admin_url`, dropped afterwards; yields its URL."""
    admin = make_engine(admin_url).execution_options(isolation_level="AUTOCOMMIT")
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except SQLAlchemyError as exc:
        admin.dispose()
        raise StoreUnavailable(f"store {redact(admin_url)}: cannot create a scratch database: {exc}") from None
    try:
        yield admin.url.set(database=name).render_as_string(hide_password=False)
    finally:
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        finally:
            admin.dispose()
