"""Engines for the supported stores: SQLite (WAL) by default, PostgreSQL in production."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from controlplane.errors import StoreUnavailable

__all__ = ["make_engine", "normalize_url", "redact"]


def normalize_url(url: str) -> str:
    """Pick the installed PostgreSQL driver (psycopg 3) when the URL names none."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def redact(url: str) -> str:
    """The URL with any password hidden, for logs and error messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable store URL>"


def make_engine(url: str, *, check: bool = True) -> Engine:
    """An engine for `url`; with `check`, a connection is tried so failures surface early."""
    url = normalize_url(url)
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StoreUnavailable(f"store URL {url!r} is not a database URL (e.g. sqlite:///fleet.db)") from None
    kwargs: dict[str, Any] = {}
    if parsed.get_backend_name() == "sqlite":
        kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
        if parsed.database in (None, "", ":memory:"):
            kwargs["poolclass"] = StaticPool  # one shared in-memory database
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
            raise StoreUnavailable(f"store {redact(url)} is unreachable: {str(exc.orig or exc).strip()[:300]}") from None
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
