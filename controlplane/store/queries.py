"""Read-only queries for the dashboard and the CLI; nothing here writes.

Series come from raw signals for short ranges and from rollups for long ones, so a page's
query cost stays bounded however long the store has been running. Bucketed reads choose the
finest resolution whose scan fits a row budget and stitch the coarse level to the finer ones
past its rollup watermark, so the newest minutes are never missing from a long range. The
dashboard's page models (`dashboard/pages.py`) are built from these reads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, Select, and_, func, literal, or_, select, text, union_all
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from controlplane.errors import StoreUnavailable
from controlplane.store import migrate
from controlplane.store.compaction import KEPT_MINUTES, KEPT_RAW, bucket_start
from controlplane.store.db import make_engine, redact
from controlplane.store.models import (
    ActionEventRow,
    ActionRow,
    AdviceRow,
    FindingRow,
    MetaRow,
    SignalRollupRow,
    SignalRow,
    TargetRow,
    VerdictRow,
)

__all__ = ["Plan", "Point", "ReadStore", "SeriesPoint", "Spread", "plan"]

# Up to this range raw points are read; beyond it 1-minute rollups, beyond a day hourly ones.
RAW_MAX_S = 6 * 3600.0
MINUTE_MAX_S = 7 * 86400.0
# Bucketed reads: the scrape interval assumed when estimating raw rows, how many stored rows one
# read may scan and how many buckets it may return (SQLite groups and returns about a million rows
# a second, so these keep a page of a few reads well inside its time goal), and the most points
# a series gets on a chart.
RAW_INTERVAL_S = 15.0
SCAN_BUDGET = 40_000
RETURN_BUDGET = 4_000
MAX_POINTS = 240
STEPS = (15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
# How far back "the latest value" may lie before a series counts as silent.
LATEST_LOOKBACK_S = 180.0
# Upper bounds on lists a page reads, so a churning fleet cannot make a page unbounded.
MAX_SUBJECTS = 2000
MAX_NAMES = 64


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """One point of a series: time, subject and value (the mean for rollups)."""

    ts: float
    subject: str
    value: float


@dataclass(frozen=True, slots=True)
class Point:
    """One bucket of one series: mean, min and max of the values that fell in it."""

    ts: float
    name: str
    subject: str
    mean: float
    min: float
    max: float
    count: int


@dataclass(frozen=True, slots=True)
class Spread:
    """One bucket across many subjects: the mean, min, max and sum of their bucket means."""

    ts: float
    name: str
    mean: float
    min: float
    max: float
    total: float
    subjects: int


@dataclass(frozen=True, slots=True)
class Plan:
    """How a bucketed read runs: the stored level (0 raw, 60 or 3600) and the bucket width."""

    resolution: int
    step: float


def plan(start: float, end: float, series: int = 1, budget: int = SCAN_BUDGET) -> Plan:
    """How to read `series` series over [start, end]: the finest level whose scan fits `budget`
    rows, and a bucket width that keeps each series within MAX_POINTS and the read within RETURN_BUDGET."""
    span = max(end - start, 1.0)
    n = max(1, series)
    resolution, width = 3600, 3600.0
    for level, level_width, max_span in ((0, RAW_INTERVAL_S, RAW_MAX_S), (60, 60.0, MINUTE_MAX_S)):
        if span <= max_span and n * span / level_width <= budget:
            resolution, width = level, level_width
            break
    want = max(width, span / MAX_POINTS, span * n / RETURN_BUDGET)
    step = next((s for s in STEPS if s >= want), math.ceil(want / 86400) * 86400)
    return Plan(resolution, float(step))


@dataclass(frozen=True, slots=True)
class Marks:
    """What each stored level holds: rollups up to their watermarks, raw signals and minute rollups from when
    retention kept them (0: from the start)."""

    wm60: float = 0.0
    wm3600: float = 0.0
    kept_raw: float = 0.0
    kept_60: float = 0.0


def _levels(p: Plan, start: float, end: float, m: Marks) -> list[tuple[int, float, float]]:
    """[lo, hi) time ranges per stored level: the planned level up to its watermark, finer ones after, and coarser
    ones before, where retention has dropped the planned level's rows (a short range days ago)."""
    stop = math.nextafter(end, math.inf)
    if p.resolution == 0:
        cuts = [(3600, start, m.kept_60), (60, max(start, m.kept_60), m.kept_raw), (0, max(start, m.kept_raw), stop)]
    elif p.resolution == 60:
        cuts = [(3600, start, m.kept_60), (60, max(start, m.kept_60), m.wm60), (0, max(start, m.wm60), stop)]
    else:
        cuts = [(3600, start, m.wm3600), (60, max(start, m.wm3600), m.wm60), (0, max(start, m.wm60, m.wm3600), stop)]
    return [(level, lo, min(hi, stop)) for level, lo, hi in cuts if min(hi, stop) > lo]


