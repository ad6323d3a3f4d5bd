"""SQLAlchemy 2 typed models. The schema changes only through `migrations/`.

Times are epoch seconds (float) everywhere so that virtual and wall clocks store alike.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, MetaData, String, Text, false, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from controlplane.actions import ACTIVE_STATES

__all__ = [
    "ActionEventRow",
    "ActionRow",
    "AdviceRow",
    "Base",
    "FindingRow",
    "MetaRow",
    "SignalRollupRow",
    "SignalRow",
    "TargetRow",
    "VerdictRow",
]

ACTIVE_WHERE = "state IN ({})".format(", ".join(f"'{s}'" for s in sorted(ACTIVE_STATES)))

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


# Keys that the store walks in order (`ReadStore.subjects`, `names`) compare byte by byte on
# PostgreSQL whatever the database's collation: glibc's en_US ignores punctuation and would sort
# `engine/p10/...` between two keys of `engine/p1/`, cutting a pool's subject list short.
# SQLite already compares bytes (its BINARY collation) and has no collation named "C".
def _key(length: int) -> String:
    return String(length).with_variant(String(length, collation="C"), "postgresql")


# An id retention removed is never given again: alerts, notices and links name findings, actions and verdicts by it.
# PostgreSQL's sequences never go back; SQLite reuses the largest rowid once its row is gone, unless AUTOINCREMENT.
NEVER_REUSED = {"sqlite_autoincrement": True}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON}  # noqa: RUF012 (read by SQLAlchemy at class creation)


class TargetRow(Base):
    """A scrape target and its latest health."""

    __tablename__ = "targets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(255), unique=True)
    url: Mapped[str] = mapped_column(String(1024))
    pool: Mapped[str] = mapped_column(String(128))
    pod: Mapped[str] = mapped_column(String(255))
    role: Mapped[str] = mapped_column(String(16))
    source: Mapped[str] = mapped_column(String(32))
    up: Mapped[bool] = mapped_column(default=False)
    last_scrape_at: Mapped[float | None] = mapped_column(Float)
    last_error: Mapped[str | None] = mapped_column(Text)
    consecutive_failures: Mapped[int] = mapped_column(Integer, default=0)
    missing_families: Mapped[dict[str, Any]] = mapped_column(default=dict)


class SignalRow(Base):
    """Raw signals, narrow. The key order serves 'one series over time' and 'all engines of a pool'."""

    __tablename__ = "signals"

    name: Mapped[str] = mapped_column(_key(64), primary_key=True)
    subject: Mapped[str] = mapped_column(_key(255), primary_key=True)
    ts: Mapped[float] = mapped_column(Float, primary_key=True)
    value: Mapped[float] = mapped_column(Float)

    __table_args__ = (Index(None, "ts"),)  # retention deletes and window priming scan by time


class SignalRollupRow(Base):
    """1-minute (resolution 60) and 1-hour (3600) aggregates of raw signals."""

    __tablename__ = "signal_rollups"

    resolution: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(_key(64), primary_key=True)
    subject: Mapped[str] = mapped_column(_key(255), primary_key=True)
    bucket: Mapped[float] = mapped_column(Float, primary_key=True)
    count: Mapped[int] = mapped_column(Integer)
    sum: Mapped[float] = mapped_column(Float)
    min: Mapped[float] = mapped_column(Float)
    max: Mapped[float] = mapped_column(Float)

    __table_args__ = (Index(None, "resolution", "bucket"),)


class FindingRow(Base):
    """What a policy concluded; its lifetime (open to resolved) is an incident."""

    __tablename__ = "findings"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(64))
    subject: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16))  # open | resolved
    severity: Mapped[str] = mapped_column(String(16))
    summary: Mapped[str] = mapped_column(Text)
    cause: Mapped[str] = mapped_column(Text)
    evidence: Mapped[dict[str, Any]] = mapped_column(default=dict)
    runbook: Mapped[str] = mapped_column(String(64))
    opened_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    resolved_at: Mapped[float | None] = mapped_column(Float)
    resolve_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        # At most one open finding per kind and subject, enforced by the database.
        Index(
            "uq_findings_open_kind_subject",
            "kind",
            "subject",
            unique=True,
            sqlite_where=text("state = 'open'"),
            postgresql_where=text("state = 'open'"),
        ),
        Index(None, "opened_at"),
        NEVER_REUSED,
    )


class ActionRow(Base):
    """An action's current state; its history is in action_events."""

    __tablename__ = "actions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    finding_id: Mapped[int | None] = mapped_column(ForeignKey("findings.id"))
    kind: Mapped[str] = mapped_column(String(32))
    pool: Mapped[str] = mapped_column(String(128))
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    mode: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))  # an ActionState; moves only along controlplane.actions.TRANSITIONS
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    approved_at: Mapped[float | None] = mapped_column(Float)
    approved_by: Mapped[str | None] = mapped_column(String(255))
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    # recovered | not_recovered (a remedy); held | breached (a scale for the load); unmeasured
    outcome: Mapped[str | None] = mapped_column(String(32))
    outcome_at: Mapped[float | None] = mapped_column(Float)
    actuator: Mapped[str | None] = mapped_column(String(32))  # which actuator carried it out
    dry_run: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    __table_args__ = (
        Index(None, "pool", "created_at"),
        Index(None, "created_at"),  # every tick's recent actions, of all pools
        Index(None, "state"),
        # At most one active action per pool and kind, enforced by the database.
        Index(
            "uq_actions_active_pool_kind",
            "pool",
            "kind",
            unique=True,
            sqlite_where=text(ACTIVE_WHERE),
            postgresql_where=text(ACTIVE_WHERE),
        ),
        NEVER_REUSED,
    )


