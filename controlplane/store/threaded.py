"""The SQL store for the event loop: each call runs on the store's own thread, in call order.

One thread keeps SQLite's single writer uncontended and the calls of one tick in the order the
loop made them, while the event loop goes on scraping and serving the API.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from collectors.types import Signal, Target, TargetHealth
from controlplane.actions import ActionState
from controlplane.store.compaction import CompactionReport, Retention
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
from controlplane.store.writer import SqlStore

__all__ = ["ThreadedStore"]

T = TypeVar("T")


class ThreadedStore:
    """`Store` over a `SqlStore`, off the event loop."""

    def __init__(self, sql: SqlStore) -> None:
        self.sql = sql
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(fn, *args, **kwargs))

    @classmethod
    def open(cls, url: str) -> ThreadedStore:
        """Open the SQL store at `url` (see `SqlStore.open`) for use from the event loop."""
        return cls(SqlStore.open(url))

    def close(self) -> None:
        """Finish pending calls, stop the store's thread and close the SQL store."""
        self._thread.shutdown(wait=True)
        self.sql.close()

    async def write_signals(self, signals: Sequence[Signal]) -> int:
        return await self._run(self.sql.write_signals, signals)

    async def load_signals(self, since: float, names: Iterable[str] | None = None,
                           until: float | None = None) -> list[Signal]:
        return await self._run(self.sql.load_signals, since, names, until)

    async def record_targets(self, results: Iterable[tuple[Target, TargetHealth, bool, float]],
                             live: Collection[str] | None = None) -> None:
        await self._run(self.sql.record_targets, list(results), None if live is None else list(live))

    async def open_findings(self) -> list[FindingRecord]:
        return await self._run(self.sql.open_findings)

    async def open_finding(self, finding: NewFinding, now: float) -> FindingRecord:
        return await self._run(self.sql.open_finding, finding, now)

    async def update_finding(self, finding_id: int, finding: NewFinding, now: float) -> None:
        await self._run(self.sql.update_finding, finding_id, finding, now)

    async def resolve_finding(self, finding_id: int, reason: str, now: float) -> None:
        await self._run(self.sql.resolve_finding, finding_id, reason, now)

    async def finding(self, finding_id: int) -> FindingRecord | None:
        return await self._run(self.sql.finding, finding_id)

    async def create_action(self, action: NewAction, now: float) -> ActionRecord:
        return await self._run(self.sql.create_action, action, now)

    async def transition(self, action_id: int, expected: ActionState | Collection[ActionState], to: ActionState,
                         now: float, detail: dict[str, Any] | None = None, **fields: Any) -> ActionRecord:
        return await self._run(self.sql.transition, action_id, expected, to, now, detail, **fields)

    async def decide(self, action_id: int, *, approve: bool, by: str, now: float, via: str,
                     ttl: float | None = None) -> ActionRecord:
        return await self._run(self.sql.decide, action_id, approve=approve, by=by, now=now, via=via, ttl=ttl)

    async def actions(self, *, states: Collection[ActionState] | None = None, since: float | None = None,
                      pool: str | None = None) -> list[ActionRecord]:
        return await self._run(self.sql.actions, states=states, since=since, pool=pool)

    async def recent_actions(self, since: float) -> list[ActionRecord]:
        return await self._run(self.sql.recent_actions, since)

    async def awaiting_outcome(self, finished_before: float) -> list[ActionRecord]:
        return await self._run(self.sql.awaiting_outcome, finished_before)

    async def note(self, action_id: int, event: str, now: float, detail: dict[str, Any]) -> None:
        await self._run(self.sql.note, action_id, event, now, detail)

    async def audit_log(self, action_id: int) -> list[ActionEvent]:
        return await self._run(self.sql.action_events, action_id)

    async def record_outcome(self, action_id: int, outcome: str, now: float, detail: dict[str, Any]) -> None:
        await self._run(self.sql.record_outcome, action_id, outcome, now, detail)

    async def compact(self, now: float, retention: Retention) -> CompactionReport:
        # A step a call: the loop's writes, queued on the same thread, go in between the steps of a long catch-up.
        report = await self._run(self.sql.compact, now, retention, 1)
        while not report.done:
            report = report + await self._run(self.sql.compact, now, retention, 1)
        return report

    async def record_verdict(self, verdict: NewVerdict) -> int:
        return await self._run(self.sql.record_verdict, verdict)

    async def record_advice(self, items: Sequence[NewAdvice], now: float) -> list[AdviceRecord]:
        return await self._run(self.sql.record_advice, items, now)

    async def advice(self, states: Collection[str] | None = None) -> list[AdviceRecord]:
        return await self._run(self.sql.advice, states)

    async def follow_advice(self, advice_id: int, now: float) -> None:
        await self._run(self.sql.follow_advice, advice_id, now)

    async def unfollow_advice(self, advice_id: int, now: float) -> None:
        await self._run(self.sql.unfollow_advice, advice_id, now)

    async def score_advice(self, advice_id: int, measured: float, error: float | None, now: float) -> None:
        await self._run(self.sql.score_advice, advice_id, measured, error, now)

    async def pause_state(self) -> Pause | None:
        return await self._run(self.sql.pause_state)

    async def claim(self, key: str, value: float, stale_before: float) -> tuple[float, bool]:
        return await self._run(self.sql.claim, key, value, stale_before)
