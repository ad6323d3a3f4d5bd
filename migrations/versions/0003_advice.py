"""Advice: the advisor's recommendations, each with its predicted effect and, once applied, the measured one.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('advice',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('pool', sa.String(length=255), nullable=False),
    sa.Column('act', sa.Boolean(), nullable=False),
    sa.Column('advice', sa.Text(), nullable=False),
    sa.Column('change', sa.JSON(), nullable=False),
    sa.Column('metric', sa.String(length=64), nullable=False),
    sa.Column('before', sa.Float(), nullable=False),
    sa.Column('predicted', sa.Float(), nullable=False),
    sa.Column('saving_per_day', sa.Float(), nullable=True),
    sa.Column('confidence', sa.Float(), nullable=False),
    sa.Column('evidence', sa.JSON(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.Column('applied_at', sa.Float(), nullable=True),
    sa.Column('measured', sa.Float(), nullable=True),
    sa.Column('error', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_advice'))
    )
    op.create_index(op.f('ix_advice_kind_pool_state'), 'advice', ['kind', 'pool', 'state'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_advice_kind_pool_state'), table_name='advice')
    op.drop_table('advice')