class ActionEventRow(Base):
    """The append-only audit log: every transition of every action."""

    __tablename__ = "action_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    action_id: Mapped[int] = mapped_column(ForeignKey("actions.id"))
    ts: Mapped[float] = mapped_column(Float)
    event: Mapped[str] = mapped_column(String(32))
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)

    __table_args__ = (Index(None, "action_id", "ts"), NEVER_REUSED)


class VerdictRow(Base):
    """A canary gate's result with its per-metric statistics."""

    __tablename__ = "verdicts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    gate: Mapped[str] = mapped_column(String(128))
    pool: Mapped[str] = mapped_column(String(128))
    baseline: Mapped[str] = mapped_column(String(255))
    canary: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float] = mapped_column(Float)
    result: Mapped[str] = mapped_column(String(16))  # pass | fail | inconclusive
    score: Mapped[float | None] = mapped_column(Float)
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)

    # One row per gate run: a verdict written again after a commit whose answer was lost is the same row.
    __table_args__ = (Index(None, "pool", "finished_at"),
                      Index("uq_verdicts_run", "gate", "pool", "baseline", "canary", "started_at", "finished_at",
                            unique=True),
                      NEVER_REUSED)


class AdviceRow(Base):
    """A recommendation of the advisor, its predicted effect and, once applied, the measured one."""

    __tablename__ = "advice"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    pool: Mapped[str] = mapped_column(String(255))
    act: Mapped[bool] = mapped_column(Boolean)
    advice: Mapped[str] = mapped_column(Text)
    change: Mapped[dict[str, Any]] = mapped_column(default=dict)
    metric: Mapped[str] = mapped_column(String(64))
    before: Mapped[float] = mapped_column(Float)
    predicted: Mapped[float] = mapped_column(Float)
    saving_per_day: Mapped[float | None] = mapped_column(Float)
    confidence: Mapped[float] = mapped_column(Float)
    evidence: Mapped[dict[str, Any]] = mapped_column(default=dict)
    state: Mapped[str] = mapped_column(String(16))  # open | superseded | followed | applied
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    applied_at: Mapped[float | None] = mapped_column(Float)
    measured: Mapped[float | None] = mapped_column(Float)
    error: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (
        Index(None, "kind", "pool", "state"),
        # At most one open piece of advice per kind and pool, enforced by the database (two advisor runs at once).
        Index("uq_advice_open_kind_pool", "kind", "pool", unique=True, sqlite_where=text("state = 'open'"),
              postgresql_where=text("state = 'open'")),
        NEVER_REUSED,
    )


class MetaRow(Base):
    """Small key/value bookkeeping (rollup watermarks)."""

    __tablename__ = "store_meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
