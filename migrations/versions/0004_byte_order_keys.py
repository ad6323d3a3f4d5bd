"""Byte order for the signal keys on PostgreSQL, whatever the database's collation.

The store lists a pool's subjects (and a prefix's signal names) by walking the primary key in
order; a collation that ignores punctuation (glibc's en_US.UTF-8) sorts `engine/p10/...` between
two subjects of `engine/p1/` and the walk stops early. SQLite compares bytes already.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

_KEYS = (("signals", "name", 64), ("signals", "subject", 255),
         ("signal_rollups", "name", 64), ("signal_rollups", "subject", 255))


def _collate(collation: str | None) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column, length in _KEYS:
        # Changing a key column's collation rebuilds the indexes on it.
        op.alter_column(table, column, type_=sa.String(length, collation=collation),
                        existing_type=sa.String(length), existing_nullable=False)


def upgrade() -> None:
    _collate("C")


def downgrade() -> None:
    _collate("default")
