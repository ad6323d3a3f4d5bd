"""Alembic environment: runs online against the engine handed over by controlplane.store.migrate."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Engine

from controlplane.store.db import make_engine
from controlplane.store.models import Base

config = context.config
target_metadata = Base.metadata
_LOCK = 0x666C656574  # this schema's migrations, as a PostgreSQL advisory lock key ("fleet")


def run() -> None:
    engine: Engine | None = config.attributes.get("engine")
    if engine is None:
        engine = make_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:
            # SQLite alters a table by copying it and dropping the old one, which a row of another table that refers
            # to it forbids while foreign keys are enforced; the pragma takes effect only outside a transaction.
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            conn.commit()
        try:
            context.configure(
                connection=conn,
                target_metadata=target_metadata,
                render_as_batch=sqlite,  # SQLite cannot ALTER most things
                compare_type=True,
            )
            if sqlite:
                # Python's sqlite3 opens a transaction only at the first row written: a table rebuilt by a batch
                # migration was created on its own, and left behind by a migration killed or locked out after it,
                # every later upgrade failing on it. One transaction from here, DDL included, the write lock first.
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            with context.begin_transaction():
                if conn.dialect.name == "postgresql":
                    # Replicas that start together each run `fleetctl db upgrade`: one migrates, the others wait for it
                    # and then find the schema at head (without the lock, one fails on tables the other just made).
                    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_LOCK})")
                context.run_migrations()
                if sqlite and (broken := conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()):
                    raise RuntimeError(f"the migration left rows that refer to none: {broken[:5]}")
            conn.commit()
        finally:
            if sqlite:  # the connection goes back to a pool its engine's other users share
                conn.rollback()
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")


run()