def _part(level: int, names: list[str], subjects: list[str], lo: float, hi: float, step: float | None,
          positive: bool = False) -> Select[Any]:
    """Per (name, subject, bucket) count/sum/min/max from one stored level; no bucket when `step` is None.

    `positive` reads only stored rows above zero, so a scan for rare events groups only the events.
    """
    if level == 0:
        t = SignalRow
        b = bucket_start(t.ts, literal(step)) if step else literal(0.0)
        q = (select(t.name, t.subject, b.label("b"), func.count().label("n"), func.sum(t.value).label("s"),
                    func.min(t.value).label("lo"), func.max(t.value).label("hi"))
             .where(t.name.in_(names), t.subject.in_(subjects), t.ts >= lo, t.ts < hi))
        if positive:
            q = q.where(t.value > 0)
        return q.group_by(t.name, t.subject, b) if step else q.group_by(t.name, t.subject)
    r = SignalRollupRow
    b = bucket_start(r.bucket, literal(step)) if step else literal(0.0)
    q = (select(r.name, r.subject, b.label("b"), func.sum(r.count).label("n"), func.sum(r.sum).label("s"),
                func.min(r.min).label("lo"), func.max(r.max).label("hi"))
         .where(r.resolution == level, r.name.in_(names), r.subject.in_(subjects), r.bucket >= lo, r.bucket < hi))
    if positive:
        q = q.where(r.max > 0)
    return q.group_by(r.name, r.subject, b) if step else q.group_by(r.name, r.subject)


def _point(b: Any, name: str, subject: str, n: Any, s: Any, lo: Any, hi: Any) -> Point:
    """A Point from aggregate columns (PostgreSQL sums integers to Decimal)."""
    return Point(float(b), name, subject, float(s) / float(n), float(lo), float(hi), int(n))


_WALK = """
WITH RECURSIVE walk(item, n) AS (
  SELECT (SELECT min({col}) FROM {table} WHERE {cond} {col} >= :lo), 0
  UNION ALL
  SELECT (SELECT min({col}) FROM {table} WHERE {cond} {col} > walk.item), walk.n + 1
  FROM walk WHERE walk.item IS NOT NULL AND walk.n < :limit AND substr(walk.item, 1, :plen) = :lo
)
SELECT item FROM walk WHERE item IS NOT NULL AND walk.n < :limit AND substr(item, 1, :plen) = :lo
"""


