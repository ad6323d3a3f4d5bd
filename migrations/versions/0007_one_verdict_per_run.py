"""One verdict per gate run, enforced by the database.

A verdict written again after a commit whose answer was lost (the connection dropped as it committed, which
the store reports as unavailable, so the loop and the gate keep the verdict and write it once more) was kept
twice. Rows doubled that way before are removed here, the first kept.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

_RUN = ['gate', 'pool', 'baseline', 'canary', 'started_at', 'finished_at']


def upgrade() -> None:
    op.execute("DELETE FROM verdicts WHERE id NOT IN (SELECT keep FROM (SELECT MIN(id) AS keep FROM verdicts "
               f"GROUP BY {', '.join(_RUN)}) AS first)")
    op.create_index('uq_verdicts_run', 'verdicts', _RUN, unique=True)


def downgrade() -> None:
    op.drop_index('uq_verdicts_run', table_name='verdicts')
