"""The store as the loop, the HTTP server and the CLI use it: one protocol, three implementations.

`SqlStore` (`writer.py`) is the SQL implementation and runs its statements where it is called;
`ThreadedStore` (`threaded.py`) gives the event loop the same calls off its thread, so a slow
database never stalls a tick's scrapes; `MemoryStore` (`memory.py`) keeps everything in memory
for tests, with the same rules (one open finding per kind and subject, one active action per
pool and kind, conditional transitions).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, Protocol

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

__all__ = ["MAX_CLAIM_KEY", "Store", "claim_key"]

MAX_CLAIM_KEY = 58  # `store_meta` keys are 64 characters, of which `claim:` takes 6


def claim_key(key: str) -> str:
    """A claim's `store_meta` key; ValueError for one longer than the column holds."""
    if len(key) > MAX_CLAIM_KEY:
        raise ValueError(f"claim key {key[:20]!r}... is {len(key)} characters; at most {MAX_CLAIM_KEY} are kept")
    return f"claim:{key}"


class Store(Protocol):
    """What the control loop and the HTTP server call; every method is a coroutine.

    Raises StoreUnavailable when the database cannot be reached, StoreConflict when it refuses a
    write (ActionConflict when an action is not in the expected state), ActionNotFound for an
    unknown action id.
    """

    async def write_signals(self, signals: Sequence[Signal]) -> int:
        """Insert signals; a repeat of an existing point is ignored. Returns how many were given."""
        ...

    async def load_signals(self, since: float, names: Iterable[str] | None = None,
                           until: float | None = None) -> list[Signal]:
        """Raw signals at or after `since` (and at or before `until`), oldest first."""
        ...

    async def record_targets(self, results: Iterable[tuple[Target, TargetHealth, bool, float]],
                             live: Collection[str] | None = None) -> None:
        """Upsert each target's latest health: (target, health, up, scraped_at); with `live`, the keys of every target
        there is now, forget the others (pods gone, pools removed)."""
        ...

    async def open_findings(self) -> list[FindingRecord]:
        """Every finding that is open now."""
        ...

    async def open_finding(self, finding: NewFinding, now: float) -> FindingRecord:
        """Open a finding; StoreConflict if one of its kind and subject is open already."""
        ...

    async def update_finding(self, finding_id: int, finding: NewFinding, now: float) -> None:
        """Refresh an open finding's severity, summary, cause and evidence."""
        ...

    async def resolve_finding(self, finding_id: int, reason: str, now: float) -> None:
        """Close a finding; its incident ends."""
        ...

    async def finding(self, finding_id: int) -> FindingRecord | None:
        """One finding by id."""
        ...

    async def create_action(self, action: NewAction, now: float) -> ActionRecord:
        """Record a proposed action and its first audit event; StoreConflict if one of its pool and kind is active."""
        ...

    async def transition(self, action_id: int, expected: ActionState | Collection[ActionState], to: ActionState,
                         now: float, detail: dict[str, Any] | None = None, **fields: Any) -> ActionRecord:
        """Move an action from one of `expected` to `to`, with its audit event; ActionConflict if it moved first."""
        ...

    async def decide(self, action_id: int, *, approve: bool, by: str, now: float, via: str,
                     ttl: float | None = None) -> ActionRecord:
        """Approve or reject a proposed action on behalf of `by` (through `via`: cli, api, dashboard); not one that has
        waited `ttl` since it was proposed (ActionConflict, as expired)."""
        ...

    async def actions(self, *, states: Collection[ActionState] | None = None, since: float | None = None,
                      pool: str | None = None) -> list[ActionRecord]:
        """Actions filtered by state, creation time and pool, oldest first."""
        ...

    async def recent_actions(self, since: float) -> list[ActionRecord]:
        """Actions created since `since`, plus any older one that has not finished."""
        ...

    async def awaiting_outcome(self, finished_before: float) -> list[ActionRecord]:
        """Actions to score (`actions.SCORED_STATES`) whose outcome is not judged yet and whose verify time has come."""
        ...

    async def note(self, action_id: int, event: str, now: float, detail: dict[str, Any]) -> None:
        """Add an event to an action's audit log without moving it (progress of a change that waits)."""
        ...

    async def audit_log(self, action_id: int) -> list[ActionEvent]:
        """An action's audit log, oldest first."""
        ...

    async def record_outcome(self, action_id: int, outcome: str, now: float, detail: dict[str, Any]) -> None:
        """Write the measured outcome of a finished action, once (ActionConflict where it has one)."""
        ...

    async def compact(self, now: float, retention: Retention) -> CompactionReport:
        """Roll up and expire signals."""
        ...

    async def record_verdict(self, verdict: NewVerdict) -> int:
        """Keep a canary gate's verdict; returns its id."""
        ...

    async def record_advice(self, items: Sequence[NewAdvice], now: float) -> list[AdviceRecord]:
        """Keep recommendations: one open per kind and pool, superseded when the advice changes."""
        ...

    async def advice(self, states: Collection[str] | None = None) -> list[AdviceRecord]:
        """Stored recommendations (in these states), newest first."""
        ...

    async def follow_advice(self, advice_id: int, now: float) -> None:
        """Mark an open recommendation followed: the fleet runs the way it advised from `now` on."""
        ...

    async def unfollow_advice(self, advice_id: int, now: float) -> None:
        """A followed recommendation the fleet no longer runs (changed back before it was scored): open again, or
        superseded where newer advice of its kind for its pool is open."""
        ...

    async def score_advice(self, advice_id: int, measured: float, error: float | None, now: float) -> None:
        """Mark a followed recommendation applied, with the metric measured after it and the error."""
        ...

    async def pause_state(self) -> Pause | None:
        """The kill switch: set (who, why, when) or None."""
        ...

    async def claim(self, key: str, value: float, stale_before: float) -> tuple[float, bool]:
        """The value claimed under `key` (at most `MAX_CLAIM_KEY` characters), the same for every replica: the one recorded unless
        it is under `stale_before`, else `value`, recorded; and whether this call recorded it (of racing replicas,
        exactly one does)."""
        ...
