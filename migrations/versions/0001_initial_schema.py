"""Initial schema: targets, signals and rollups, findings, actions and their audit log, verdicts.

Revision ID: 0001
Revises: 
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('findings',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=64), nullable=False),
    sa.Column('subject', sa.String(length=255), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('severity', sa.String(length=16), nullable=False),
    sa.Column('summary', sa.Text(), nullable=False),
    sa.Column('cause', sa.Text(), nullable=False),
    sa.Column('evidence', sa.JSON(), nullable=False),
    sa.Column('runbook', sa.String(length=64), nullable=False),
    sa.Column('opened_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.Column('resolved_at', sa.Float(), nullable=True),
    sa.Column('resolve_reason', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_findings'))
    )
    op.create_index(op.f('ix_findings_opened_at'), 'findings', ['opened_at'], unique=False)
    op.create_index('uq_findings_open_kind_subject', 'findings', ['kind', 'subject'], unique=True, sqlite_where=sa.text("state = 'open'"), postgresql_where=sa.text("state = 'open'"))
    op.create_table('signal_rollups',
    sa.Column('resolution', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('subject', sa.String(length=255), nullable=False),
    sa.Column('bucket', sa.Float(), nullable=False),
    sa.Column('count', sa.Integer(), nullable=False),
    sa.Column('sum', sa.Float(), nullable=False),
    sa.Column('min', sa.Float(), nullable=False),
    sa.Column('max', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('resolution', 'name', 'subject', 'bucket', name=op.f('pk_signal_rollups'))
    )
    op.create_index(op.f('ix_signal_rollups_resolution_bucket'), 'signal_rollups', ['resolution', 'bucket'], unique=False)
    op.create_table('signals',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('subject', sa.String(length=255), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('value', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('name', 'subject', 'ts', name=op.f('pk_signals'))
    )
    op.create_index(op.f('ix_signals_ts'), 'signals', ['ts'], unique=False)
    op.create_table('store_meta',
    sa.Column('key', sa.String(length=64), nullable=False),
    sa.Column('value', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('key', name=op.f('pk_store_meta'))
    )
    op.create_table('targets',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('url', sa.String(length=1024), nullable=False),
    sa.Column('pool', sa.String(length=128), nullable=False),
    sa.Column('pod', sa.String(length=255), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('source', sa.String(length=32), nullable=False),
    sa.Column('up', sa.Boolean(), nullable=False),
    sa.Column('last_scrape_at', sa.Float(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('consecutive_failures', sa.Integer(), nullable=False),
    sa.Column('missing_families', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_targets')),
    sa.UniqueConstraint('key', name=op.f('uq_targets_key'))
    )
    op.create_table('verdicts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('gate', sa.String(length=128), nullable=False),
    sa.Column('pool', sa.String(length=128), nullable=False),
    sa.Column('baseline', sa.String(length=255), nullable=False),
    sa.Column('canary', sa.String(length=255), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('finished_at', sa.Float(), nullable=False),
    sa.Column('result', sa.String(length=16), nullable=False),
    sa.Column('score', sa.Float(), nullable=True),
    sa.Column('details', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_verdicts'))
    )
    op.create_index(op.f('ix_verdicts_pool_finished_at'), 'verdicts', ['pool', 'finished_at'], unique=False)
    op.create_table('actions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('finding_id', sa.Integer(), nullable=True),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('pool', sa.String(length=128), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('mode', sa.String(length=16), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('approved_at', sa.Float(), nullable=True),
    sa.Column('approved_by', sa.String(length=255), nullable=True),
    sa.Column('started_at', sa.Float(), nullable=True),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('outcome', sa.String(length=32), nullable=True),
    sa.Column('outcome_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['finding_id'], ['findings.id'], name=op.f('fk_actions_finding_id_findings')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_actions'))
    )
    op.create_index(op.f('ix_actions_pool_created_at'), 'actions', ['pool', 'created_at'], unique=False)
    op.create_index(op.f('ix_actions_state'), 'actions', ['state'], unique=False)
    op.create_table('action_events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('action_id', sa.Integer(), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('event', sa.String(length=32), nullable=False),
    sa.Column('detail', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['action_id'], ['actions.id'], name=op.f('fk_action_events_action_id_actions')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_action_events'))
    )
    op.create_index(op.f('ix_action_events_action_id_ts'), 'action_events', ['action_id', 'ts'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_action_events_action_id_ts'), table_name='action_events')
    op.drop_table('action_events')
    op.drop_index(op.f('ix_actions_state'), table_name='actions')
    op.drop_index(op.f('ix_actions_pool_created_at'), table_name='actions')
    op.drop_table('actions')
    op.drop_index(op.f('ix_verdicts_pool_finished_at'), table_name='verdicts')
    op.drop_table('verdicts')
    op.drop_table('targets')
    op.drop_table('store_meta')
    op.drop_index(op.f('ix_signals_ts'), table_name='signals')
    op.drop_table('signals')
    op.drop_index(op.f('ix_signal_rollups_resolution_bucket'), table_name='signal_rollups')
    op.drop_table('signal_rollups')
    op.drop_index('uq_findings_open_kind_subject', table_name='findings', sqlite_where=sa.text("state = 'open'"), postgresql_where=sa.text("state = 'open'"))
    op.drop_index(op.f('ix_findings_opened_at'), table_name='findings')
    op.drop_table('findings')
