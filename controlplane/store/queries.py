"""Read-only queries for the dashboard and the CLI; nothing here writes.

Series come from raw signals for short ranges and from rollups for long ones, so a page's
query cost stays bounded however long the store has been running.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, func, select

from controlplane.errors import StoreUnavailable
from controlplane.store import migrate
from controlplane.store.db import make_engine, redact
from controlplane.store.models import ActionEventRow, ActionRow, FindingRow, SignalRollupRow, SignalRow, TargetRow

__all__ = ["ReadStore", "SeriesPoint"]

# Up to this range raw points are read; beyond it 1-minute rollups, beyond a day hourly ones.
RAW_MAX_S = 6 * 3600.0
MINUTE_MAX_S = 7 * 86400.0


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """One point of a series: time, subject and value (the mean for rollups)."""

    ts: float
    subject: str
    value: float


class ReadStore:
    """Query methods over an engine; returns plain dicts and dataclasses."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def open(cls, url: str) -> ReadStore:
        """Connect to the store at `url`; StoreUnavailable when unreachable or not migrated."""
        engine = make_engine(url)
        at = migrate.current(engine)
        if at != migrate.head():
            engine.dispose()
            raise StoreUnavailable(
                f"store {redact(url)} is at schema revision {at or 'none'}, not {migrate.head()}: "
                "run `fleetctl db upgrade --db URL`"
            )
        return cls(engine)

    def latest_ts(self) -> float | None:
        """Time of the newest raw signal, or None for an empty store."""
        with self.engine.connect() as conn:
            return conn.execute(select(func.max(SignalRow.ts))).scalar_one_or_none()

    def series(self, name: str, subject_prefix: str, start: float, end: float) -> list[SeriesPoint]:
        """Values of signal `name` for subjects under `subject_prefix` in [start, end]."""
        span = end - start
        with self.engine.connect() as conn:
            if span <= RAW_MAX_S:
                q = (select(SignalRow.ts, SignalRow.subject, SignalRow.value)
                     .where(SignalRow.name == name, SignalRow.subject.startswith(subject_prefix, autoescape=True),
                            SignalRow.ts >= start, SignalRow.ts <= end)
                     .order_by(SignalRow.ts))
                return [SeriesPoint(r.ts, r.subject, r.value) for r in conn.execute(q)]
            r = SignalRollupRow
            resolution = 60 if span <= MINUTE_MAX_S else 3600
            q = (select(r.bucket, r.subject, (r.sum / r.count).label("mean"))
                 .where(r.resolution == resolution, r.name == name,
                        r.subject.startswith(subject_prefix, autoescape=True), r.bucket >= start, r.bucket <= end)
                 .order_by(r.bucket))
            return [SeriesPoint(row.bucket, row.subject, row.mean) for row in conn.execute(q)]

    def targets(self) -> list[dict[str, Any]]:
        """Every known target with its health."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(TargetRow).order_by(TargetRow.pool, TargetRow.pod)).mappings().all()
        return [dict(r) for r in rows]

    def findings(self, include_resolved: bool = False, limit: int = 500) -> list[dict[str, Any]]:
        """Findings, newest first."""
        q = select(FindingRow).order_by(FindingRow.id.desc()).limit(limit)
        if not include_resolved:
            q = q.where(FindingRow.state == "open")
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]

    def actions(self, limit: int = 500) -> list[dict[str, Any]]:
        """The audit log's actions, newest first."""
        q = select(ActionRow).order_by(ActionRow.id.desc()).limit(limit)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]

    def action_events(self, action_id: int) -> list[dict[str, Any]]:
        """Every audit event of one action, in order."""
        q = select(ActionEventRow).where(ActionEventRow.action_id == action_id).order_by(ActionEventRow.id)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]
