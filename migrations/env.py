"""Alembic environment: runs online against the engine handed over by controlplane.store.migrate."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Engine

from controlplane.store.db import make_engine
from controlplane.store.models import Base

config = context.config
target_metadata = Base.metadata


def run() -> None:
    engine: Engine | None = config.attributes.get("engine")
    if engine is None:
        engine = make_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.begin() as conn:
        context.configure(
            connection=conn,
            target_metadata=target_metadata,
            render_as_batch=conn.dialect.name == "sqlite",  # SQLite cannot ALTER most things
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()


run()
