"""Action lifecycle: which actuator carried an action out, whether it was a dry run, and at most
one active action per pool and kind.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

# The states a store of revision 0002 treats as active (controlplane.actions.ACTIVE_STATES then).
ACTIVE = "state IN ('approved', 'proposed', 'started')"
# How far along an active action is: of a pool's and kind's duplicates, the furthest stays.
_RANK = "CASE {t}.state WHEN 'started' THEN 3 WHEN 'approved' THEN 2 ELSE 1 END"


def upgrade() -> None:
    with op.batch_alter_table('actions') as batch:
        batch.add_column(sa.Column('actuator', sa.String(length=32), nullable=True))
        batch.add_column(sa.Column('dry_run', sa.Boolean(), server_default=sa.false(), nullable=False))
    # Before the database enforces one active action per pool and kind, the others expire: of each pool's and kind's
    # the furthest along stays as it was, the newest of those. A change in progress (started) must stay started: its
    # take-over and its outcome look for it there, and a started action does not expire.
    a, b = _RANK.format(t="a"), _RANK.format(t="b")
    op.execute(sa.text(
        "UPDATE actions SET state = 'expired' WHERE " + ACTIVE + " AND id NOT IN (SELECT keep FROM (SELECT a.id AS keep "
        "FROM actions a WHERE a." + ACTIVE + " AND NOT EXISTS (SELECT 1 FROM actions b WHERE b." + ACTIVE +
        " AND b.pool = a.pool AND b.kind = a.kind AND (" + b + " > " + a + " OR (" + b + " = " + a +
        " AND b.id > a.id)))) AS kept)"
    ))
    op.create_index('uq_actions_active_pool_kind', 'actions', ['pool', 'kind'], unique=True,
                    sqlite_where=sa.text(ACTIVE), postgresql_where=sa.text(ACTIVE))


def downgrade() -> None:
    op.drop_index('uq_actions_active_pool_kind', table_name='actions',
                  sqlite_where=sa.text(ACTIVE), postgresql_where=sa.text(ACTIVE))
    # States this revision introduced have no meaning before it.
    op.execute(sa.text("UPDATE actions SET state = 'succeeded' WHERE state = 'dry_run'"))
    op.execute(sa.text("UPDATE actions SET state = 'expired' WHERE state = 'cancelled'"))
    with op.batch_alter_table('actions') as batch:
        batch.drop_column('dry_run')
        batch.drop_column('actuator')
