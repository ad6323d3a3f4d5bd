"""The store in memory, for tests: the `Store` protocol with the SQL store's rules and nothing kept.

Holds the same invariants the database enforces (one open finding per kind and subject, one
active action per pool and kind, conditional transitions along the lifecycle), so a test that
passes on it means the same on SQL. Compaction only expires raw signals; there are no rollups.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import replace
from typing import Any

from collectors.types import Signal, Target, TargetHealth
from controlplane.actions import ACTIVE_STATES, FINISHED_STATES, SCORED_STATES, ActionState, check_transition
from controlplane.errors import ActionConflict, ActionNotFound, StoreConflict
from controlplane.store.base import claim_key
from controlplane.store.compaction import EXPIRING_CLAIMS, KEPT_ADVICE, CompactionReport, Retention
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
from controlplane.store.writer import expected_states, jsonable

__all__ = ["MemoryStore"]



class MemoryStore:
    """`Store` in memory."""

    def __init__(self) -> None:
        self.signals: dict[tuple[str, str, float], Signal] = {}
        self.targets: dict[str, tuple[Target, TargetHealth, bool, float]] = {}
        self.findings: dict[int, FindingRecord] = {}
        self.resolve_reasons: dict[int, str] = {}
        self.action_rows: dict[int, ActionRecord] = {}
        self.events: list[ActionEvent] = []
        self.verdicts: list[NewVerdict] = []
        # Ids are never given twice, as the database's are not, whatever retention removed.
        self._last_ids = {"advice": 0, "findings": 0, "actions": 0, "verdicts": 0}
        self._verdict_ids: dict[tuple[Any, ...], int] = {}  # per gate run (`NewVerdict.run`)
        self.outcome_at: dict[int, float] = {}
        self.pause: Pause | None = None
        self.claims: dict[str, float] = {}
        self.advice_rows: dict[int, AdviceRecord] = {}

    # signals and targets ---------------------------------------------------------------------

    async def write_signals(self, signals: Sequence[Signal]) -> int:
        fresh = {(s.name, s.subject, s.ts): s for s in signals if math.isfinite(s.value)}
        for key, s in fresh.items():
            self.signals.setdefault(key, s)
        return len(fresh)

    async def load_signals(self, since: float, names: Iterable[str] | None = None,
                           until: float | None = None) -> list[Signal]:
        wanted = None if names is None else set(names)
        return sorted((s for s in self.signals.values() if s.ts >= since and (until is None or s.ts <= until)
                       and (wanted is None or s.name in wanted)), key=lambda s: s.ts)

    async def record_targets(self, results: Iterable[tuple[Target, TargetHealth, bool, float]],
                             live: Collection[str] | None = None) -> None:
        for target, health, up, at in results:
            self.targets[target.key] = (target, health, up, at)
        if live is not None:
            for key in set(self.targets) - set(live):
                del self.targets[key]

    async def compact(self, now: float, retention: Retention) -> CompactionReport:
        old = [k for k, s in self.signals.items() if s.ts < now - retention.raw_s]
        for k in old:
            del self.signals[k]
        return CompactionReport(0, 0, len(old), 0, self._expire_records(now - retention.records_s))

    def _expire_records(self, until: float) -> int:
        """`compaction._expire_records` on the dictionaries."""
        finished = {str(s) for s in FINISHED_STATES}
        gone = {a.id for a in self.action_rows.values()
                if a.state in finished and (a.finished_at if a.finished_at is not None else a.created_at) < until}
        events = len(self.events)
        self.events = [e for e in self.events if e.action_id not in gone]
        for action_id in gone:
            del self.action_rows[action_id]
        pointed_at = {a.finding_id for a in self.action_rows.values()}
        findings = [f.id for f in self.findings.values() if f.state == "resolved" and f.resolved_at is not None
                    and f.resolved_at < until and f.id not in pointed_at]
        for finding_id in findings:
            del self.findings[finding_id]
        verdicts = len(self.verdicts)
        self.verdicts = [v for v in self.verdicts if v.finished_at >= until]
        self._verdict_ids = {run: i for run, i in self._verdict_ids.items() if run[5] >= until}
        advice = [r.id for r in self.advice_rows.values() if r.state not in KEPT_ADVICE and r.updated_at < until]
        for advice_id in advice:
            del self.advice_rows[advice_id]
        claims = [k for k, v in self.claims.items() if k.startswith(EXPIRING_CLAIMS) and v < until]
        for key in claims:
            del self.claims[key]
        return (events - len(self.events) + len(gone) + len(findings) + verdicts - len(self.verdicts)
                + len(advice) + len(claims))

    def _next_id(self, table: str) -> int:
        """The next id of `table`: one past the last given, whatever retention removed since (an old notice or link
        to an id must not name another row)."""
        self._last_ids[table] += 1
        return self._last_ids[table]

    async def record_verdict(self, verdict: NewVerdict) -> int:
        run = tuple(verdict.run.values())
        if (kept := self._verdict_ids.get(run)) is not None:  # once per run, as the database keeps them
            return kept
        self.verdicts.append(replace(verdict, details=jsonable(verdict.details)))
        self._verdict_ids[run] = self._next_id("verdicts")
        return self._verdict_ids[run]

    async def record_advice(self, items: Sequence[NewAdvice], now: float) -> list[AdviceRecord]:
        out = []
        for item in items:
            change = jsonable(item.change)
            row = next((r for r in self.advice_rows.values()
                        if (r.kind, r.pool, r.state) == (item.kind, item.pool, "open")), None)
            if row is not None and row.change != change:
                self.advice_rows[row.id] = replace(row, state="superseded", updated_at=now)
                row = None
            rid = row.id if row is not None else self._next_id("advice")
            created = row.created_at if row is not None else now
            fresh = AdviceRecord(rid, item.kind, item.pool, item.act, item.advice, change, item.metric, item.before,
                                 item.predicted, item.saving_per_day, item.confidence, jsonable(item.evidence), "open",
                                 created, now)
            self.advice_rows[rid] = fresh
            out.append(fresh)
        return out

    async def advice(self, states: Collection[str] | None = None) -> list[AdviceRecord]:
        return [r for _, r in sorted(self.advice_rows.items(), reverse=True) if states is None or r.state in states]

    async def follow_advice(self, advice_id: int, now: float) -> None:
        row = self.advice_rows.get(advice_id)
        if row is None or row.state != "open":
            raise StoreConflict(f"advice {advice_id} is not open")
        self.advice_rows[advice_id] = replace(row, state="followed", applied_at=now, updated_at=now)

    async def unfollow_advice(self, advice_id: int, now: float) -> None:
        row = self.advice_rows.get(advice_id)
        if row is None or row.state != "followed":
            raise StoreConflict(f"advice {advice_id} is not followed")
        if any(r.kind == row.kind and r.pool == row.pool and r.state == "open" for r in self.advice_rows.values()):
            self.advice_rows[advice_id] = replace(row, state="superseded", updated_at=now)
        else:
            self.advice_rows[advice_id] = replace(row, state="open", applied_at=None, updated_at=now)

    async def score_advice(self, advice_id: int, measured: float, error: float | None, now: float) -> None:
        row = self.advice_rows.get(advice_id)
        if row is None or row.state != "followed":
            raise StoreConflict(f"advice {advice_id} is not followed")
        self.advice_rows[advice_id] = replace(row, state="applied", updated_at=now, measured=measured, error=error)

    async def pause_state(self) -> Pause | None:
        return self.pause

    async def claim(self, key: str, value: float, stale_before: float) -> tuple[float, bool]:
        claim_key(key)  # as long as the database's column holds
        held = self.claims.get(key)
        if held is not None and held >= stale_before:
            return held, False
        self.claims[key] = value
        return value, True

    # findings --------------------------------------------------------------------------------

    async def open_findings(self) -> list[FindingRecord]:
        return [f for f in self.findings.values() if f.state == "open"]

    async def open_finding(self, finding: NewFinding, now: float) -> FindingRecord:
        if any(f.kind == finding.kind and f.subject == finding.subject for f in await self.open_findings()):
            raise StoreConflict(f"open_finding: a {finding.kind} finding on {finding.subject} is open already")
        row = FindingRecord(self._next_id("findings"), finding.kind, finding.subject, "open", finding.severity,
                            finding.summary, finding.cause, jsonable(finding.evidence), finding.runbook, now, now, None)
        self.findings[row.id] = row
        return row

    async def update_finding(self, finding_id: int, finding: NewFinding, now: float) -> None:
        row = self.findings.get(finding_id)
        if row is None or row.state != "open":
            return
        self.findings[finding_id] = replace(row, severity=finding.severity, summary=finding.summary,
                                            cause=finding.cause, evidence=jsonable(finding.evidence), updated_at=now)

    async def resolve_finding(self, finding_id: int, reason: str, now: float) -> None:
        row = self.findings[finding_id]
        if row.state == "open":
            self.findings[finding_id] = replace(row, state="resolved", resolved_at=now, updated_at=now)
            self.resolve_reasons[finding_id] = reason

    async def finding(self, finding_id: int) -> FindingRecord | None:
        return self.findings.get(finding_id)

    # actions ---------------------------------------------------------------------------------

    async def create_action(self, action: NewAction, now: float) -> ActionRecord:
        if any(a.pool == action.pool and a.kind == action.kind and a.state in ACTIVE_STATES
               for a in self.action_rows.values()):
            raise StoreConflict(f"create_action: an active {action.kind} action on {action.pool} exists already")
        row = ActionRecord(self._next_id("actions"), action.finding_id, action.kind, action.pool,
                           jsonable(action.params), action.mode, ActionState.PROPOSED, action.reason, now, None, None,
                           None)
        self.action_rows[row.id] = row
        self.events.append(ActionEvent(row.id, now, str(ActionState.PROPOSED),
                                       {"reason": action.reason, **jsonable(action.params)}))
        return row

    async def transition(self, action_id: int, expected: ActionState | Collection[ActionState], to: ActionState,
                         now: float, detail: dict[str, Any] | None = None, **fields: Any) -> ActionRecord:
        froms = expected_states(expected)
        check_transition(froms, to)
        row = self.action_rows.get(action_id)
        if row is None:
            raise ActionNotFound(action_id)
        if row.state not in froms:
            raise ActionConflict(action_id, " or ".join(map(str, froms)), str(row.state))
        stamps: dict[str, Any] = {}
        if to is ActionState.STARTED:
            stamps["started_at"] = now
        elif to is not ActionState.APPROVED:
            stamps["finished_at"] = now
        row = replace(row, state=to, **stamps, **fields)
        self.action_rows[action_id] = row
        self.events.append(ActionEvent(action_id, now, str(to), jsonable(detail or {})))
        return row

    async def decide(self, action_id: int, *, approve: bool, by: str, now: float, via: str,
                     ttl: float | None = None) -> ActionRecord:
        row = self.action_rows.get(action_id)
        if row is None:
            raise ActionNotFound(action_id)
        if ttl is not None and now - row.created_at >= ttl:
            raise ActionConflict(action_id, str(ActionState.PROPOSED), "expired")
        to = ActionState.APPROVED if approve else ActionState.REJECTED
        return await self.transition(action_id, ActionState.PROPOSED, to, now, {"by": by, "via": via}, approved_by=by)

    async def actions(self, *, states: Collection[ActionState] | None = None, since: float | None = None,
                      pool: str | None = None) -> list[ActionRecord]:
        return [a for a in self.action_rows.values()
                if (states is None or a.state in states) and (since is None or a.created_at >= since)
                and (pool is None or a.pool == pool)]

    async def recent_actions(self, since: float) -> list[ActionRecord]:
        return [a for a in self.action_rows.values() if a.created_at >= since or a.state in ACTIVE_STATES]

    async def awaiting_outcome(self, finished_before: float) -> list[ActionRecord]:
        return [a for a in self.action_rows.values() if a.state in SCORED_STATES and a.outcome is None
                and a.finished_at is not None and a.finished_at <= finished_before]

    async def note(self, action_id: int, event: str, now: float, detail: dict[str, Any]) -> None:
        self.events.append(ActionEvent(action_id, now, event, jsonable(detail)))

    async def record_outcome(self, action_id: int, outcome: str, now: float, detail: dict[str, Any]) -> None:
        if self.action_rows[action_id].outcome is not None:
            raise ActionConflict(action_id, "awaiting its outcome", "judged already")
        self.action_rows[action_id] = replace(self.action_rows[action_id], outcome=outcome)
        self.outcome_at[action_id] = now
        self.events.append(ActionEvent(action_id, now, f"outcome:{outcome}", jsonable(detail)))

    def action_events(self, action_id: int) -> list[ActionEvent]:
        """An action's audit log, oldest first."""
        return [e for e in self.events if e.action_id == action_id]

    async def audit_log(self, action_id: int) -> list[ActionEvent]:
        return self.action_events(action_id)
