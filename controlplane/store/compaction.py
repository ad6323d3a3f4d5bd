"""Rollups and retention: raw signals become 1-minute and 1-hour aggregates, old rows go.

Watermarks in `store_meta` make each rollup run idempotent: a bucket is aggregated once, when
it is complete, and the watermark moves in the same transaction as the rows it covers. Two more say
from when raw signals and minute rollups are kept, so a read of an older range takes the next
coarser level. The records
(finished actions with their audit log, resolved findings no kept action points at, verdicts, advice
no longer open or followed, the gates' claims) go once past their own retention, in a transaction of
their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, Float, cast, delete, func, insert, literal, select, update
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement

from controlplane.actions import FINISHED_STATES
from controlplane.store.models import (
    ActionEventRow,
    ActionRow,
    AdviceRow,
    FindingRow,
    MetaRow,
    SignalRollupRow,
    SignalRow,
    VerdictRow,
)

__all__ = ["CompactionReport", "Retention", "compact"]

MINUTE = 60
HOUR = 3600
# In `store_meta`: raw signals, and minute rollups, are kept from these times on (older ones may be gone).
KEPT_RAW, KEPT_MINUTES = "kept_raw", "kept_60"


class bucket_start(FunctionElement[float]):  # noqa: N801 (SQL functions are lower case)
    """floor(ts / width) * width, spelled per dialect (SQLite may lack floor())."""

    type = Float()
    inherit_cache = True


@compiles(bucket_start)
def _bucket_default(element: Any, compiler: Any, **kw: Any) -> str:
    ts, width = list(element.clauses)
    return f"(floor({compiler.process(ts, **kw)} / {compiler.process(width, **kw)}) * {compiler.process(width, **kw)})"


@compiles(bucket_start, "sqlite")
def _bucket_sqlite(element: Any, compiler: Any, **kw: Any) -> str:
    ts, width = list(element.clauses)
    # CAST truncates toward zero, which is floor for the positive epoch times stored here.
    return f"(CAST({compiler.process(ts, **kw)} / {compiler.process(width, **kw)} AS INTEGER) * {compiler.process(width, **kw)})"


@dataclass(frozen=True, slots=True)
class Retention:
    """How long each resolution is kept, in seconds, and the records (findings, actions, verdicts, advice)."""

    raw_s: float
    minute_s: float
    hour_s: float
    records_s: float = math.inf


@dataclass(frozen=True, slots=True)
class CompactionReport:
    """Rows written and deleted by one compaction run."""

    minute_rows: int
    hour_rows: int
    raw_deleted: int
    rollups_deleted: int
    records_deleted: int = 0
    done: bool = True  # False: stopped at its step budget, with more to do (`compact`'s `steps`)

    def __add__(self, other: CompactionReport) -> CompactionReport:
        return CompactionReport(self.minute_rows + other.minute_rows, self.hour_rows + other.hour_rows,
                                self.raw_deleted + other.raw_deleted, self.rollups_deleted + other.rollups_deleted,
                                self.records_deleted + other.records_deleted, other.done)


def _watermark(conn: Any, key: str) -> float:
    value = conn.execute(select(MetaRow.value).where(MetaRow.key == key)).scalar_one_or_none()
    return float(value) if value is not None else 0.0


def _set_watermark(conn: Any, key: str, value: float) -> None:
    if conn.execute(select(MetaRow.key).where(MetaRow.key == key)).first() is None:
        conn.execute(insert(MetaRow).values(key=key, value=repr(value)))
    else:
        conn.execute(update(MetaRow).where(MetaRow.key == key).values(value=repr(value)))


def compact(engine: Engine, now: float, retention: Retention, steps: int | None = None) -> CompactionReport:
    """Roll up complete minutes and hours, then drop what is past its retention; each in steps of at most `STEP_S`
    of data, a transaction each, so that catching up after a long gap (compaction failing for a day, a history
    loaded) never holds the store's writers off for the whole gap. With `steps`, at most that many transactions:
    the report says whether it is `done` (a caller on the store's one thread lets other calls in between)."""
    budget = _Budget(steps)
    minute_end = (now // MINUTE) * MINUTE - MINUTE  # one minute of grace for late points
    r = SignalRollupRow
    # One expression in the select and the grouping: PostgreSQL matches them by their text, parameters included.
    b, hb = bucket_start(SignalRow.ts, literal(MINUTE)), bucket_start(r.bucket, literal(HOUR))
    minute_rows = _roll_up(engine, budget, "rollup_60", minute_end, MINUTE, select(func.min(SignalRow.ts)),
                           lambda lo, hi: select(literal(MINUTE), SignalRow.name, SignalRow.subject, b, func.count(),
                                                 func.sum(SignalRow.value), func.min(SignalRow.value),
                                                 func.max(SignalRow.value))
                           .where(SignalRow.ts >= lo, SignalRow.ts < hi).group_by(SignalRow.name, SignalRow.subject, b))
    hour_rows = _roll_up(engine, budget, "rollup_3600", (minute_end // HOUR) * HOUR, HOUR,
                         select(func.min(r.bucket)).where(r.resolution == MINUTE),
                         lambda lo, hi: select(literal(HOUR), r.name, r.subject, hb, func.sum(r.count), func.sum(r.sum),
                                               func.min(r.min), func.max(r.max))
                         .where(r.resolution == MINUTE, r.bucket >= lo, r.bucket < hi).group_by(r.name, r.subject, hb))
    with engine.begin() as conn:
        # Nothing goes before the next coarser rollup holds it: a retention shorter than the rollup's grace (a
        # minute's, or an hour's minutes) would otherwise lose what the hour was to be made of.
        # On the next coarser level's bucket bounds: a reader takes what is older from that level (`queries._levels`),
        # and a bucket cut in two would count the part the finer level still holds twice.
        raw_until = min(now - retention.raw_s, _watermark(conn, "rollup_60")) // MINUTE * MINUTE
        minute_until = min(now - retention.minute_s, _watermark(conn, "rollup_3600")) // HOUR * HOUR
        # Moved before the rows go, so no read finds a range in neither.
        for key, until in ((KEPT_RAW, raw_until), (KEPT_MINUTES, minute_until)):
            if until > _watermark(conn, key):
                _set_watermark(conn, key, until)
    raw_deleted = _delete_before(engine, budget, SignalRow.ts, raw_until)
    rollups_deleted = (_delete_before(engine, budget, r.bucket, minute_until, r.resolution == MINUTE)
                       + _delete_before(engine, budget, r.bucket, now - retention.hour_s, r.resolution == HOUR))
    records_deleted = 0
    if math.isfinite(retention.records_s) and budget.take():
        records_deleted = _expire_records(engine, now - retention.records_s)
    return CompactionReport(minute_rows, hour_rows, raw_deleted, rollups_deleted, records_deleted, not budget.spent)


class _Budget:
    """Steps of work a compaction may still take (None: any number; looking for work is none); `spent` once one was
    refused."""

    def __init__(self, steps: int | None) -> None:
        self.left, self.spent = steps, False

    def take(self) -> bool:
        if self.left is not None and self.left <= 0:
            self.spent = True
            return False
        if self.left is not None:
            self.left -= 1
        return True


STEP_S = 6 * HOUR  # of data rolled up, or deleted, per transaction


def _roll_up(engine: Engine, budget: _Budget, key: str, end: float, width: int, oldest: Any, rows: Any) -> int:
    """Aggregate [watermark, `end`) into `width` buckets, `STEP_S` at a time, the watermark moving in each step's
    transaction; a watermark never set starts at the `oldest` row's bucket. `rows(lo, hi)` selects a step's rollups."""
    written = 0
    while True:
        with engine.begin() as conn:
            lo = _watermark(conn, key)
            if lo <= 0.0:
                first = conn.execute(oldest).scalar_one_or_none()
                lo = end if first is None else float(first) // width * width
            if lo >= end or not budget.take():
                return written
            hi = min(end, lo + STEP_S)
            written += conn.execute(insert(SignalRollupRow).from_select(_ROLLUP_COLS, rows(lo, hi)),
                                    execution_options=_COUNT).rowcount
            _set_watermark(conn, key, hi)


def _delete_before(engine: Engine, budget: _Budget, column: Any, until: float, *where: Any) -> int:
    """Delete the rows whose `column` is under `until`, `STEP_S` of them at a time, a transaction each."""
    deleted = 0
    table = column.class_
    while True:
        with engine.begin() as conn:
            first = conn.execute(select(func.min(column)).where(*where)).scalar_one_or_none()
            if first is None or float(first) >= until or not budget.take():
                return deleted
            hi = min(until, float(first) + STEP_S)
            deleted += conn.execute(delete(table).where(*where, column < hi)).rowcount or 0


# Advice still open, or followed and waiting for its effect to be measured, is kept whatever its age.
KEPT_ADVICE = ("open", "followed")
# Claims whose value is a time (the gates' starts and answers: one set per rollout, and per caller's settings).
EXPIRING_CLAIMS = "gate-"


def _expire_records(engine: Engine, until: float) -> int:
    """Delete the records that ended before `until`; the number of rows deleted."""
    finished = [str(s) for s in FINISHED_STATES]
    with engine.begin() as conn:
        old = select(ActionRow.id).where(ActionRow.state.in_(finished),
                                         func.coalesce(ActionRow.finished_at, ActionRow.created_at) < until)
        deleted = conn.execute(delete(ActionEventRow).where(ActionEventRow.action_id.in_(old))).rowcount or 0
        deleted += conn.execute(delete(ActionRow).where(ActionRow.id.in_(old))).rowcount or 0
        pointed_at = select(ActionRow.finding_id).where(ActionRow.finding_id.is_not(None))
        deleted += conn.execute(delete(FindingRow).where(FindingRow.state == "resolved", FindingRow.resolved_at < until,
                                                         FindingRow.id.not_in(pointed_at))).rowcount or 0
        deleted += conn.execute(delete(VerdictRow).where(VerdictRow.finished_at < until)).rowcount or 0
        deleted += conn.execute(delete(AdviceRow).where(AdviceRow.state.not_in(KEPT_ADVICE),
                                                        AdviceRow.updated_at < until)).rowcount or 0
        deleted += conn.execute(delete(MetaRow).where(MetaRow.key.startswith(f"claim:{EXPIRING_CLAIMS}"),
                                                      cast(MetaRow.value, Float) < until)).rowcount or 0
    return deleted


_ROLLUP_COLS = ["resolution", "name", "subject", "bucket", "count", "sum", "min", "max"]
# psycopg reports -1 rows for INSERT ... SELECT unless SQLAlchemy is asked to keep the count.
_COUNT = {"preserve_rowcount": True}
