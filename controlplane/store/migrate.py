"""Alembic driven from code: `fleetctl db upgrade|downgrade|current` and the schema check."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

import migrations
from controlplane.store.db import make_engine, normalize_url

__all__ = ["current", "downgrade", "head", "is_current", "upgrade"]


def _config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    cfg.attributes["engine"] = engine
    return cfg


def head() -> str:
    """The newest revision shipped with this version."""
    script = ScriptDirectory.from_config(_config(make_engine("sqlite://", check=False)))
    rev = script.get_current_head()
    assert rev is not None
    return rev


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> None:
    """Apply migrations up to `revision`."""
    engine = _engine(url_or_engine)
    command.upgrade(_config(engine), revision)


def downgrade(url_or_engine: str | Engine, revision: str) -> None:
    """Revert migrations down to `revision` ('base' removes every table)."""
    engine = _engine(url_or_engine)
    command.downgrade(_config(engine), revision)


def current(url_or_engine: str | Engine) -> str | None:
    """The revision the database is at, or None when it was never migrated."""
    engine = _engine(url_or_engine)
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def is_current(engine: Engine) -> bool:
    """True when the database is at the shipped head revision."""
    return current(engine) == head()


def _engine(url_or_engine: str | Engine) -> Engine:
    if isinstance(url_or_engine, Engine):
        return url_or_engine
    return make_engine(normalize_url(url_or_engine))
