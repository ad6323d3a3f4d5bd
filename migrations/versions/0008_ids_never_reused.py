"""Ids never given twice on SQLite.

SQLite gives a new row the largest rowid plus one, so once retention removed the newest finding, action,
audit event, verdict or piece of advice, the next one took its id, and an alert, a notice or a link that
named the old one came to name the new one. AUTOINCREMENT keeps the largest id ever given; SQLite sets it
only when a table is made, so these tables are made again (PostgreSQL's sequences never went back).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-08
"""

from __future__ import annotations

from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

# Referenced tables first: a table made again keeps its rows, and what refers to them still finds them.
_TABLES = ('findings', 'actions', 'action_events', 'verdicts', 'advice')


def _remake(autoincrement: bool) -> None:
    if op.get_bind().dialect.name != 'sqlite':
        return
    for table in _TABLES:
        with op.batch_alter_table(table, recreate='always', table_kwargs={'sqlite_autoincrement': autoincrement}):
            pass


def upgrade() -> None:
    _remake(True)


def downgrade() -> None:
    _remake(False)
