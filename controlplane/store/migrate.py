"""Alembic driven from code: `fleetctl db upgrade|downgrade|current` and the schema check."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

import migrations
from controlplane.store.db import make_engine, normalize_url

__all__ = ["current", "downgrade", "head", "upgrade"]


def _config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    cfg.attributes["engine"] = engine
    return cfg


def head() -> str:
    """The newest revision shipped with this version."""
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    rev = ScriptDirectory.from_config(cfg).get_current_head()
    assert rev is not None
    return rev


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> None:
    """Apply migrations up to `revision`."""
    with _engine(url_or_engine) as engine:
        command.upgrade(_config(engine), revision)


def downgrade(url_or_engine: str | Engine, revision: str) -> None:
    """Revert migrations down to `revision` ('base' removes every table)."""
    with _engine(url_or_engine) as engine:
        command.downgrade(_config(engine), revision)


def current(url_or_engine: str | Engine) -> str | None:
    """The revision the database is at, or None when it was never migrated."""
    with _engine(url_or_engine) as engine, engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


@contextmanager
def _engine(url_or_engine: str | Engine) -> Iterator[Engine]:
    """The given engine, or one made from a URL and disposed afterwards."""
    if isinstance(url_or_engine, Engine):
        yield url_or_engine
        return
    engine = make_engine(normalize_url(url_or_engine))
    try:
        yield engine
    finally:
        engine.dispose()
