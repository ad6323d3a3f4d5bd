"""The SQL store: signals, targets, findings and the audit log on SQLite or PostgreSQL.

Every method commits its own transaction, so a process killed at any point leaves each signal
batch, finding and audit entry either whole or absent. Calls run where they are made: the event
loop reaches this class through `ThreadedStore`, scripts and the CLI call it directly.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import JSON, Engine, and_, delete, func, insert, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql import ColumnElement

from collectors.types import Signal, Target, TargetHealth
from controlplane.actions import ACTIVE_STATES, SCORED_STATES, ActionState, check_transition
from controlplane.errors import ActionConflict, ActionNotFound, StoreConflict, StoreUnavailable
from controlplane.store import migrate
from controlplane.store.base import claim_key
from controlplane.store.compaction import CompactionReport, Retention, compact
from controlplane.store.db import make_engine, redact
from controlplane.store.models import (
    ActionEventRow,
    ActionRow,
    AdviceRow,
    Base,
    FindingRow,
    MetaRow,
    SignalRow,
    TargetRow,
    VerdictRow,
)
from controlplane.store.records import (
    ActionEvent,
    ActionRecord,
    AdviceRecord,
    FindingRecord,
    NewAction,
    NewAdvice,
    NewFinding,
    NewVerdict,
    Pause,
)

__all__ = ["SqlStore", "expected_states", "jsonable"]

P = ParamSpec("P")
R = TypeVar("R")

# The column a transition into each state stamps with its time.
_STAMPS = {ActionState.APPROVED: "approved_at", ActionState.STARTED: "started_at",
           **{s: "finished_at" for s in (ActionState.SUCCEEDED, ActionState.FAILED, ActionState.UNKNOWN,
                                         ActionState.DRY_RUN, ActionState.REJECTED, ActionState.EXPIRED,
                                         ActionState.CANCELLED, ActionState.ADVISORY)}}
_FIELDS = frozenset({"approved_by", "actuator", "dry_run", "error"})
_PAUSE = "paused"  # store_meta key of the kill switch


def expected_states(expected: ActionState | Collection[ActionState]) -> list[ActionState]:
    """`expected` as a list, whether one state or several were given."""
    return [expected] if isinstance(expected, ActionState) else list(expected)


def _finding(row: FindingRow) -> FindingRecord:
    return FindingRecord(
        row.id, row.kind, row.subject, row.state, row.severity, row.summary, row.cause,
        dict(row.evidence), row.runbook, row.opened_at, row.updated_at, row.resolved_at,
    )


def _action(row: ActionRow) -> ActionRecord:
    return ActionRecord(
        row.id, row.finding_id, row.kind, row.pool, dict(row.params), row.mode, ActionState(row.state),
        row.reason, row.created_at, row.started_at, row.finished_at, row.outcome, row.approved_by,
        row.actuator, bool(row.dry_run), row.error,
    )


def _advice(row: AdviceRow) -> AdviceRecord:
    return AdviceRecord(row.id, row.kind, row.pool, bool(row.act), row.advice, dict(row.change), row.metric, row.before,
                        row.predicted, row.saving_per_day, row.confidence, dict(row.evidence), row.state,
                        row.created_at, row.updated_at, row.applied_at, row.measured, row.error)


def _translated(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn SQLAlchemy's errors into the store's own, so callers need not know SQLAlchemy."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (IntegrityError, DataError) as exc:  # the row, not the store: written again, it is refused again
            raise StoreConflict(f"{fn.__name__}: {str(exc.orig or exc).strip()[:300]}") from exc
        except SQLAlchemyError as exc:
            raise StoreUnavailable(f"{fn.__name__}: {str(getattr(exc, 'orig', None) or exc).strip()[:300]}") from exc

    return wrapper


class _Translating(type):
    """Wraps every public method of the class in `_translated`."""

    def __new__(mcs, name: str, bases: tuple[type, ...], ns: dict[str, Any]) -> type:
        for attr, value in list(ns.items()):
            if callable(value) and not attr.startswith("_") and not isinstance(value, classmethod | staticmethod):
                ns[attr] = _translated(value)
        return super().__new__(mcs, name, bases, ns)


class SqlStore(metaclass=_Translating):
    """SQLAlchemy-backed store for SQLite and PostgreSQL; raises StoreUnavailable or StoreConflict."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._session = sessionmaker(engine, expire_on_commit=False)
        dialect = engine.dialect.name
        self._insert = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}.get(dialect)

    @classmethod
    def open(cls, url: str, *, require_current: bool = True) -> SqlStore:
        """Connect to `url`; refuse a database that is not at the shipped schema revision."""
        engine = make_engine(url, existing=require_current)
        if require_current:
            at = migrate.current(engine)
            if at != migrate.head():
                engine.dispose()
                raise StoreUnavailable(
                    f"store {redact(url)} is at schema revision {at or 'none'}, this version needs "
                    f"{migrate.head()}: run `fleetctl db upgrade --db URL`"
                )
        return cls(engine)

    def close(self) -> None:
        """Release connections."""
        self.engine.dispose()

    def _write(self) -> Session:
        return self._session.begin()  # type: ignore[return-value]

    # signals ---------------------------------------------------------------------------------

    def write_signals(self, signals: Sequence[Signal]) -> int:
        """Insert signals in one transaction; a repeat of an existing point, or a value that is no finite number, is
        left out."""
        # One row per key: a replayed or duplicated point must not abort the whole batch, nor may a NaN (stored as
        # NULL, which the column refuses).
        rows = list({(s.name, s.subject, s.ts): s for s in signals if math.isfinite(s.value)}.values())
        if not rows:
            return 0
        payload = [{"name": s.name, "subject": s.subject, "ts": s.ts, "value": s.value} for s in rows]
        table = Base.metadata.tables["signals"]
        # SQLite's and PostgreSQL's own inserts skip a repeated key; others insert plainly.
        stmt = self._insert(table).on_conflict_do_nothing() if self._insert else insert(table)  # type: ignore[attr-defined]
        with self.engine.begin() as conn:
            conn.execute(stmt, payload)
        return len(payload)

    def load_signals(self, since: float, names: Iterable[str] | None = None,
                     until: float | None = None) -> list[Signal]:
        """Raw signals at or after `since`, and at or before `until` (to prime the policies' windows after a restart,
        and a gate's steps)."""
        q = select(SignalRow.ts, SignalRow.subject, SignalRow.name, SignalRow.value).where(SignalRow.ts >= since)
        if until is not None:
            q = q.where(SignalRow.ts <= until)
        if names is not None:
            q = q.where(SignalRow.name.in_(list(names)))
        with self.engine.connect() as conn:
            return [Signal(r.ts, r.subject, r.name, r.value) for r in conn.execute(q.order_by(SignalRow.ts))]

    def count_signals(self) -> int:
        """How many raw signal rows are stored."""
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(SignalRow)).scalar_one())

    # targets ---------------------------------------------------------------------------------

    def record_targets(self, results: Iterable[tuple[Target, TargetHealth, bool, float]],
                       live: Collection[str] | None = None) -> None:
        """Upsert each target's latest health: (target, health, up, scraped_at); with `live`, the keys of every target
        there is now, forget the others (pods gone, pools removed)."""
        with self._write() as s:
            existing = {t.key: t for t in s.scalars(select(TargetRow))}
            if live is not None:
                keep = set(live)
                gone = [key for key in existing if key not in keep]
                for i in range(0, len(gone), 500):  # a bound parameter list every database takes
                    s.execute(delete(TargetRow).where(TargetRow.key.in_(gone[i:i + 500])))
                for key in gone:
                    del existing[key]
            for target, health, up, at in results:
                row = existing.get(target.key)
                if row is None:
                    row = TargetRow(key=target.key, url=target.url, pool=target.pool, pod=target.pod,
                                    role=str(target.role), source=target.source)
                    s.add(row)
                row.url = target.url
                row.up = up
                row.last_scrape_at = at
                row.last_error = health.last_error
                row.consecutive_failures = health.consecutive_failures
                row.missing_families = {"families": list(health.missing_families)}

    # findings --------------------------------------------------------------------------------

    def open_findings(self) -> list[FindingRecord]:
        """Every finding that is open now."""
        with self._session() as s:
            return [_finding(r) for r in s.scalars(select(FindingRow).where(FindingRow.state == "open"))]

    def open_finding(self, finding: NewFinding, now: float) -> FindingRecord:
        """Open a new finding."""
        with self._write() as s:
            row = FindingRow(
                kind=finding.kind, subject=finding.subject, state="open",
                severity=finding.severity, summary=finding.summary, cause=finding.cause,
                evidence=jsonable(finding.evidence), runbook=finding.runbook,
                opened_at=now, updated_at=now,
            )
            s.add(row)
            s.flush()
            return _finding(row)

    def update_finding(self, finding_id: int, finding: NewFinding, now: float) -> None:
        """Refresh an open finding's severity, summary and evidence (policies keep its baseline); one resolved
        meanwhile (by the leader after this one) keeps what it was resolved with."""
        with self._write() as s:
            s.execute(update(FindingRow).where(FindingRow.id == finding_id, FindingRow.state == "open").values(
                severity=finding.severity, summary=finding.summary, cause=finding.cause,
                evidence=jsonable(finding.evidence), updated_at=now))

    def resolve_finding(self, finding_id: int, reason: str, now: float) -> None:
        """Close a finding; its incident ends."""
        with self._write() as s:
            s.execute(
                update(FindingRow)
                .where(FindingRow.id == finding_id, FindingRow.state == "open")
                .values(state="resolved", resolved_at=now, updated_at=now, resolve_reason=reason)
            )

    def findings_since(self, since: float) -> list[FindingRecord]:
        """Findings opened at or after `since`, oldest first."""
        with self._session() as s:
            q = select(FindingRow).where(FindingRow.opened_at >= since).order_by(FindingRow.id)
            return [_finding(r) for r in s.scalars(q)]

    def finding(self, finding_id: int) -> FindingRecord | None:
        """One finding by id."""
        with self._session() as s:
            row = s.get(FindingRow, finding_id)
            return _finding(row) if row else None

    # actions and the audit log ---------------------------------------------------------------

    def create_action(self, action: NewAction, now: float) -> ActionRecord:
        """Record a proposed action and its first audit event in one transaction.

        StoreConflict when an action of the same pool and kind is still active (the database's rule).
        """
        with self._write() as s:
            row = ActionRow(finding_id=action.finding_id, kind=action.kind, pool=action.pool,
                            params=jsonable(action.params), mode=action.mode, state=str(ActionState.PROPOSED),
                            reason=action.reason, created_at=now)
            s.add(row)
            s.flush()
            s.add(ActionEventRow(action_id=row.id, ts=now, event=str(ActionState.PROPOSED),
                                 detail={"reason": action.reason, **jsonable(action.params)}))
            return _action(row)

    def transition(self, action_id: int, expected: ActionState | Collection[ActionState], to: ActionState,
                   now: float, detail: dict[str, Any] | None = None, **fields: Any) -> ActionRecord:
        """Move an action from one of `expected` to `to`, writing its audit event in the same transaction.

        The update is conditional on the current state, so of two racing deciders exactly one wins;
        the other gets ActionConflict naming the state it lost to (ActionNotFound for no such action).
        """
        froms = expected_states(expected)
        check_transition(froms, to)
        unknown = set(fields) - _FIELDS
        if unknown:
            raise ValueError(f"transition cannot set {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {"state": str(to), **fields}
        if to in _STAMPS:
            values[_STAMPS[to]] = now
        with self._write() as s:
            done = s.execute(update(ActionRow)
                             .where(ActionRow.id == action_id, ActionRow.state.in_([str(f) for f in froms]))
                             .values(**values))
            if done.rowcount != 1:  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult
                current = s.scalar(select(ActionRow.state).where(ActionRow.id == action_id))
                if current is None:
                    raise ActionNotFound(action_id)
                raise ActionConflict(action_id, " or ".join(map(str, froms)), current)
            s.add(ActionEventRow(action_id=action_id, ts=now, event=str(to), detail=jsonable(detail or {})))
            return _action(s.get_one(ActionRow, action_id))

    def decide(self, action_id: int, *, approve: bool, by: str, now: float, via: str,
               ttl: float | None = None) -> ActionRecord:
        """Approve or reject a proposed action on behalf of `by`; ActionConflict if it is not awaiting a decision, or
        has waited `ttl` or longer since it was proposed (the loop expires it at its next tick)."""
        to = ActionState.APPROVED if approve else ActionState.REJECTED
        if ttl is not None:
            with self._session() as s:
                created = s.scalar(select(ActionRow.created_at).where(ActionRow.id == action_id))
            if created is None:
                raise ActionNotFound(action_id)
            if now - created >= ttl:  # its creation never changes: no race with the update below
                raise ActionConflict(action_id, str(ActionState.PROPOSED), "expired")
        return self.transition(action_id, ActionState.PROPOSED, to, now, {"by": by, "via": via}, approved_by=by)

    def note(self, action_id: int, event: str, now: float, detail: dict[str, Any]) -> None:
        """Add an event to an action's audit log without moving it (progress of a change that waits)."""
        with self._write() as s:
            s.add(ActionEventRow(action_id=action_id, ts=now, event=event, detail=jsonable(detail)))

    def record_outcome(self, action_id: int, outcome: str, now: float, detail: dict[str, Any]) -> None:
        """Write the measured outcome of a finished action, once: ActionConflict where it is judged already (by an old
        leader's last tick, which always finishes)."""
        with self._write() as s:
            done = s.execute(update(ActionRow).where(ActionRow.id == action_id, ActionRow.outcome.is_(None))
                             .values(outcome=outcome, outcome_at=now))
            if done.rowcount != 1:  # type: ignore[attr-defined]
                raise ActionConflict(action_id, "awaiting its outcome", "judged already")
            s.add(ActionEventRow(action_id=action_id, ts=now, event=f"outcome:{outcome}", detail=jsonable(detail)))

    def actions(self, *, states: Collection[ActionState] | None = None, since: float | None = None,
                pool: str | None = None) -> list[ActionRecord]:
        """Actions filtered by state, creation time and pool, oldest first."""
        q = select(ActionRow)
        conds: list[ColumnElement[bool]] = []
        if states is not None:
            conds.append(ActionRow.state.in_([str(x) for x in states]))
        if since is not None:
            conds.append(ActionRow.created_at >= since)
        if pool is not None:
            conds.append(ActionRow.pool == pool)
        if conds:
            q = q.where(and_(*conds))
        with self._session() as s:
            return [_action(r) for r in s.scalars(q.order_by(ActionRow.id))]

    def recent_actions(self, since: float) -> list[ActionRecord]:
        """Actions created since `since`, plus any older one that has not finished."""
        q = select(ActionRow).where((ActionRow.created_at >= since) | ActionRow.state.in_([str(a) for a in ACTIVE_STATES]))
        with self._session() as s:
            return [_action(r) for r in s.scalars(q.order_by(ActionRow.id))]

    def compact(self, now: float, retention: Retention, steps: int | None = None) -> CompactionReport:
        """Roll up and expire signals and records (see `compaction`): all of it, or `steps` steps of it."""
        return compact(self.engine, now, retention, steps)

    def action_events(self, action_id: int) -> list[ActionEvent]:
        """An action's audit log, oldest first."""
        q = select(ActionEventRow).where(ActionEventRow.action_id == action_id).order_by(ActionEventRow.id)
        with self._session() as s:
            return [ActionEvent(r.action_id, r.ts, r.event, dict(r.detail)) for r in s.scalars(q)]

    def awaiting_outcome(self, finished_before: float) -> list[ActionRecord]:
        """Actions to score (SCORED_STATES) whose outcome is not judged yet and whose verify time has come."""
        q = select(ActionRow).where(
            ActionRow.state.in_([str(s) for s in SCORED_STATES]), ActionRow.outcome.is_(None),
            ActionRow.finished_at <= finished_before,
        )
        with self._session() as s:
            return [_action(r) for r in s.scalars(q)]

    # the kill switch ---------------------------------------------------------------------------

    def record_verdict(self, verdict: NewVerdict) -> int:
        """Keep a canary gate's verdict, once per run (a write again after a commit whose answer was lost is the row
        kept); returns its id."""
        run = verdict.run
        with self._write() as s:
            if self._insert is None:  # no dialect of our own: a plain insert, which the index refuses twice
                row = VerdictRow(**run, result=verdict.result, score=verdict.score, details=jsonable(verdict.details))
                s.add(row)
                s.flush()
                return row.id
            made = s.scalar(self._insert(VerdictRow).values(**run, result=verdict.result, score=verdict.score,
                                                            details=jsonable(verdict.details))
                            .on_conflict_do_nothing().returning(VerdictRow.id))  # type: ignore[attr-defined]
            if made is not None:
                return int(made)
            return int(s.scalar(select(VerdictRow.id).where(*(getattr(VerdictRow, k) == v for k, v in run.items())))
                       or 0)

    # advice ------------------------------------------------------------------------------------

    def record_advice(self, items: Sequence[NewAdvice], now: float) -> list[AdviceRecord]:
        """Keep recommendations: one open per kind and pool, refreshed while the advice stays the same, superseded
        by a new row when it changes."""
        try:
            return self._record_advice(items, now)
        except IntegrityError:
            # Another run reopened a followed row of a kind and pool meanwhile (under read committed, after this
            # one looked): looked at again, it is the open row to refresh or supersede.
            return self._record_advice(items, now)

    def _record_advice(self, items: Sequence[NewAdvice], now: float) -> list[AdviceRecord]:
        out = []
        with self._write() as s:
            for item in items:
                q = select(AdviceRow).where(AdviceRow.kind == item.kind, AdviceRow.pool == item.pool,
                                            AdviceRow.state == "open")
                row = s.scalars(q).first()
                change = jsonable(item.change)
                if row is not None and row.change != change:
                    # Only while still open (another run may have just followed it), and before its successor's
                    # insert: one open row per kind and pool, by the database.
                    s.execute(update(AdviceRow).where(AdviceRow.id == row.id, AdviceRow.state == "open")
                              .values(state="superseded", updated_at=now))
                    row = None
                if row is None:
                    row = AdviceRow(kind=item.kind, pool=item.pool, change=change, state="open", created_at=now)
                    s.add(row)
                row.act, row.advice, row.metric, row.before = item.act, item.advice, item.metric, item.before
                row.predicted, row.saving_per_day, row.confidence = item.predicted, item.saving_per_day, item.confidence
                row.evidence, row.updated_at = jsonable(item.evidence), now
                s.flush()
                out.append(_advice(row))
        return out

    def advice(self, states: Collection[str] | None = None) -> list[AdviceRecord]:
        """Stored recommendations (in these states), newest first."""
        q = select(AdviceRow).order_by(AdviceRow.id.desc())
        if states is not None:
            q = q.where(AdviceRow.state.in_(list(states)))
        with self._session() as s:
            return [_advice(r) for r in s.scalars(q)]

    def follow_advice(self, advice_id: int, now: float) -> None:
        """An open recommendation the fleet now runs as advised: measured on what it shows from `now` on."""
        self._advance_advice(advice_id, "open", {"state": "followed", "applied_at": now, "updated_at": now})

    def unfollow_advice(self, advice_id: int, now: float) -> None:
        """A followed recommendation the fleet no longer runs: open again, to be followed (and timed) afresh, or
        superseded where newer advice of its kind for its pool is open meanwhile."""
        superseded = {"state": "superseded", "updated_at": now}
        try:
            with self._write() as s:
                row = s.get(AdviceRow, advice_id)
                newer = row is not None and s.scalars(select(AdviceRow.id).where(
                    AdviceRow.kind == row.kind, AdviceRow.pool == row.pool, AdviceRow.state == "open")).first()
                _advance(s, advice_id, "followed", superseded if newer is not None
                         else {"state": "open", "applied_at": None, "updated_at": now})
        except IntegrityError:
            # Newer advice of its kind for its pool was inserted by another run meanwhile (under read committed,
            # after this one looked): it is superseded by it.
            with self._write() as s:
                _advance(s, advice_id, "followed", superseded)

    def score_advice(self, advice_id: int, measured: float, error: float | None, now: float) -> None:
        """A followed recommendation: the metric measured since it was followed, and the error."""
        self._advance_advice(advice_id, "followed", {"state": "applied", "updated_at": now, "measured": measured,
                                                     "error": error})

    def _advance_advice(self, advice_id: int, state: str, values: dict[str, Any]) -> None:
        """Move a recommendation on from `state`, conditionally: of two advisor runs only one does."""
        with self._write() as s:
            _advance(s, advice_id, state, values)

    def pause_state(self) -> Pause | None:
        """The kill switch: set (who, why, when) or None."""
        with self.engine.connect() as conn:
            raw = conn.execute(select(MetaRow.value).where(MetaRow.key == _PAUSE)).scalar_one_or_none()
        if raw is None:
            return None
        data = json.loads(raw)
        return Pause(str(data["by"]), str(data["reason"]), float(data["at"]))

    def claim(self, key: str, value: float, stale_before: float) -> tuple[float, bool]:
        """The value claimed under `key`, one answer for every replica: the recorded one unless under `stale_before`,
        else `value`, recorded; of racing replicas the first write wins and the others read it."""
        name = claim_key(key)
        for _ in range(3):
            with self.engine.begin() as conn:
                raw = conn.execute(select(MetaRow.value).where(MetaRow.key == name)).scalar_one_or_none()
                if raw is not None and float(raw) >= stale_before:
                    return float(raw), False
                if raw is None:
                    stmt = self._insert(MetaRow).on_conflict_do_nothing() if self._insert else insert(MetaRow)  # type: ignore[attr-defined]
                    stmt = stmt.values(key=name, value=repr(value))
                else:  # conditional: a stale claim is replaced once
                    stmt = update(MetaRow).where(MetaRow.key == name, MetaRow.value == raw).values(value=repr(value))
                if conn.execute(stmt.returning(MetaRow.key)).first() is not None:  # this call wrote it
                    return value, True
        raise StoreConflict(f"the claim {key} kept changing under this replica")

    def set_pause(self, pause: Pause | None) -> None:
        """Set the kill switch (every replica stops acting at its next check), or clear it with None."""
        with self.engine.begin() as conn:
            conn.execute(delete(MetaRow).where(MetaRow.key == _PAUSE))
            if pause is not None:
                value = json.dumps({"by": pause.by, "reason": pause.reason, "at": pause.at})
                conn.execute(insert(MetaRow).values(key=_PAUSE, value=value))

    # bulk loads and sizes (backfills, benchmarks) -------------------------------------------

    def bulk_load(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], *, batch: int = 200_000) -> int:
        """Insert rows into one table as they are, in batches, without the checks of the methods above.

        For loading history into an empty store (a backfill, a benchmark's seed); every batch is
        one transaction. Tables with JSON columns go through SQLAlchemy, others through the driver.
        """
        if table not in Base.metadata.tables:
            raise ValueError(f"no table {table!r}; tables: {', '.join(sorted(Base.metadata.tables))}")
        t = Base.metadata.tables[table]
        unknown = [c for c in columns if c not in t.c]
        if unknown:
            raise ValueError(f"table {table} has no column {', '.join(unknown)}")
        as_json = any(isinstance(t.c[c].type, JSON) for c in columns)
        marks = {"qmark": "?", "numeric": ":{}", "named": ":{}"}.get(self.engine.dialect.paramstyle, "%s")
        sql = (f"INSERT INTO {t.name} ({', '.join(columns)}) VALUES "
               f"({', '.join(marks.format(c) if '{' in marks else marks for c in columns)})")
        done = 0
        chunk: list[Sequence[Any]] = []

        def flush() -> None:
            with self.engine.begin() as conn:
                if as_json:
                    conn.execute(insert(t), [dict(zip(columns, r, strict=True)) for r in chunk])
                else:
                    conn.exec_driver_sql(sql, [tuple(r) for r in chunk])

        for row in rows:
            chunk.append(row)
            if len(chunk) >= batch:
                flush()
                done += len(chunk)
                chunk = []
        if chunk:
            flush()
            done += len(chunk)
        return done

    def set_rollup_watermarks(self, minute: float, hour: float) -> None:
        """Where compaction takes up again: rollups of loaded history are complete up to these times."""
        with self.engine.begin() as conn:
            for key, value in (("rollup_60", minute), ("rollup_3600", hour)):
                conn.execute(delete(MetaRow).where(MetaRow.key == key))
                conn.execute(insert(MetaRow).values(key=key, value=repr(value)))

    def signal_bytes(self) -> int:
        """Bytes the raw signals take: the database file on SQLite, the table and its indexes on PostgreSQL."""
        if self.engine.dialect.name == "postgresql":
            with self.engine.connect() as conn:
                return int(conn.execute(text("SELECT pg_total_relation_size('signals')")).scalar_one())
        with self.engine.connect() as conn:  # fold the write-ahead log in first, as closing the store would
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        path = self.engine.url.database or ""
        return sum(os.path.getsize(path + s) for s in ("", "-wal") if path and os.path.exists(path + s))

    def delete_signals_before(self, cutoff: float) -> int:
        """Drop raw signals older than `cutoff`."""
        with self.engine.begin() as conn:
            return conn.execute(delete(SignalRow).where(SignalRow.ts < cutoff)).rowcount or 0


def _advance(s: Session, advice_id: int, state: str, values: dict[str, Any]) -> None:
    """In `s`, move a recommendation on from `state` if it is still in it; StoreConflict where it is not."""
    done = s.execute(update(AdviceRow).where(AdviceRow.id == advice_id, AdviceRow.state == state).values(values))
    if done.rowcount != 1:  # type: ignore[attr-defined]
        raise StoreConflict(f"advice {advice_id} is not {state}")


def jsonable(value: Any) -> Any:
    """Evidence as plain JSON types (tuples to lists, enums to strings, a float that is no number to null: JSON has
    none, and PostgreSQL refuses the `NaN` SQLite and Python write)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, str):
        return str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, bool | int) or value is None:
        return value
    return str(value)
