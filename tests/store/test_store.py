"""The SQL store on SQLite and on a real PostgreSQL.

Covers: migrations up, down and up again; models agree with migrations; signals (dedupe,
replays); the finding lifecycle and its one-open-per-key constraint; actions and the audit
log; rollups and retention; an unreachable or unmigrated store; and durability across kill -9.
"""

from __future__ import annotations

import inspect as inspect_module
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import event, insert, inspect, select, text, update

from collectors.types import Signal
from controlplane.actions import ActionState as S
from controlplane.errors import StoreConflict, StoreUnavailable
from controlplane.store import migrate
from controlplane.store.compaction import Retention
from controlplane.store.db import make_engine
from controlplane.store.memory import MemoryStore
from controlplane.store.models import (
    ActionEventRow,
    ActionRow,
    AdviceRow,
    Base,
    FindingRow,
    SignalRollupRow,
    VerdictRow,
)
from controlplane.store.queries import ReadStore
from controlplane.store.records import NewAction, NewAdvice, NewFinding, NewVerdict
from controlplane.store.threaded import ThreadedStore
from controlplane.store.writer import SqlStore

TABLES = {"targets", "signals", "signal_rollups", "findings", "actions", "action_events", "verdicts", "store_meta"}


def test_migrations_upgrade_downgrade_upgrade(db_url: str) -> None:
    assert migrate.current(db_url) is None
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    try:
        assert TABLES <= set(inspect(engine).get_table_names())
        assert migrate.current(db_url) == migrate.head()
        migrate.downgrade(db_url, "base")
        assert not TABLES & set(inspect(engine).get_table_names())
        migrate.upgrade(db_url)
        assert migrate.current(db_url) == migrate.head()
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_replicas_that_migrate_a_new_database_at_once_all_succeed(pg_url: str) -> None:
    # Processes, as replicas are: Alembic's context is one per process.
    code = "import sys; from controlplane.store import migrate; migrate.upgrade(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, pg_url], stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errors
    assert migrate.current(pg_url) == migrate.head()


def test_a_store_url_is_printed_without_its_passwords() -> None:
    from controlplane.store.db import redact

    assert redact("postgresql://fleet:pw@db/fleet?password=s3&sslpassword=k3y&sslmode=require") == (
        "postgresql://fleet:***@db/fleet?password=***&sslmode=require&sslpassword=***")
    assert redact("sqlite:///fleet.db") == "sqlite:///fleet.db"


def test_the_lifecycle_migration_keeps_a_change_in_progress_started(db_url: str) -> None:
    """Of a pool's and kind's active actions, the newest stayed and the others expired: a started scale, with a newer
    proposal beside it, was expired, a move the lifecycle forbids, and never taken over or judged."""
    migrate.upgrade(db_url, "0001")
    engine = make_engine(db_url)
    rows = [("decode", "started"), ("decode", "proposed"), ("prefill", "proposed"), ("prefill", "proposed")]
    try:
        with engine.begin() as conn:
            for pool, state in rows:
                conn.execute(text("INSERT INTO actions (kind, pool, params, mode, state, reason, created_at) VALUES "
                                  f"('scale_pool', '{pool}', '{{}}', 'act', '{state}', 'r', 1.0)"))
        migrate.upgrade(db_url)
        with engine.connect() as conn:
            states = [r[0] for r in conn.execute(text("SELECT state FROM actions ORDER BY id"))]
    finally:
        engine.dispose()
    assert states == ["started", "expired", "expired", "proposed"]


def test_a_verdict_written_again_after_a_lost_commit_is_kept_once(db_url: str) -> None:
    """The commit landed and its answer was lost (the store said unavailable): the loop and the gate keep the verdict
    and write it again, and the Canary page showed it twice. Rows doubled so before the index are left one."""
    from dataclasses import replace

    migrate.upgrade(db_url, "0006")
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            for _ in range(2):  # doubled before the index
                conn.execute(text("INSERT INTO verdicts (gate, pool, baseline, canary, started_at, finished_at, result, "
                                  "details) VALUES ('api', 'decode', 'a', 'b', 10.0, 70.0, 'fail', '{}')"))
    finally:
        engine.dispose()
    migrate.upgrade(db_url)
    store = SqlStore.open(db_url)
    try:
        verdict = NewVerdict("api", "decode", "a", "c", 80.0, 140.0, "pass", 1.0, {})
        first = store.record_verdict(verdict)
        assert store.record_verdict(verdict) == first  # written again: the row kept
        assert store.record_verdict(replace(verdict, finished_at=150.0)) != first  # another run's
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT COUNT(*) FROM verdicts")).scalar() == 3
    finally:
        store.close()


