"""One open piece of advice per kind and pool, enforced by the database.

The store supersedes the open row and inserts its successor; two runs of the advisor at once (on
PostgreSQL, under read committed) could both insert one, and the one left behind stayed open for
good. Rows doubled that way before are superseded here, the newest kept open.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

_OPEN = sa.text("state = 'open'")


def upgrade() -> None:
    op.execute("UPDATE advice SET state = 'superseded' WHERE state = 'open' AND id NOT IN "
               "(SELECT keep FROM (SELECT MAX(id) AS keep FROM advice WHERE state = 'open' GROUP BY kind, pool) AS newest)")
    op.create_index('uq_advice_open_kind_pool', 'advice', ['kind', 'pool'], unique=True, sqlite_where=_OPEN,
                    postgresql_where=_OPEN)


def downgrade() -> None:
    op.drop_index('uq_advice_open_kind_pool', table_name='advice', sqlite_where=_OPEN, postgresql_where=_OPEN)
