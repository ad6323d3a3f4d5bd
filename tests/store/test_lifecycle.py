"""The action lifecycle as every `Store` keeps it: SQL on SQLite and PostgreSQL (off the event
loop), and the in-memory double, which must behave the same.

Covers: legal and illegal transitions; conditional transitions that fail when the action moved
first; decide() for approve and reject; one active action per pool and kind; two deciders racing
on one action from separate threads (exactly one wins); the migration that brings the rule to a
store holding duplicates.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from controlplane.actions import TRANSITIONS, IllegalTransition
from controlplane.actions import ActionState as S
from controlplane.errors import ActionConflict, ActionNotFound, StoreConflict
from controlplane.store import migrate
from controlplane.store.base import Store
from controlplane.store.memory import MemoryStore
from controlplane.store.records import NewAction, NewAdvice, NewFinding, NewVerdict
from controlplane.store.threaded import ThreadedStore
from controlplane.store.writer import SqlStore


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres), "memory"])
async def any_store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """The SQL store (SQLite and PostgreSQL, through the thread the loop uses) and the memory double."""
    if request.param == "memory":
        yield MemoryStore()
        return
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
    migrate.upgrade(url)
    threaded = ThreadedStore.open(url)
    yield threaded
    threaded.close()


def scale(pool: str = "prefill", kind: str = "scale_pool") -> NewAction:
    return NewAction(None, kind, pool, {"from_replicas": 3, "replicas": 4}, "propose", "test")


def test_the_transition_table_is_closed_and_ends_in_finished_states() -> None:
    assert set(TRANSITIONS) == set(S)
    reachable = {S.PROPOSED} | {t for ts in TRANSITIONS.values() for t in ts}
    assert reachable == set(S)
    assert all(not TRANSITIONS[s] for s in (S.SUCCEEDED, S.FAILED, S.UNKNOWN, S.DRY_RUN, S.REJECTED, S.EXPIRED,
                                            S.CANCELLED))


async def test_transitions_move_only_from_the_expected_state(any_store: Store) -> None:
    a = await any_store.create_action(scale(), 1.0)
    assert a.state is S.PROPOSED
    with pytest.raises(IllegalTransition):
        await any_store.transition(a.id, S.PROPOSED, S.SUCCEEDED, 2.0)  # skips started: never legal
    with pytest.raises(ActionConflict, match=r"action \d+ is proposed, not approved"):
        await any_store.transition(a.id, S.APPROVED, S.STARTED, 2.0)
    with pytest.raises(ActionNotFound):
        await any_store.transition(999, S.PROPOSED, S.APPROVED, 2.0)
    approved = await any_store.decide(a.id, approve=True, by="alice", now=3.0, via="cli")
    assert (approved.state, approved.approved_by) == (S.APPROVED, "alice")
    with pytest.raises(ActionConflict) as lost:
        await any_store.decide(a.id, approve=False, by="bob", now=4.0, via="api")  # too late to reject
    assert lost.value.current == "approved"
    started = await any_store.transition(a.id, S.APPROVED, S.STARTED, 5.0, actuator="dry_run", dry_run=True)
    assert (started.actuator, started.dry_run, started.started_at) == ("dry_run", True, 5.0)
    done = await any_store.transition(a.id, [S.STARTED], S.DRY_RUN, 6.0, {"replicas": 4})
    assert (done.state, done.finished_at) == (S.DRY_RUN, 6.0)
    assert [a.id for a in await any_store.awaiting_outcome(1e9)] == []  # a dry run is no fleet outcome


async def test_an_outcome_is_recorded_once(any_store: Store) -> None:
    # Two leaders judging one action (the old one's last tick always finishes): the first verdict stands.
    a = await any_store.create_action(scale(), 1.0)
    await any_store.decide(a.id, approve=True, by="alice", now=2.0, via="cli")
    await any_store.transition(a.id, S.APPROVED, S.STARTED, 3.0)
    await any_store.transition(a.id, S.STARTED, S.SUCCEEDED, 4.0)
    await any_store.record_outcome(a.id, "recovered", 400.0, {"before": 2.0, "after": 1.0})
    with pytest.raises(ActionConflict, match="judged already"):
        await any_store.record_outcome(a.id, "not_recovered", 401.0, {"before": 2.0, "after": 2.0})
    [judged] = [x for x in await any_store.actions() if x.id == a.id]
    assert judged.outcome == "recovered"


async def test_one_active_action_per_pool_and_kind(any_store: Store) -> None:
    first = await any_store.create_action(scale(), 1.0)
    with pytest.raises(StoreConflict):
        await any_store.create_action(scale(), 2.0)
    await any_store.create_action(scale(kind="enable_eplb"), 2.0)  # another kind on the pool
    await any_store.create_action(scale(pool="decode"), 2.0)  # the same kind on another pool
    await any_store.decide(first.id, approve=False, by="bob", now=3.0, via="api")
    again = await any_store.create_action(scale(), 4.0)  # the rejected one is not active any more
    assert again.id != first.id
    states = {(a.pool, a.kind, a.state) for a in await any_store.actions()}
    assert (("prefill", "scale_pool", S.REJECTED) in states) and (("prefill", "scale_pool", S.PROPOSED) in states)


async def test_findings_keep_one_open_per_kind_and_subject(any_store: Store) -> None:
    new = NewFinding("saturation", "pool/decode", "warning", "queue", "load", {"queue": (1, 2)}, "saturation")
    f = await any_store.open_finding(new, 1.0)
    with pytest.raises(StoreConflict):
        await any_store.open_finding(new, 2.0)
    await any_store.resolve_finding(f.id, "recovered", 3.0)
    assert await any_store.open_findings() == []
    assert (await any_store.finding(f.id)).evidence == {"queue": [1, 2]}  # type: ignore[union-attr]


async def test_verdicts_are_kept_with_their_explanations(any_store: Store) -> None:
    details = {"metrics": [{"name": "tpot", "result": "fail", "estimate": 1.1, "interval": (1.04, 1.17)}]}
    first = await any_store.record_verdict(NewVerdict("ci", "decode", "pod=a", "pod=b", 10.0, 70.0, "fail", 0.0, details))
    second = await any_store.record_verdict(NewVerdict("ci", "decode", "pod=a", "pod=c", 80.0, 90.0, "pass", 100.0, {}))
    assert second > first >= 1
    # Written again (its commit's answer lost): one row per gate run, the memory double as the database.
    again = await any_store.record_verdict(NewVerdict("ci", "decode", "pod=a", "pod=c", 80.0, 90.0, "pass", 100.0, {}))
    assert again == second
    if isinstance(any_store, ThreadedStore):
        from controlplane.store.queries import ReadStore

        rows = ReadStore(any_store.sql.engine).verdicts()
        assert [r["result"] for r in rows] == ["pass", "fail"]
        assert rows[1]["details"]["metrics"][0]["interval"] == [1.04, 1.17]
    elif isinstance(any_store, MemoryStore):
        assert any_store.verdicts[0].details["metrics"][0]["interval"] == [1.04, 1.17]


async def test_a_verdict_over_many_pods_is_kept_with_its_arms_shortened(any_store: Store) -> None:
    """A rollout in a pool of ten named its pods in the arms: PostgreSQL refused the row (255 characters at most), and
    the loop, writing it again first thing every tick, stopped."""
    pods = [f"vllm-decode-7d9f8b6c4-{i:05d}" for i in range(12)]
    verdict = NewVerdict("rollout", "decode", ",".join(pods), pods[0], 10.0, 70.0, "fail", 0.0, {"baseline": pods})
    assert len(verdict.baseline) <= 255 and verdict.baseline.endswith("more)") and verdict.canary == pods[0]
    assert verdict.baseline.startswith(",".join(pods[:3]))
    assert await any_store.record_verdict(verdict) >= 1


async def test_a_decision_past_the_time_to_live_is_refused_as_expired(any_store: Store) -> None:
    a = await any_store.create_action(scale(), 100.0)
    with pytest.raises(ActionConflict) as info:
        await any_store.decide(a.id, approve=True, by="alice", now=100.0 + 900.0, via="api", ttl=900.0)
    assert info.value.current == "expired"
    with pytest.raises(ActionNotFound):
        await any_store.decide(a.id + 1, approve=True, by="alice", now=200.0, via="api", ttl=900.0)
    decided = await any_store.decide(a.id, approve=True, by="alice", now=100.0 + 899.0, via="api", ttl=900.0)
    assert decided.state is S.APPROVED


def advice(change: dict, predicted: float = 7.0) -> NewAdvice:
    return NewAdvice("kv_precision", "chat", True, "serve chat with fp8", change, "engines_needed", 10.0, predicted,
                     84.0, 0.8, {"fp8": {"engines": predicted}})


async def test_advice_is_refreshed_superseded_and_scored(any_store: Store) -> None:
    [first] = await any_store.record_advice([advice({"kv_cache_dtype": "fp8"})], now=10.0)
    [again] = await any_store.record_advice([advice({"kv_cache_dtype": "fp8"}, predicted=6.0)], now=20.0)
    assert again.id == first.id and again.predicted == 6.0 and again.created_at == 10.0 and again.updated_at == 20.0
    [other] = await any_store.record_advice([advice({"kv_cache_dtype": "fp8", "replicas": 5})], now=30.0)
    assert other.id != first.id
    assert [(r.id, r.state) for r in await any_store.advice()] == [(other.id, "open"), (first.id, "superseded")]
    with pytest.raises(StoreConflict, match=f"advice {other.id} is not followed"):
        await any_store.score_advice(other.id, 6.5, 0.0, now=35.0)  # scored only on what came after the change
    await any_store.follow_advice(other.id, now=35.0)
    [followed] = await any_store.advice(states=("followed",))
    assert (followed.id, followed.applied_at, followed.measured) == (other.id, 35.0, None)
    with pytest.raises(StoreConflict, match=f"advice {other.id} is not open"):
        await any_store.follow_advice(other.id, now=36.0)
    await any_store.score_advice(other.id, 6.5, (6.5 - 7.0) / 7.0, now=40.0)
    [applied] = await any_store.advice(states=("applied",))
    assert applied.measured == 6.5 and applied.error == pytest.approx(-0.0714, abs=1e-3) and applied.applied_at == 35.0
    assert applied.evidence == {"fp8": {"engines": 7.0}}
    with pytest.raises(StoreConflict, match=f"advice {other.id} is not followed"):
        await any_store.score_advice(other.id, 6.5, 0.0, now=50.0)


async def test_a_claim_is_one_answer_for_every_replica_until_it_is_stale(any_store: Store) -> None:
    assert await any_store.claim("gate-start:g1", 100.0, 0.0) == (100.0, True)
    assert await any_store.claim("gate-start:g1", 130.0, 0.0) == (100.0, False), "the first claim stands"
    assert await any_store.claim("gate-start:g2", 130.0, 0.0) == (130.0, True)
    assert await any_store.claim("gate-start:g1", 500.0, 200.0) == (500.0, True), "a stale claim is replaced"
    assert await any_store.claim("gate-start:g1", 510.0, 200.0) == (500.0, False)


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_racing_deciders_exactly_one_wins(backend: str, request: pytest.FixtureRequest) -> None:
    """A person approving, the loop expiring and a second control plane rejecting, at one instant, in
    separate threads on separate connections: one transition wins, the others see who beat them."""
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    migrate.upgrade(url)
    stores = [SqlStore.open(url) for _ in range(3)]
    try:
        for round_ in range(10):
            a = stores[0].create_action(scale(pool=f"pool-{round_}"), 1.0)
            wins, losses = _race(stores, a.id)
            [winner] = wins
            final = next(x for x in stores[0].actions() if x.id == a.id)
            assert str(final.state) == {"approve": "approved", "reject": "rejected", "expire": "expired"}[winner]
            assert losses == [str(final.state)] * 2
            events = [e.event for e in stores[0].action_events(a.id)]
            assert events == ["proposed", str(final.state)]  # the losers wrote nothing
    finally:
        for s in stores:
            s.close()


def _race(stores: list[SqlStore], action_id: int) -> tuple[list[str], list[str]]:
    """Approve, reject and expire one action at once from three threads: (winning moves, states the losers saw)."""
    go = threading.Barrier(len(stores))
    wins: list[str] = []
    losses: list[str] = []

    def attempt(store: SqlStore, move: str) -> None:
        go.wait()
        try:
            if move == "approve":
                store.decide(action_id, approve=True, by="alice", now=2.0, via="api")
            elif move == "reject":
                store.decide(action_id, approve=False, by="bob", now=2.0, via="cli")
            else:
                store.transition(action_id, S.PROPOSED, S.EXPIRED, 2.0, {"why": "ttl"})
            wins.append(move)
        except ActionConflict as exc:
            losses.append(exc.current)

    threads = [threading.Thread(target=attempt, args=(s, m)) for s, m in zip(stores, ("approve", "reject", "expire"),
                                                                             strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wins, losses


def test_one_open_advice_per_kind_and_pool_is_the_databases_rule_and_the_migration_keeps_the_newest(
        db_url: str) -> None:
    # Two advisor runs at once could each insert an open row: a store from before the rule may hold both.
    migrate.upgrade(db_url, "0004")
    sql = SqlStore.open(db_url, require_current=False)
    with sql.engine.begin() as conn:
        for ts in (1.0, 2.0):
            conn.execute(text("INSERT INTO advice (kind, pool, act, advice, change, metric, before, predicted, "
                              "confidence, evidence, state, created_at, updated_at) VALUES ('kv_precision', 'chat', "
                              ":act, 'x', '{}', 'm', 1.0, 1.0, 0.5, '{}', 'open', :ts, :ts)"), {"ts": ts, "act": True})
    sql.close()
    migrate.upgrade(db_url)
    sql = SqlStore.open(db_url)
    try:
        assert [(r.created_at, r.state) for r in sql.advice()] == [(2.0, "open"), (1.0, "superseded")]
        with pytest.raises(IntegrityError), sql.engine.begin() as conn:  # the database itself refuses two
            conn.execute(text("UPDATE advice SET state = 'open'"))
        [other] = sql.record_advice([advice({"kv_cache_dtype": "fp8"})], now=3.0)  # supersedes, then inserts
        assert [r.state for r in sql.advice()] == ["open", "superseded", "superseded"] and other.created_at == 3.0
    finally:
        sql.close()
    migrate.downgrade(db_url, "0004")


def test_migration_expires_duplicate_active_actions(db_url: str) -> None:
    """A store from before the rule may hold two active actions of one pool and kind: the newest stays."""
    migrate.upgrade(db_url, "0001")
    sql = SqlStore.open(db_url, require_current=False)
    with sql.engine.begin() as conn:
        for state, ts in (("proposed", 1.0), ("approved", 2.0), ("succeeded", 0.5)):
            conn.execute(text("INSERT INTO actions (kind, pool, params, mode, state, reason, created_at) "
                              "VALUES ('scale_pool', 'prefill', '{}', 'act', :state, 'x', :ts)"), {"state": state, "ts": ts})
        # Every action has its audit log, which refers to it (SQLite's copy of the table must not trip over it).
        conn.execute(text("INSERT INTO action_events (action_id, ts, event, detail) "
                          "SELECT id, created_at, 'proposed', '{}' FROM actions"))
    sql.close()
    migrate.upgrade(db_url)
    sql = SqlStore.open(db_url)
    try:
        assert [str(a.state) for a in sql.actions()] == ["expired", "approved", "succeeded"]
        assert next(e.event for e in sql.action_events(1)) == "proposed", "the audit log kept"
        assert [a.dry_run for a in sql.actions()] == [False] * 3
        with pytest.raises(StoreConflict):
            sql.create_action(scale(), 3.0)
    finally:
        sql.close()


async def test_threaded_store_keeps_the_event_loop_free(sqlite_store: SqlStore) -> None:
    """While a slow statement runs on the store's thread, the event loop goes on (a tick keeps scraping)."""
    threaded = ThreadedStore(sqlite_store)
    release = threading.Event()
    original = sqlite_store.open_findings

    def slow() -> list:
        release.wait(5)
        return original()

    sqlite_store.open_findings = slow  # type: ignore[method-assign]
    pending = asyncio.ensure_future(threaded.open_findings())
    ticks = 0
    for _ in range(5):
        await asyncio.sleep(0)
        ticks += 1
    assert ticks == 5 and not pending.done()
    release.set()
    assert await pending == []
    threaded._thread.shutdown(wait=True)


async def test_no_store_gives_an_id_twice_whatever_retention_removed(any_store: Store) -> None:
    """An old notice, alert or link naming action 1 (or finding 1, or advice 1) must not come to name another; SQLite
    gave the newest id again once the newest row had expired."""
    from controlplane.store.compaction import Retention

    finding = await any_store.open_finding(NewFinding("slo_burn", "pool/prefill", "critical", "s", "c", {}, "r"), 0.0)
    first = await any_store.create_action(NewAction(finding.id, "scale_pool", "prefill",
                                                    {"from_replicas": 3, "replicas": 4}, "propose", "test"), 0.0)
    await any_store.transition(first.id, S.PROPOSED, S.REJECTED, 1.0, {"by": "oncall"})
    await any_store.resolve_finding(finding.id, "recovered", 1.0)
    day = 86400.0
    await any_store.compact(900 * day, Retention(raw_s=day, minute_s=day, hour_s=day, records_s=day))
    assert await any_store.actions() == []
    again = await any_store.open_finding(NewFinding("slo_burn", "pool/prefill", "critical", "s", "c", {}, "r"),
                                         900 * day)
    assert again.id == finding.id + 1
    assert (await any_store.create_action(scale(), 900 * day)).id == first.id + 1