def test_the_tables_made_again_for_ids_never_reused_keep_their_rows_and_the_ids_given(db_url: str) -> None:
    """Upgraded from before (where SQLite reused the largest id once its row was gone): every row, its id and what
    refers to it are kept, and the next id follows the largest ever given, not the largest left."""
    migrate.upgrade(db_url, "0007")
    engine = make_engine(db_url)
    action = ("INSERT INTO actions (finding_id, kind, pool, params, mode, state, reason, created_at) VALUES "
              "(1, 'scale_pool', :pool, '{}', 'propose', 'rejected', 'r', 1.0)")
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO findings (kind, subject, state, severity, summary, cause, evidence, "
                              "runbook, opened_at, updated_at) VALUES ('slo_burn', 'pool/a', 'open', 'critical', "
                              "'s', 'c', '{}', 'r', 1.0, 1.0)"))
            for pool in ("a", "b"):
                conn.execute(text(action), {"pool": pool})
            conn.execute(text("INSERT INTO action_events (action_id, ts, event, detail) VALUES (2, 1.0, 'x', '{}')"))
        migrate.upgrade(db_url)
        with engine.begin() as conn:
            assert [tuple(r) for r in conn.execute(text("SELECT id, pool, finding_id FROM actions ORDER BY id"))] == [
                (1, "a", 1), (2, "b", 1)]
            conn.execute(text("DELETE FROM action_events"))
            conn.execute(text("DELETE FROM actions WHERE id = 2"))
            conn.execute(text(action), {"pool": "c"})
            assert conn.execute(text("SELECT id FROM actions WHERE pool = 'c'")).scalar() == 3
    finally:
        engine.dispose()
    migrate.downgrade(db_url, "0007")  # and back: the rows are kept as well
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            assert [r[0] for r in conn.execute(text("SELECT id FROM actions ORDER BY id"))] == [1, 3]
    finally:
        engine.dispose()


