"""Actions by creation time, whatever their pool.

Every tick reads the actions of the last hours across all pools (the rails' history, an outcome's later changes);
the index led by pool did not serve that read, which scanned the whole table, one that no retention shrinks.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(op.f('ix_actions_created_at'), 'actions', ['created_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_actions_created_at'), table_name='actions')