def _reads(cls: type[ReadStore]) -> type[ReadStore]:
    """Every public query raises StoreUnavailable, not SQLAlchemy's errors, when the store fails."""

    def translated(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except SQLAlchemyError as exc:
                raise StoreUnavailable(f"{fn.__name__}: {str(getattr(exc, 'orig', None) or exc).strip()[:300]}") from exc

        return wrapper

    for name, value in list(vars(cls).items()):
        if callable(value) and not name.startswith("_") and not isinstance(value, classmethod | staticmethod):
            setattr(cls, name, translated(value))
    return cls


@_reads
class ReadStore:
    """Query methods over an engine; returns plain dicts and dataclasses."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def open(cls, url: str) -> ReadStore:
        """Connect to the store at `url`; StoreUnavailable when unreachable or not migrated."""
        engine = make_engine(url, existing=True)
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

    # bucketed signal reads ---------------------------------------------------------------------

    def _marks(self, conn: Connection) -> Marks:
        keys = {"rollup_60": "wm60", "rollup_3600": "wm3600", KEPT_RAW: "kept_raw", KEPT_MINUTES: "kept_60"}
        rows = conn.execute(select(MetaRow.key, MetaRow.value).where(MetaRow.key.in_(list(keys)))).tuples().all()
        return Marks(**{keys[k]: float(v) for k, v in rows})

    def _grouped(self, conn: Connection, names: list[str], subjects: list[str], start: float, end: float,
                 p: Plan, step: float | None, positive: bool = False) -> Select[Any] | None:
        parts = [_part(level, names, subjects, lo, hi, step, positive)
                 for level, lo, hi in _levels(p, start, end, self._marks(conn))]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        u = union_all(*parts).subquery()
        return (select(u.c.name, u.c.subject, u.c.b, func.sum(u.c.n).label("n"), func.sum(u.c.s).label("s"),
                       func.min(u.c.lo).label("lo"), func.max(u.c.hi).label("hi"))
                .group_by(u.c.name, u.c.subject, u.c.b))

    def buckets(self, names: Iterable[str], subjects: Iterable[str], start: float, end: float, *,
                plan_: Plan | None = None, positive: bool = False) -> list[Point]:
        """Every (name, subject) series in [start, end] as buckets with mean, min and max, oldest first.

        `positive` reads only values above zero (event counters: XIDs, ECC errors).
        """
        names, subjects = sorted(set(names)), sorted(set(subjects))
        if not names or not subjects or end < start:
            return []
        p = plan_ or plan(start, end, len(names) * len(subjects))
        with self.engine.connect() as conn:
            q = self._grouped(conn, names, subjects, start, end, p, p.step, positive)
            if q is None:
                return []
            rows = conn.execute(q).tuples().all()
        points = [_point(b, name, subject, n, s, lo, hi) for name, subject, b, n, s, lo, hi in rows if n]
        points.sort(key=lambda pt: pt.ts)
        return points

    def spread(self, names: Iterable[str], subjects: Iterable[str], start: float, end: float, *,
               plan_: Plan | None = None) -> list[Spread]:
        """Per bucket, how the subjects' means spread: mean, min, max and sum across subjects."""
        names, subjects = sorted(set(names)), sorted(set(subjects))
        if not names or not subjects or end < start:
            return []
        p = plan_ or plan(start, end, len(names) * len(subjects))
        with self.engine.connect() as conn:
            q = self._grouped(conn, names, subjects, start, end, p, p.step)
            if q is None:
                return []
            inner = q.subquery()
            mean = (inner.c.s / inner.c.n).label("mean")
            per = select(inner.c.name, inner.c.b, mean).where(inner.c.n > 0).subquery()
            outer = (select(per.c.name, per.c.b, func.avg(per.c.mean), func.min(per.c.mean), func.max(per.c.mean),
                            func.sum(per.c.mean), func.count())
                     .group_by(per.c.name, per.c.b))
            rows = conn.execute(outer).tuples().all()
        spreads = [Spread(float(b), name, float(avg), float(lo), float(hi), float(total), int(n))
                   for name, b, avg, lo, hi, total, n in rows]
        return sorted(spreads, key=lambda sp: sp.ts)

    def totals(self, names: Iterable[str], subjects: Iterable[str], start: float, end: float) -> dict[tuple[str, str], Point]:
        """One aggregate per (name, subject) over the whole of [start, end]: mean, min, max and count."""
        names, subjects = sorted(set(names)), sorted(set(subjects))
        if not names or not subjects or end < start:
            return {}
        # A whole-window aggregate needs no fine buckets: a quarter of the budget picks a coarser level.
        p = plan(start, end, len(names) * len(subjects), budget=SCAN_BUDGET // 4)
        with self.engine.connect() as conn:
            q = self._grouped(conn, names, subjects, start, end, p, None)
            if q is None:
                return {}
            rows = conn.execute(q).tuples().all()
        return {(name, subject): _point(start, name, subject, n, s, lo, hi) for name, subject, _b, n, s, lo, hi in rows if n}

    def latest(self, names: Iterable[str], subjects: Iterable[str], at: float,
               lookback: float = LATEST_LOOKBACK_S) -> dict[tuple[str, str], tuple[float, float]]:
        """The newest raw (ts, value) per (name, subject) within `lookback` seconds before `at`."""
        names, subjects = sorted(set(names)), sorted(set(subjects))
        if not names or not subjects:
            return {}
        s = SignalRow
        newest = (select(s.name, s.subject, func.max(s.ts).label("ts"))
                  .where(s.name.in_(names), s.subject.in_(subjects), s.ts >= at - lookback, s.ts <= at)
                  .group_by(s.name, s.subject).subquery())
        q = select(s.name, s.subject, s.ts, s.value).join(
            newest, and_(s.name == newest.c.name, s.subject == newest.c.subject, s.ts == newest.c.ts))
        with self.engine.connect() as conn:
            return {(name, subject): (ts, value) for name, subject, ts, value in conn.execute(q).tuples()}

    def subjects(self, name: str, prefix: str = "", *, resolution: int = 0, limit: int = MAX_SUBJECTS) -> list[str]:
        """Subjects under `prefix` that have signal `name` at a stored level (0 raw, 60, 3600), sorted.

        Walks the primary key one subject at a time, so the cost grows with the number of
        subjects, not with the number of stored points.
        """
        if resolution:
            table, cond, params = "signal_rollups", "resolution = :res AND name = :name AND", {"res": resolution}
        else:
            table, cond, params = "signals", "name = :name AND", {}
        sql = text(_WALK.format(col="subject", table=table, cond=cond))
        with self.engine.connect() as conn:
            return list(conn.execute(sql, {"name": name, "lo": prefix, "plen": len(prefix), "limit": limit, **params})
                        .scalars())

    def names(self, prefix: str, *, limit: int = MAX_NAMES) -> list[str]:
        """Signal names starting with `prefix` among the raw signals, sorted."""
        sql = text(_WALK.format(col="name", table="signals", cond=""))
        with self.engine.connect() as conn:
            return list(conn.execute(sql, {"lo": prefix, "plen": len(prefix), "limit": limit}).scalars())

    def subjects_for(self, name: str, prefix: str, start: float, end: float, *, limit: int = MAX_SUBJECTS) -> list[str]:
        """Subjects under `prefix` with signal `name`, read at the level a range this long is read at."""
        current = self.subjects(name, prefix, limit=limit)
        level = plan(start, end, max(1, len(current))).resolution
        if level == 0:
            return current
        return sorted(set(current) | set(self.subjects(name, prefix, resolution=level, limit=limit)))[:limit]

    # fleet structure ---------------------------------------------------------------------------

    def targets(self) -> list[dict[str, Any]]:
        """Every known target with its health."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(TargetRow).order_by(TargetRow.pool, TargetRow.pod)).mappings().all()
        return [dict(r) for r in rows]

    def target_counts(self) -> list[dict[str, Any]]:
        """Targets per pool, role, source and health: pool, role, source, up, count."""
        t = TargetRow
        q = (select(t.pool, t.role, t.source, t.up, func.count().label("count"))
             .group_by(t.pool, t.role, t.source, t.up).order_by(t.pool))
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]

    def pools(self) -> dict[str, str]:
        """Pool name to role, from the targets table and the pool-level signals."""
        out: dict[str, str] = {}
        for row in self.target_counts():
            out.setdefault(row["pool"], row["role"])
        for name in ("targets", "engines_reporting"):
            for subject in self.subjects(name, "pool/", limit=500):
                out.setdefault(subject.removeprefix("pool/"), "")
        return dict(sorted(out.items()))

    # findings, actions, verdicts ---------------------------------------------------------------

    def findings(self, include_resolved: bool = False, limit: int = 500) -> list[dict[str, Any]]:
        """Findings, newest first."""
        q = select(FindingRow).order_by(FindingRow.id.desc()).limit(limit)
        if not include_resolved:
            q = q.where(FindingRow.state == "open")
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]

    def findings_between(self, start: float, end: float, limit: int = 500) -> list[dict[str, Any]]:
        """Findings open at some time in [start, end], newest opened first."""
        f = FindingRow
        q = (select(f).where(f.opened_at <= end, or_(f.resolved_at.is_(None), f.resolved_at >= start))
             .order_by(f.opened_at.desc()).limit(limit))
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]

    def finding(self, finding_id: int) -> dict[str, Any] | None:
        """One finding by id."""
        with self.engine.connect() as conn:
            row = conn.execute(select(FindingRow).where(FindingRow.id == finding_id)).mappings().first()
        return None if row is None else dict(row)

    def open_counts(self) -> dict[str, int]:
        """Open findings per severity."""
        q = select(FindingRow.severity, func.count()).where(FindingRow.state == "open").group_by(FindingRow.severity)
        with self.engine.connect() as conn:
            return {sev: int(n) for sev, n in conn.execute(q).tuples()}

    def actions(self, limit: int = 500) -> list[dict[str, Any]]:
        """The audit log's actions, newest first."""
        q = select(ActionRow).order_by(ActionRow.id.desc()).limit(limit)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]

    def action(self, action_id: int) -> dict[str, Any] | None:
        """One action by id."""
        with self.engine.connect() as conn:
            row = conn.execute(select(ActionRow).where(ActionRow.id == action_id)).mappings().first()
        return None if row is None else dict(row)

    def actions_where(self, *, finding_id: int | None = None, pool: str | None = None, states: Sequence[str] | None = None,
                      limit: int = 100) -> list[dict[str, Any]]:
        """Actions of one finding, pool and/or states, newest first."""
        a = ActionRow
        q = select(a).order_by(a.id.desc()).limit(limit)
        if finding_id is not None:
            q = q.where(a.finding_id == finding_id)
        if pool is not None:
            q = q.where(a.pool == pool)
        if states is not None:
            q = q.where(a.state.in_(list(states)))
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]

    def action_events(self, action_id: int) -> list[dict[str, Any]]:
        """Every audit event of one action, in order."""
        q = select(ActionEventRow).where(ActionEventRow.action_id == action_id).order_by(ActionEventRow.id)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]

    def advice(self, pool: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """The advisor's open recommendations (those of one pool, or naming it in a pair) and its scored ones,
        newest first."""
        q = (select(AdviceRow).where(AdviceRow.state.in_(("open", "followed", "applied")))
             .order_by(AdviceRow.state.desc(), AdviceRow.id.desc()).limit(limit))
        if pool is not None:
            # Pool names hold neither `%` nor `_` (the fleet file's pattern), so they match as written.
            q = q.where(or_(AdviceRow.pool == pool, AdviceRow.pool.like(f"{pool}+%"), AdviceRow.pool.like(f"%+{pool}"),
                            AdviceRow.pool.like(f"%+{pool}+%")))
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]

    def verdicts(self, limit: int = 200) -> list[dict[str, Any]]:
        """Canary gate verdicts, newest first."""
        q = select(VerdictRow).order_by(VerdictRow.id.desc()).limit(limit)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]