def test_a_sqlite_migration_killed_halfway_leaves_nothing_behind_and_runs_again(tmp_path: Path) -> None:
    """A pod killed while 0008 copied a table: the table it had made for the copy stayed, committed on its own, and
    every later upgrade failed on it until someone dropped it by hand."""
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    migrate.upgrade(url, "0007")
    killed = (
        "import os, signal\n"
        "from sqlalchemy import event\n"
        "from sqlalchemy.engine import Engine\n"
        "from controlplane.store import migrate\n"
        "@event.listens_for(Engine, 'after_cursor_execute')\n"
        "def die(conn, cursor, statement, *args):\n"
        "    if statement.lstrip().upper().startswith('INSERT INTO _ALEMBIC_TMP_'):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        f"migrate.upgrade({url!r})\n")
    assert subprocess.run([sys.executable, "-c", killed], timeout=120).returncode == -signal.SIGKILL
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name FROM sqlite_master WHERE name LIKE '_alembic_tmp%'")).all() == []
    finally:
        engine.dispose()
    migrate.upgrade(url)
    assert migrate.current(url) == "0008"


def test_the_migrated_sqlite_tables_never_reuse_ids_where_the_models_say_so(tmp_path: Path) -> None:
    """What the models-to-migrations comparison cannot see: SQLite's AUTOINCREMENT, made only with a table."""
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            made = dict(conn.execute(text("SELECT name, sql FROM sqlite_master WHERE type = 'table'")).all())
    finally:
        engine.dispose()
    never_reused = {t.name for t in Base.metadata.sorted_tables if t.dialect_kwargs.get("sqlite_autoincrement")}
    assert never_reused == {"findings", "actions", "action_events", "verdicts", "advice"}
    assert {name for name, sql in made.items() if "AUTOINCREMENT" in sql} == never_reused


def test_models_match_the_migrations(store: SqlStore) -> None:
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []


@pytest.mark.postgres
def test_a_pools_subjects_are_all_listed_whatever_the_databases_collation(pg_url_blind_to_punctuation: str) -> None:
    url = pg_url_blind_to_punctuation
    migrate.upgrade(url)
    store = SqlStore.open(url)
    try:
        subjects = ["engine/p1/a/0", "engine/p1/b/0", "engine/p10/x/0", "engine/p1-b/y/0"]
        store.write_signals([Signal(1000.0, s, "x", 1.0) for s in subjects])
        store.compact(1000.0 + 7200, Retention(raw_s=30 * 86400, minute_s=30 * 86400, hour_s=30 * 86400))
        reads = ReadStore(store.engine)
        for level in (0, 60):
            assert reads.subjects("x", "engine/p1/", resolution=level) == ["engine/p1/a/0", "engine/p1/b/0"]
        assert reads.names("") == ["x"]
    finally:
        store.close()


def test_unmigrated_and_unreachable_stores_are_named(db_url: str) -> None:
    # A SQLite file that is not there is said as such, not made (and then found unmigrated).
    with pytest.raises(StoreUnavailable, match="(schema revision none|no such file).*fleetctl db upgrade"):
        SqlStore.open(db_url)
    with pytest.raises(StoreUnavailable, match="unreachable"):
        make_engine("postgresql://nobody@127.0.0.1:1/none")


def _signals(ts: float, n: int = 10) -> list[Signal]:
    return [Signal(ts, f"engine/p/pod-{i}/0", "prefix_cache_hit_rate", i / n) for i in range(n)]


def test_signals_write_and_ignore_repeats(store: SqlStore) -> None:
    batch = _signals(100.0)
    assert store.write_signals(batch + batch[:3]) == 10  # duplicates inside a batch collapse
    store.write_signals(batch)  # a replay of stored points is ignored, not an error
    assert store.count_signals() == 10
    assert [s.value for s in store.load_signals(0.0)] == [s.value for s in batch]
    store.write_signals(_signals(115.0) + _signals(130.0))
    # A window with both ends (a gate's step): nothing after it, however much came since.
    assert {s.ts for s in store.load_signals(100.0, until=115.0)} == {100.0, 115.0}
    assert {s.ts for s in store.load_signals(101.0, names=["prefix_cache_hit_rate"], until=200.0)} == {115.0, 130.0}
    odd = [Signal(200.0, "pool/p", "x", math.nan), Signal(200.0, "pool/p", "y", math.inf), Signal(200.0, "pool/p", "z", 1.0)]
    assert store.write_signals(odd) == 1, "a value that is no number is left out, not the batch"


def report(subject: str = "pool/prefill", value: float = 0.4) -> NewFinding:
    return NewFinding("prefix_cache_hit_drop", subject, "warning", "hit rate fell", "routing",
                      {"value": value, "baseline": 0.8, "engines": ("a", "b")}, "prefix_cache_hit_drop")


def test_finding_lifecycle_and_one_open_per_key(store: SqlStore) -> None:
    f = store.open_finding(report(), now=10.0)
    store.update_finding(f.id, report(value=0.3), now=25.0)
    [again] = store.open_findings()
    assert again.evidence["value"] == 0.3 and again.evidence["engines"] == ["a", "b"] and again.updated_at == 25.0
    with pytest.raises(StoreConflict, match="open_finding"):
        store.open_finding(report(), now=30.0)  # the database refuses a second open finding
    store.resolve_finding(f.id, "recovered", now=40.0)
    assert store.open_findings() == []
    store.update_finding(f.id, report(value=0.1), now=45.0)  # an old leader's last tick, after the new one resolved it
    with store.engine.connect() as conn:
        assert conn.execute(select(FindingRow.evidence).where(FindingRow.id == f.id)).scalar_one()["value"] == 0.3
    second = store.open_finding(report(), now=50.0)  # a new incident on the same subject
    assert second.id != f.id
    with store.engine.connect() as conn:
        states = conn.execute(select(FindingRow.state).order_by(FindingRow.id)).scalars().all()
    assert states == ["resolved", "open"]
    # A ratio over nothing in the evidence: JSON has no NaN, and PostgreSQL refuses the one Python writes.
    nan = NewFinding("prefix_cache_hit_drop", "pool/prefill", "warning", "hit rate fell", "routing",
                     {"value": math.nan, "share": (math.inf, 0.5)}, "prefix_cache_hit_drop")
    store.update_finding(second.id, nan, now=60.0)
    [kept] = store.open_findings()
    assert kept.evidence["value"] is None and kept.evidence["share"] == [None, 0.5]


def test_the_largest_action_id_a_caller_may_ask_for_is_one_every_database_compares(store: SqlStore) -> None:
    from controlplane.errors import ActionNotFound
    from controlplane.store.records import MAX_ID

    with pytest.raises(ActionNotFound):  # not a refused query: PostgreSQL's INTEGER ends there
        store.decide(MAX_ID, approve=True, by="alice", now=1.0, via="cli")


def test_actions_and_audit_log(store: SqlStore) -> None:
    f = store.open_finding(report(), now=10.0)
    a = store.create_action(NewAction(f.id, "scale_pool", "prefill", {"replicas": 4}, "act", "test"), now=10.0)
    store.decide(a.id, approve=True, by="alice", now=11.0, via="test")
    store.transition(a.id, S.APPROVED, S.STARTED, 12.0, actuator="kubernetes")
    store.transition(a.id, S.STARTED, S.SUCCEEDED, 13.0)
    store.record_outcome(a.id, "recovered", 700.0, {"before": 0.9, "after": 0.4})
    [done] = store.actions()
    assert (done.state, done.started_at, done.finished_at, done.outcome) == ("succeeded", 12.0, 13.0, "recovered")
    assert (done.approved_by, done.actuator, done.dry_run) == ("alice", "kubernetes", False)
    events = ReadStore(store.engine).action_events(a.id)  # shares the store's engine
    assert [e["event"] for e in events] == ["proposed", "approved", "started", "succeeded", "outcome:recovered"]
    assert store.awaiting_outcome(finished_before=1000.0) == []
    assert [x.id for x in store.recent_actions(since=5000.0)] == []


def test_rollups_and_retention(store: SqlStore) -> None:
    t0 = 1_767_225_600.0  # an hour boundary
    points = [Signal(t0 + 15 * i, "pool/p", "ttft_p95", float(i % 4)) for i in range(4 * 60 * 3)]  # three hours
    store.write_signals(points)
    now = t0 + 3 * 3600 + 120
    first = store.compact(now, Retention(raw_s=3600, minute_s=2 * 3600, hour_s=30 * 86400))
    assert first.minute_rows == 180 and first.hour_rows == 3
    with store.engine.connect() as conn:
        hours = conn.execute(select(SignalRollupRow).where(SignalRollupRow.resolution == 3600)
                             .order_by(SignalRollupRow.bucket)).all()
    assert [(h.bucket - t0, h.count, h.sum, h.min, h.max) for h in hours] == [
        (0.0, 240, 360.0, 0.0, 3.0), (3600.0, 240, 360.0, 0.0, 3.0), (7200.0, 240, 360.0, 0.0, 3.0)]
    # Raw points older than an hour are gone; minute rollups older than two hours too.
    assert store.count_signals() == sum(1 for p in points if p.ts >= now - 3600)
    again = store.compact(now, Retention(raw_s=3600, minute_s=2 * 3600, hour_s=30 * 86400))
    assert (again.minute_rows, again.hour_rows) == (0, 0)  # watermarks make reruns idempotent
    series = ReadStore(store.engine).series("ttft_p95", "pool/", now - 8 * 3600, now)  # long range: rollups
    assert series and all(p.value == pytest.approx(1.5) for p in series)


def test_a_short_range_past_a_levels_retention_is_read_from_the_next_coarser_level(store: SqlStore) -> None:
    """The incidents page's evidence for an incident of three days ago: an hour, read raw by its span, whose raw
    points are gone while minute rollups hold it; and an hour of three weeks ago, held in hourly rollups alone."""
    t0 = 1_767_225_600.0
    store.write_signals([Signal(t0 + 60 * i, "pool/p", "ttft_p95", float(i % 2)) for i in range(22 * 24 * 60)])
    now = t0 + 22 * 86400
    store.compact(now, Retention(raw_s=48 * 3600, minute_s=14 * 86400, hour_s=400 * 86400))
    reads = ReadStore(store.engine)
    three_days_ago = now - 3 * 86400
    points = reads.buckets(["ttft_p95"], ["pool/p"], three_days_ago, three_days_ago + 3600)
    assert sum(p.count for p in points) == 61 and all(p.mean in (0.0, 1.0) for p in points), "its 61 minutes"
    three_weeks_ago = now - 21 * 86400
    points = reads.buckets(["ttft_p95"], ["pool/p"], three_weeks_ago, three_weeks_ago + 3600)
    assert sum(p.count for p in points) == 120 and {p.mean for p in points} == {0.5}, "its two hours' rollups"
    recent = reads.buckets(["ttft_p95"], ["pool/p"], now - 3600, now)
    assert sum(p.count for p in recent) == 60, "the last hour is still raw"


@pytest.mark.parametrize(("every", "days", "now", "retention", "edge", "read", "points"), [
    # Raw points kept a day, compacted at hh:30:30: the edge falls inside a minute; 22 points in 3.5 minutes.
    (10, 3, 3 * 86400 + 1830.0, (86400, 2 * 86400), 86400, (-90, 120), 22),
    # Minute rollups kept two days, compacted at hh:30: the edge falls inside an hour; 211 minutes in 3.5 hours.
    (60, 4, 4 * 86400 + 1800.0, (3600, 2 * 86400), 2 * 86400, (-1800, 3 * 3600), 211),
])
def test_a_range_across_a_retention_edge_counts_each_point_once(store: SqlStore, every: int, days: int, now: float,
                                                                retention: tuple[float, float], edge: float,
                                                                read: tuple[float, float], points: int) -> None:
    """The bucket that holds the edge, read from the coarser level, would also be read from the finer rows after it."""
    t0 = 1_767_225_600.0
    store.write_signals([Signal(t0 + every * i, "pool/p", "x", 1.0) for i in range(days * 86400 // every)])
    store.compact(t0 + now, Retention(raw_s=retention[0], minute_s=retention[1], hour_s=400 * 86400))
    at = t0 + now - edge
    assert sum(p.count for p in ReadStore(store.engine).buckets(["x"], ["pool/p"], at + read[0], at + read[1])) == points


def test_a_walk_of_subjects_or_names_returns_at_most_its_limit(store: SqlStore) -> None:
    store.write_signals([Signal(1000.0, f"pool/p{i:02d}", "targets", 1.0) for i in range(10)])
    reads = ReadStore(store.engine)
    assert reads.subjects("targets", "pool/", limit=3) == ["pool/p00", "pool/p01", "pool/p02"]
    assert reads.names("", limit=1) == ["targets"] and reads.names("", limit=0) == []


@pytest.mark.parametrize("kind", ["sql", "memory"])
async def test_a_claim_key_longer_than_the_database_keeps_is_refused_by_either_store(store: SqlStore,
                                                                                     kind: str) -> None:
    backend = store if kind == "sql" else MemoryStore()
    fits, too_long = "gate-start:" + "x" * 47, "gate-start:" + "x" * 48
    got = backend.claim(fits, 1.0, 0.0)
    assert (await got if inspect_module.isawaitable(got) else got) == (1.0, True)
    with pytest.raises(ValueError, match="59 characters; at most 58"):
        got = backend.claim(too_long, 1.0, 0.0)
        await got if inspect_module.isawaitable(got) else got


async def test_the_memory_store_gives_no_verdict_id_twice() -> None:
    store = MemoryStore()
    ids = [await store.record_verdict(NewVerdict("api", "decode", "a", "b", at - 60.0, at, "pass", 1.0, {}))
           for at in (100.0, 200.0, 7000.0)]
    await store.compact(7000.0, Retention(raw_s=3600, minute_s=7200, hour_s=86400, records_s=6000.0))
    assert len(store.verdicts) == 1
    assert await store.record_verdict(NewVerdict("api", "decode", "a", "b", 7000.0, 7100.0, "pass", 1.0, {})) == 4
    assert ids == [1, 2, 3]


async def _records_of_a_year(store: SqlStore | MemoryStore) -> dict[str, int]:
    """Findings, actions, verdicts and advice, some past a retention that ends at 6,000 and some not; their ids."""

    async def call(name: str, *args: Any, **kwargs: Any) -> Any:
        got = getattr(store, name)(*args, **kwargs)
        return await got if inspect_module.isawaitable(got) else got

    ids: dict[str, int] = {}
    for name, resolved, finished in (("alone", 100.0, None), ("acted", 100.0, 110.0), ("judged_late", 100.0, 7000.0)):
        f = await call("open_finding", report(subject=f"pool/{name}"), now=50.0)
        await call("resolve_finding", f.id, "recovered", resolved)
        ids[name] = f.id
        if finished is not None:
            a = await call("create_action", NewAction(f.id, "scale_pool", name, {"replicas": 4}, "act", "t"), now=60.0)
            await call("decide", a.id, approve=False, by="alice", now=finished, via="test")
            ids[f"{name}_action"] = a.id
    waiting = await call("create_action", NewAction(None, "scale_pool", "waiting", {}, "propose", "t"), now=60.0)
    ids["waiting_action"] = waiting.id
    for finished in (100.0, 7000.0):
        await call("record_verdict", NewVerdict("api", "decode", "a", "b", finished - 60.0, finished, "pass", 1.0, {}))
    [superseded] = await call("record_advice", [_advice(2)], 10.0)
    [followed] = await call("record_advice", [_advice(3)], 20.0)  # supersedes the first
    await call("follow_advice", followed.id, 30.0)
    ids |= {"superseded_advice": superseded.id, "followed_advice": followed.id}
    for gate, at in (("old", 100.0), ("live", 7000.0)):  # a gate's claims: a time each
        await call("claim", f"gate-start:{gate}", at, 0.0)
    return ids


@pytest.mark.parametrize("kind", ["sql", "memory"])
async def test_records_past_their_retention_go_and_what_is_still_referred_to_stays(store: SqlStore,
                                                                                   kind: str) -> None:
    backend: SqlStore | MemoryStore = store if kind == "sql" else MemoryStore()
    ids = await _records_of_a_year(backend)
    retention = Retention(raw_s=3600, minute_s=3600, hour_s=3600, records_s=4000)
    compacted = backend.compact(10_000.0, retention)
    report_ = await compacted if inspect_module.isawaitable(compacted) else compacted
    if kind == "sql":
        assert isinstance(backend, SqlStore)
        with backend.engine.connect() as conn:
            findings = set(conn.execute(select(FindingRow.id)).scalars())
            actions = set(conn.execute(select(ActionRow.id)).scalars())
            events = set(conn.execute(select(ActionEventRow.action_id)).scalars())
            verdicts = list(conn.execute(select(VerdictRow.finished_at)).scalars())
            advice = set(conn.execute(select(AdviceRow.id)).scalars())
    else:
        assert isinstance(backend, MemoryStore)
        findings, actions = set(backend.findings), set(backend.action_rows)
        events = {e.action_id for e in backend.events}
        verdicts = [v.finished_at for v in backend.verdicts]
        advice = set(backend.advice_rows)
    # The action rejected at 110 goes with its audit log, and then its finding; the one rejected at 7,000 keeps its
    # finding, and one still waiting for a decision stays however old.
    assert findings == {ids["judged_late"]}
    assert actions == {ids["judged_late_action"], ids["waiting_action"]} and ids["judged_late_action"] in events
    assert events <= actions
    assert verdicts == [7000.0]
    assert advice == {ids["followed_advice"]}, "followed advice waits for its measurement however old"
    # The rejected action and its two events, the two findings, a verdict, the superseded advice, the old claim.
    assert report_.records_deleted == 8
    for gate, kept in (("old", 1.0), ("live", 7000.0)):
        claimed = backend.claim(f"gate-start:{gate}", 1.0, -1.0)
        assert (await claimed if inspect_module.isawaitable(claimed) else claimed)[0] == kept
    # Records made after the expiry take ids of their own, never a kept row's.
    fresh = backend.create_action(NewAction(None, "scale_pool", "new", {}, "propose", "t"), now=10_001.0)
    made = await fresh if inspect_module.isawaitable(fresh) else fresh
    assert made.id not in actions


def test_a_long_gap_is_caught_up_in_steps_of_bounded_transactions(store: SqlStore) -> None:
    # Thirty hours of raw points never compacted (compaction failing for a day, a history loaded): rolled up and
    # deleted six hours of data at a time, each step its own transaction, with the same rollups as in one.
    t0 = 1_767_225_600.0
    store.write_signals([Signal(t0 + 60 * i, "pool/p", "x", float(i % 3)) for i in range(30 * 60)])
    steps: list[object] = []

    def began(conn: object) -> None:
        steps.append(conn)

    event.listen(store.engine, "begin", began)
    try:
        done = store.compact(t0 + 30 * 3600 + 120, Retention(raw_s=3600, minute_s=7200, hour_s=30 * 86400))
    finally:
        event.remove(store.engine, "begin", began)
    assert (done.minute_rows, done.hour_rows) == (30 * 60, 30)
    assert done.raw_deleted == 29 * 60 + 2 and store.count_signals() == 58  # the last hour before now kept
    assert len(steps) >= 5 + 5 + 5, "rollups and deletions of 30 hours in steps of at most six"
    with store.engine.connect() as conn:
        hours = conn.execute(select(SignalRollupRow.count, SignalRollupRow.sum)
                             .where(SignalRollupRow.resolution == 3600)).all()
    assert sorted(set(hours)) == [(60, 60.0)]


async def test_the_loops_store_compacts_a_step_a_call_so_its_writes_go_in_between(store: SqlStore) -> None:
    t0 = 1_767_225_600.0
    store.write_signals([Signal(t0 + 60 * i, "pool/p", "x", float(i % 3)) for i in range(30 * 60)])
    calls: list[int | None] = []
    compact = store.compact

    def one_step(now: float, retention: Retention, steps: int | None = None) -> Any:
        calls.append(steps)
        return compact(now, retention, steps)

    store.compact = one_step  # type: ignore[method-assign]
    threaded = ThreadedStore(store)
    try:
        done = await threaded.compact(t0 + 30 * 3600 + 120, Retention(raw_s=3600, minute_s=7200, hour_s=30 * 86400))
    finally:
        threaded.close()
    assert (done.minute_rows, done.hour_rows, done.raw_deleted, done.done) == (30 * 60, 30, 29 * 60 + 2, True)
    assert len(calls) >= 15 and set(calls) == {1}, "one step of six hours' data a call on the store's thread"


def test_retention_never_drops_what_the_next_rollup_has_not_taken(store: SqlStore) -> None:
    # Minute rollups kept for exactly an hour: the hour they make is rolled up a minute after it ends, by when its
    # first minutes are past their retention.
    t0 = 1_767_225_600.0
    store.write_signals([Signal(t0 + 15 * i, "pool/p", "x", 1.0) for i in range(4 * 65)])
    retention = Retention(raw_s=3600, minute_s=3600, hour_s=30 * 86400)
    for now in (t0 + 3000, t0 + 3630, t0 + 3930):
        store.compact(now, retention)
    with store.engine.connect() as conn:
        [hour] = conn.execute(select(SignalRollupRow).where(SignalRollupRow.resolution == 3600)).all()
    assert (hour.count, hour.sum) == (240, 240.0)


WRITER = textwrap.dedent(
    """
    import sys
    from collectors.types import Signal
    from controlplane.store.writer import SqlStore
    store = SqlStore.open(sys.argv[1])
    tick = 0
    while True:
        store.write_signals([Signal(1000.0 + tick, f"engine/p/pod-{i}/0", "x", float(tick)) for i in range(500)])
        tick += 1
        print(tick, flush=True)
    """
)


@pytest.mark.slow
def test_kill_9_during_ingest_loses_nothing_committed(db_url: str) -> None:
    migrate.upgrade(db_url)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, db_url], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout is not None
    committed = 0
    for line in proc.stdout:
        committed = int(line)
        if committed >= 40:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    store = SqlStore.open(db_url)
    try:
        stored = store.count_signals()
        assert stored >= committed * 500 and stored % 500 == 0  # whole ticks only
        if store.engine.dialect.name == "sqlite":
            with store.engine.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
    finally:
        store.close()



def _advice(k: int) -> NewAdvice:
    return NewAdvice("spec_tuning", "decode", True, f"k={k}", {"k": k}, "tpot", 0.05, 0.04, None, 0.8, {})


def test_followed_advice_changed_back_after_newer_advice_is_superseded_not_opened_twice(store: SqlStore) -> None:
    [first] = store.record_advice([_advice(2)], 10.0)
    store.follow_advice(first.id, 20.0)
    [newer] = store.record_advice([_advice(3)], 30.0)  # the advisor changed its mind while the fleet ran k=2
    store.unfollow_advice(first.id, 40.0)  # the fleet went back: k=2 is no longer the advice
    assert {r.id: r.state for r in store.advice()} == {first.id: "superseded", newer.id: "open"}


async def test_the_memory_store_supersedes_such_advice_as_the_database_does() -> None:
    memory = MemoryStore()
    [first] = await memory.record_advice([_advice(2)], 10.0)
    await memory.follow_advice(first.id, 20.0)
    [newer] = await memory.record_advice([_advice(3)], 30.0)
    await memory.unfollow_advice(first.id, 40.0)
    assert {r.id: r.state for r in await memory.advice()} == {first.id: "superseded", newer.id: "open"}


def _beside_uncommitted(store: SqlStore, write: Any, call: Callable[[], object]) -> None:
    """Run `call` while another connection holds `write` uncommitted (read committed: `call` does not see it), then
    commit it, which `call` waits on."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # handed to the test's thread below
            raised.append(e)

    done = threading.Thread(target=run)
    with store.engine.connect() as other:
        tx = other.begin()
        other.execute(write)
        done.start()
        try:
            done.join(1.0)
            assert done.is_alive(), "it waits on the other's uncommitted row"
        finally:
            tx.commit()
    done.join(10.0)
    assert not done.is_alive() and not raised, raised


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[SqlStore]:
    migrate.upgrade(pg_url)
    store = SqlStore.open(pg_url)
    yield store
    store.close()


@pytest.mark.postgres
def test_unfollowing_advice_beside_a_concurrent_insert_of_newer_advice_supersedes_it(pg_store: SqlStore) -> None:
    """The unfollow's look for newer advice misses a row another run has inserted and not yet committed; its reopening
    then waits on that row's unique index, and loses once it commits."""
    [first] = pg_store.record_advice([_advice(2)], 10.0)
    pg_store.follow_advice(first.id, 20.0)
    newer = insert(AdviceRow).values(kind="spec_tuning", pool="decode", act=True, advice="k=3", change={"k": 3},
                                     metric="tpot", before=0.05, predicted=0.04, confidence=0.8, evidence={},
                                     state="open", created_at=30.0, updated_at=30.0)
    _beside_uncommitted(pg_store, newer, lambda: pg_store.unfollow_advice(first.id, 40.0))
    assert sorted(r.state for r in pg_store.advice()) == ["open", "superseded"]


@pytest.mark.postgres
def test_newer_advice_beside_a_concurrent_reopening_supersedes_the_reopened_row(pg_store: SqlStore) -> None:
    [first] = pg_store.record_advice([_advice(2)], 10.0)
    pg_store.follow_advice(first.id, 20.0)
    reopening = update(AdviceRow).where(AdviceRow.id == first.id).values(state="open", applied_at=None)  # an unfollow
    newer: list[Any] = []
    _beside_uncommitted(pg_store, reopening, lambda: newer.extend(pg_store.record_advice([_advice(3)], 30.0)))
    assert {r.id: r.state for r in pg_store.advice()} == {first.id: "superseded", newer[0].id: "open"}


def test_advice_naming_a_pool_among_several_is_found_by_it(store: SqlStore) -> None:
    store.record_advice([NewAdvice("kv_precision", "dec+pre+dec-b", True, "fp8", {}, "engines_needed", 4.0, 3.0, None,
                                   0.8, {}), NewAdvice("kv_precision", "prefill", True, "fp8", {}, "engines_needed", 4.0,
                                                       3.0, None, 0.8, {})], 10.0)
    reads = ReadStore(store.engine)
    assert [r["pool"] for r in reads.advice("pre")] == ["dec+pre+dec-b"]
    assert [r["pool"] for r in reads.advice("dec-b")] == ["dec+pre+dec-b"]
    assert [r["pool"] for r in reads.advice("dec")] == ["dec+pre+dec-b"]
