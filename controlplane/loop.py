"""The control loop: one tick scrapes, derives, stores, detects, sizes the pools, and acts through the rails.

The same tick serves the live fleet, the simulator, replays and tests; only the target source,
the actuator and the clock differ. Every action is written to the audit log before and after
it runs, so a killed process leaves an action either finished or visibly `started`, which the
next start marks `unknown` instead of retrying it blindly.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from collectors.types import Signal, TargetHealth
from controlplane.actions import FINISHED_STATES, ActionState
from controlplane.actuators.base import Actuator, FleetView, Order, PoolReplicas, Releases
from controlplane.clock import Clock
from controlplane.config import FleetConfig, Mode, Rails
from controlplane.errors import ActionConflict, ActionNotFound, ActuationError, FleetError, StoreConflict
from controlplane.killswitch import KillSwitch, NeverPaused
from controlplane.observe import MetricSource, Observation, ScrapeSource
from controlplane.rails import (
    REVERT_WAITS,
    WAIT_REASONS,
    RailsDecision,
    RailsReason,
    check,
    recheck,
    rests_on,
    revert_of,
)
from controlplane.store.base import Store
from controlplane.store.compaction import Retention
from controlplane.store.records import ActionEvent, ActionRecord, FindingRecord, NewAction, NewFinding, NewVerdict
from controlplane.telemetry import Telemetry
from policies.autoscale import (
    DESIRED,
    FORECAST,
    GANG,
    READY,
    ROLLING,
    STARTUP,
    TARGET,
    PoolPlan,
    Sizer,
    plan_each,
    slo_broken_minutes,
    whole_minute,
)
from policies.inputs import KIND as STALE_KIND
from policies.inputs import VANISH_WATCH, stale_among, stopped_or_frozen
from policies.settling import stalled_since
from policies.types import (
    ActionKind,
    Change,
    FindingKey,
    FindingReport,
    OpenFinding,
    Policy,
    PolicyInput,
    PoolState,
    Proposal,
    change_as_dict,
    change_from_dict,
)
from policies.windows import HISTORY_S, SignalWindows, by_minute

__all__ = ["INEFFECTIVE", "ControlLoop", "TickReport"]

INEFFECTIVE = "action_ineffective"  # the finding opened on an action whose signal did not improve

log = logging.getLogger(__name__)

# An action improved things when its verify signal moved at least this much the right way.
IMPROVEMENT = 0.10
# Points of its verify signal after an action that its outcome is judged on, at least.
VERIFY_POINTS = 3
# Proposals a person turned down or let lapse: scored all the same, on how the fleet fared without them.
_DECLINED = frozenset({ActionState.REJECTED, ActionState.EXPIRED})


@dataclass(slots=True)
class TickReport:
    """What one tick did, for progress displays and tests."""

    ts: float
    targets: int = 0
    targets_up: int = 0
    signals: int = 0
    opened: list[FindingRecord] = field(default_factory=list)
    updated: list[FindingRecord] = field(default_factory=list)  # as refreshed this tick
    resolved: list[FindingRecord] = field(default_factory=list)
    actions: list[ActionRecord] = field(default_factory=list)
    held: list[tuple[Proposal, RailsReason, str]] = field(default_factory=list)
    outcomes: list[tuple[int, str]] = field(default_factory=list)
    plans: list[PoolPlan] = field(default_factory=list)  # what the sizer would set each pool to
    errors: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0


class ControlLoop:
    """Connects a metric source, the store, the policies and an actuator."""

    def __init__(
        self,
        *,
        config: FleetConfig,
        source: MetricSource,
        store: Store,
        policies: Sequence[Policy],
        actuator: Actuator,
        clock: Clock,
        telemetry: Telemetry,
        switch: KillSwitch | None = None,
        leading: Callable[[], bool] | None = None,
        term: Callable[[], int] | None = None,
        sizer: Sizer | None = None,
    ) -> None:
        self.config = config
        self.sizer = sizer  # the one component that sets replica counts, if any
        self.source = source
        self.store = store
        self.policies = list(policies)
        self.actuator = actuator
        self.clock = clock
        self.telemetry = telemetry
        self.switch: KillSwitch = switch or NeverPaused()
        # Whether this replica leads (asked before every change); a lone control plane always does. And its term:
        # leadership lost and won back is a new one, in which another leader may have taken over what this one
        # started, so the loop acts only in the term it took over in (`start`).
        self.leading: Callable[[], bool] = leading or (lambda: True)
        self.term: Callable[[], int] = term or (lambda: 0)
        self._term = 0
        self.windows = SignalWindows(HISTORY_S)
        self.changed_at: dict[str, float] = {}
        self._router_template: str | None = None  # the router's pod template digest, as last read
        self._last_replicas: dict[str, PoolReplicas] = {}  # as last read: an unreadable pool keeps them
        # Changes this process started that wait (an engine draining), by action id.
        self._waiting: dict[int, tuple[Order, dict[str, Any]]] = {}
        self._unnoted: set[int] = set()  # waits whose note the store refused: noted again next tick
        self._unkept: list[NewVerdict] = []  # gate verdicts the store refused: written again next tick
        # Whether a revert a take-over cancelled may lack its new record (a take-over began; this process is new).
        self._reverts_unsure = True
        self._took_over_at: float | None = None  # when `start` last observed, to take actions over
        # Ends of started actions the store refused to record, kept to be written next tick: kind, state, detail,
        # error, when it ended.
        self._unrecorded: dict[int, tuple[str, ActionState, dict[str, Any], str | None, float]] = {}
        # Pools whose waiting change finished this tick (its pods deleted or evicted just now): the fleet read at the
        # tick's start does not show them unsettled yet, and no other disruptive change may start beside them.
        self._finished_now: list[str] = []
        self.last_tick_at: float | None = None
        # The take-over or tick in progress and when it began (None between them): one that never ends (a store query
        # hung on a half-open connection) fails the liveness probe, so that the pod restarts and another replica leads.
        self.busy: tuple[str, float] | None = None
        self._last_compaction: float | None = None
        self._target_state: dict[str, tuple[bool, str | None]] = {}
        self._live_targets: set[str] | None = None
        self._missing: dict[str, list[str]] = {}
        self._derived: list[Signal] = []  # replica counts and plans of this tick, stored once it has planned
        # Per pool, this tick's inputs not fit to act on (a target down, a series absent), with why.
        self._unfit: dict[str, dict[str, str]] = {}
        # When each pool signal last had a value: one stopped for longer than the history is still stopped, not unknown.
        self._last_seen: dict[tuple[str, str], float] = {}
        # The ticks at which each of a pool's inputs was unfit to act on (its stale-input key; "" for the pool
        # unreadable), over the history: an outcome is judged on points from after the inputs it rests on were whole.
        self._unfit_at: dict[tuple[str, str], list[float]] = {}
        # Per pool, the engine pods whose /metrics answered this tick (down once is noise), when scraped here.
        self._answering: dict[str, set[str]] = {}
        # Called with every finished tick's report (alert delivery); its failures never stop the loop.
        self.on_report: Callable[[TickReport], Awaitable[None]] | None = None
        # Called at every take-over with the findings open then (alert delivery learns what another leader left
        # firing); inside the take-over, so a store that hangs there fails the liveness probe like any take-over read.
        self.on_take_over: Callable[[list[FindingRecord], float], None] | None = None

    async def start(self) -> None:
        """Take over: reload the policy windows, then finish or account for every action a stopped
        control plane left started, so none is lost and none is carried out twice."""
        self.busy = ("taking over", self.clock.now())
        try:
            await self._start()
        finally:
            self.busy = None

    async def _start(self) -> None:
        self._term = self.term()
        now = self.clock.now()
        # Ends this replica knows but the store refused are written first (one another leader moved meanwhile is
        # skipped); whatever waited, or is still unrecorded, is then taken over from the audit log.
        try:
            for action_id, (_, _, _, _, at) in list(self._unrecorded.items()):
                # Another leader took it over meanwhile (it redid it, or waits on it): its record, not this one's.
                if any(e.ts > at for e in await self.store.audit_log(action_id)):
                    del self._unrecorded[action_id]
            await self._record_unrecorded()
        except FleetError as exc:
            # Taken over without them, their actions would be redone or marked unknown, and the ends (what a revert
            # is derived from) lost: the whole take-over is tried again once the store answers.
            log.warning("ends of %d action(s) not recorded before taking over: %s", len(self._unrecorded), exc)
            raise
        self._waiting.clear()
        self._unnoted.clear()
        # Another leader may have written the targets meanwhile: all of them are written again at the first tick.
        self._target_state.clear()
        if isinstance(self.source, ScrapeSource):  # and recorded the restarts it scraped
            self.source.deriver.new_term()
        self._live_targets = None
        self._unrecorded.clear()
        self._finished_now = []  # of the last tick this replica led, maybe long ago
        self._took_over_at = None
        # Another leader may have cancelled a revert since this replica last led, and not recorded it again.
        self._reverts_unsure = True
        signals = await self.store.load_signals(now - HISTORY_S)
        self.windows.extend((s.ts, s.subject, s.name, s.value) for s in signals)
        self.windows.rewind(now)  # points stamped by a clock ahead of this one would keep every new point out
        # A pool signal that stopped before the history began is known stopped only by the finding that says so: it
        # stopped before that opened. Without this, a new leader would read it as never had, and act.
        open_findings = await self.store.open_findings()
        if self.on_take_over is not None:
            self.on_take_over(open_findings, now)
        for f in open_findings:
            if f.kind == STALE_KIND and isinstance(inputs := f.evidence.get("inputs"), dict):
                pool = f.subject.removeprefix("pool/")
                for name in set(inputs) & set(VANISH_WATCH):
                    if self.windows.latest_ts(f.subject, name) is None:
                        self._last_seen.setdefault((pool, name), f.opened_at)
        started = await self.store.actions(states=[ActionState.STARTED])
        pools: dict[str, PoolState] = {}
        if started:
            # A redo is checked against the fleet as it is now, numbers included: observed here first, not read from
            # a tick this replica ran before it last lost leadership (or from none, on a fresh start).
            self._unfit, self._answering = {}, {}
            try:
                await self._observe(now, TickReport(ts=now))
                self._took_over_at = now
                unobserved = None
            except FleetError as exc:
                unobserved = f"not observed since taking over ({exc})"
            pools = await self._pools(now, TickReport(ts=now))
            if unobserved is not None:
                pools = {name: replace(p, unreadable=p.unreadable or unobserved) for name, p in pools.items()}
        for action in started:
            if not self._leads():  # the Lease was lost during the slow reads above: the new leader takes over
                return
            await self._take_over(action, now, pools)

    async def _take_over(self, action: ActionRecord, now: float, pools: dict[str, PoolState]) -> None:
        """Finish, redo or account for one started action nobody here carries out (`start`, `_adopt_strays`); one
        that moved meanwhile (the last leader's tick, which always finishes, recorded its end) is left as it is."""
        try:
            await self._take_over_one(action, now, pools)
        except ActionConflict as exc:
            log.info("action %d moved while it was taken over: %s", action.id, exc)

    async def _take_over_one(self, action: ActionRecord, now: float, pools: dict[str, PoolState]) -> None:
        try:
            change = change_from_dict(action.params["change"])
        except (KeyError, TypeError, ValueError):  # a row from before changes were typed
            await self._unknown(action, now, "its change is not recorded in a form that can be checked")
            return
        order = self._with_engines(_order(action, change))
        waits = [e.detail["wait"] for e in await self.store.audit_log(action.id) if e.event == "waiting"]
        if waits and self.config.mode is Mode.OBSERVE and waits[-1].get("then") != "verify":
            # Its next step (a scale, an eviction) changes the fleet, which observe mode never does: ended as a
            # change not redone is, what it began undone. One that only checks its pods went is watched to its end.
            await self.store.transition(action.id, ActionState.STARTED, ActionState.CANCELLED, now,
                                        {"why": "taken over in observe mode, which carries no change further",
                                         "rails": str(RailsReason.OBSERVE_MODE)})
            self.telemetry.actions.labels(action.kind, "cancelled").inc()
            await self._release(order, now)
            return
        if waits:  # it was waiting (an engine draining): wait on, from where the audit log says it was
            self._waiting[action.id] = (order, waits[-1])
            await self.store.note(action.id, "taken_over", now, {"resumes": waits[-1]})
            return
        try:
            applied = await self.actuator.applied(order)
        except ActuationError as exc:
            applied, why = None, str(exc)
        else:
            why = f"the {self.actuator.name} actuator cannot tell whether it was applied"
        if applied is None:
            await self._unknown(action, now, why)
            await self._release(order, now)
        elif applied is not False:
            # What the change reported when it was made, where the fleet kept it: a revert is derived from it.
            await self.store.transition(action.id, ActionState.STARTED, ActionState.SUCCEEDED, now,
                                        {**(applied if isinstance(applied, Mapping) else {}),
                                         "taken_over": "the fleet carries this action's id: applied before the stop, "
                                                       "not repeated"})
            self.telemetry.actions.labels(action.kind, "succeeded").inc()
        else:
            paused = await self.switch.paused()
            decision = (await self._redo(action, now, pools) if paused is None else
                        RailsDecision(RailsReason.PAUSED, None, f"acting is paused ({paused})"))
            if decision.reason is not RailsReason.ALLOWED or decision.change is None:
                # Known not to have happened, and the fleet or the rules moved since: cancelled, as an approval the
                # rails stop when it is due (it never ran, so no cooldown follows it), and whatever still needs doing
                # is proposed again from fresh numbers. Nothing proposes a revert again: one held only for now is
                # recorded to wait afresh, as a judging records one.
                why = f"not applied before the stop, and not redone: {decision.note}"
                self._reverts_unsure = True  # until `_recover_reverts` has seen it recorded again
                await self.store.transition(action.id, ActionState.STARTED, ActionState.CANCELLED, now,
                                            {"why": why, "rails": str(decision.reason)})
                self.telemetry.actions.labels(action.kind, "cancelled").inc()
                await self._release(order, now)
                if "reverts" in action.params and decision.reason in REVERT_WAITS:
                    await self._revert_again(action, change, decision, now, pools)
                return
            if not self._leads():
                return
            # Judged against the state it is redone from, read now as its rails were: the stopped leader's may be from
            # long before, and the signal moved meanwhile on its own.
            await self.store.note(action.id, "taken_over", now, {
                "redo": "not applied before the stop",
                "verify_before": self._recent_mean(action.pool, action.params.get("verify_signal"), points=2)})
            if not self._leads():  # lost while the note was written: the next leader takes it over
                return
            order = replace(order, change=decision.change)
            await self._run(order, self.actuator.carry_out(order), now, TickReport(ts=now))
            # Done or waiting, it changed the fleet this tick, which the pools read at its start do not show: no other
            # disruptive change starts beside it (a wait stays started, and holds them as any started action does).
            self._finished_now += ([p.name for p in self.config.pools] if order.kind is ActionKind.CORDON_NODE
                                   else [order.pool])

    def _changing(self, pools: dict[str, PoolState], history: Sequence[ActionRecord], now: float) -> list[str]:
        """The pools mid-change for the rails' one-pool-at-a-time rule: unsettled ones, and those a wait left this tick."""
        return [*_unsettled(pools, history, now, self.config.rails.settle_timeout), *self._finished_now]

    async def _revert_again(self, action: ActionRecord, change: Change, held: RailsDecision, now: float,
                            pools: dict[str, PoolState]) -> None:
        """Record a revert a take-over could not redo now, to wait as an approval waits (`_ineffective`)."""
        p = action.params
        if self.config.mode is Mode.OBSERVE or action.pool not in pools:
            return
        proposal = Proposal(ActionKind(action.kind), action.pool, change, action.reason.split("; rails: ")[0],
                            verify_signal=p.get("verify_signal"),
                            verify_lower_is_better=p.get("verify_lower_is_better", True),
                            inputs=tuple(p.get("inputs", ())))
        waits = RailsDecision(RailsReason.ALLOWED if self.config.mode is Mode.ACT else RailsReason.NEEDS_APPROVAL,
                              change, f"waits: {held.note}")
        try:
            revert = await self._record(proposal, waits, action.finding_id, now, pools, TickReport(ts=now),
                                        extra={"reverts": p["reverts"]})
        except StoreConflict:  # an action of its kind on the pool is active (awaiting a person, say)
            why = f"a {action.kind} on {action.pool} is active already; undo it by hand"
            log.warning("action %d: its revert is not recorded again: %s", action.id, why)
            await self.store.note(action.id, "taken_over", now, {"revert_held": why})
            return
        await self.store.note(action.id, "taken_over", now, {"reverting_as": revert.id})

    async def _redo(self, action: ActionRecord, now: float, pools: dict[str, PoolState]) -> RailsDecision:
        """Whether an action a stopped control plane started but never applied may still be carried out: the rails
        again, on the pool as it is now, within its time to live (`proposal_ttl`, a revert's `revert_ttl`) of its
        creation, as an approval that was never run."""
        rails = self.config.rails
        setting, ttl = rails.ttl_for(action.params)
        if not -self._ahead <= now - action.created_at < ttl:  # far ahead of now: a clock stepped back
            return RailsDecision(RailsReason.STALE, None, f"created {now - action.created_at:.0f}s ago, past "
                                                          f"{setting} ({ttl:g}s)")
        history = await self.store.recent_actions(since=now - rails.history_s)
        return recheck(action, pools.get(action.pool), mode=self.config.mode, rails=rails, history=history, now=now,
                       supported=self.actuator.kinds,
                       unsettled=self._changing(pools, history, now),
                       router_template=self._router_template)

    async def _release(self, order: Order, now: float) -> None:
        """Undo what a stopped control plane began of a change that is now ended without being carried further
        (engines it took out of routing to drain would run and serve nothing), and say so in its audit log."""
        if not isinstance(self.actuator, Releases):
            return
        try:
            said = {"released": await self.actuator.release(order)}
        except ActuationError as exc:
            log.error("action %d: what it began is not undone: %s", order.action_id, exc)
            said = {"release_failed": str(exc)}
        await self.store.note(order.action_id, "released", now, said)

    async def _unknown(self, action: ActionRecord, now: float, why: str) -> None:
        await self.store.transition(action.id, ActionState.STARTED, ActionState.UNKNOWN, now,
                                    {"why": f"control plane stopped while it ran; {why}"})
        self.telemetry.actions.labels(action.kind, "unknown").inc()

    def _leads(self) -> bool:
        """Whether this replica leads in the term it took over in."""
        return self.leading() and self.term() == self._term

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every scrape interval until `stop` is set or leadership is lost (won back counts as lost: the caller
        takes over again); the current tick always finishes."""
        interval = self.config.scrape.interval
        if self._took_over_at is not None and self._leads():
            # A take-over scraped just now: a tick at once would derive rates over a second or so.
            await self._wait(stop, interval - (self.clock.now() - self._took_over_at))
        while not stop.is_set() and self._leads():
            started = self.clock.now()
            try:
                await self.tick()
            except FleetError as exc:
                # A store outage or similar: report, keep the loop alive, try again next tick.
                self.telemetry.tick_failures.inc()
                log.error("tick failed: %s", exc)
            except Exception:
                # A bug or an untranslated library error must not stop detection for good either.
                self.telemetry.tick_failures.inc()
                log.exception("tick failed")
            await self._wait(stop, interval - (self.clock.now() - started))

    async def _wait(self, stop: asyncio.Event, seconds: float) -> None:
        """Sleep on the loop's clock, cut short when `stop` is set."""
        sleeper = asyncio.ensure_future(self.clock.sleep(max(0.0, seconds)))
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for task in (sleeper, stopper):
            task.cancel()
        await asyncio.gather(sleeper, stopper, return_exceptions=True)

    async def tick(self) -> TickReport:
        """One full pass of the data flow at the clock's current time."""
        self.busy = ("tick", self.clock.now())
        try:
            return await self._tick()
        finally:
            self.busy = None

    async def _tick(self) -> TickReport:
        wall = time.perf_counter()
        now = self.clock.now()
        report = TickReport(ts=now)
        if self.last_tick_at is not None and now < self.last_tick_at:
            # A clock stepped back: the points stamped after now would keep every new one out of the windows (as
            # older), and decisions would rest on them. They go; what the fleet shows from now on counts.
            dropped = self.windows.rewind(now)
            report.errors["clock"] = (f"the clock stepped back {self.last_tick_at - now:.0f}s behind the last tick: "
                                      f"{dropped} point(s) stamped after now dropped")
            log.warning("%s", report.errors["clock"])
        try:
            with self.telemetry.span("tick", ts=now):
                await self._observe(now, report)
                pools = await self._pools(now, report)
                inp, proposals = await self._detect(now, pools, report)
                proposals += await self._size(inp, report)
                await self._store_derived()
                await self._act(now, pools, proposals, report)
                await self._judge_outcomes(now, pools, report)
                await self._compact(now)
        finally:
            # A finding opened or resolved before a later step failed is in the store, and no later tick reports it
            # again: the hook hears what the tick did either way.
            await self._report(report)
        report.duration_s = time.perf_counter() - wall
        self.telemetry.tick_duration.observe(report.duration_s)
        self.telemetry.ticks.inc()
        self.telemetry.last_tick.set(now)
        self.last_tick_at = now
        return report

    async def _report(self, report: TickReport) -> None:
        if self.on_report is not None:
            try:
                await self.on_report(report)
            except Exception:  # a broken hook must not take detection and actions down with it
                log.exception("tick report hook failed")

    # observe ----------------------------------------------------------------------------------

    async def _observe(self, now: float, report: TickReport) -> None:
        with self.telemetry.span("observe"):
            obs = await self.source.observe(now)
        report.targets = len(obs.results)
        report.targets_up = sum(1 for r in obs.results if r.ok)
        report.errors.update(obs.errors)
        for r in obs.results:
            if not (r.ok or r.skipped or r.late):  # the target's own failures; a late one is in the tick's errors
                self.telemetry.scrape_errors.labels(r.target.key).inc()
        for key, errs in obs.parse_errors.items():
            self.telemetry.parse_errors.labels(key).inc(obs.parse_error_counts.get(key, len(errs)))
        late = sum(1 for r in obs.results if r.late)  # neither up nor down: the round had no time for them
        self.telemetry.targets.labels("up").set(report.targets_up)
        self.telemetry.targets.labels("late").set(late)
        self.telemetry.targets.labels("down").set(report.targets - report.targets_up - late)
        with self.telemetry.span("store.signals", signals=len(obs.signals)):
            report.signals = await self.store.write_signals(obs.signals)
        self.telemetry.signals_written.inc(report.signals)
        await self._record_targets(obs, now)
        self._unfit = obs.unfit_inputs([p.name for p in self.config.pools])
        self._answering = obs.answering_engines()
        self.windows.extend((s.ts, s.subject, s.name, s.value) for s in obs.signals)
        self.windows.trim(now)

    async def _record_targets(self, obs: Observation, now: float) -> None:
        changed = []
        for key, families in obs.missing.items():
            if self._missing.get(key) != families:
                self._missing[key] = families
                log.warning("%s: expected but absent: %s", key, ", ".join(families))
        for r in obs.results:
            if r.late:  # not read: no news of the target
                continue
            health = obs.health.get(r.target.key, TargetHealth())
            health.missing_families = obs.missing.get(r.target.key, [])
            state = (r.ok, health.last_error if not r.ok else ",".join(health.missing_families) or None)
            if self._target_state.get(r.target.key) != state:
                # Only changes are written: thousands of unchanged targets cost nothing per tick.
                changed.append(((r.target, health, r.ok, now), state))
        # The targets there are now, when they differ from those last written (and at a take-over, which knows none):
        # the store forgets the others, or the dashboard would count a pool's departed pods as up for good.
        live = {r.target.key for r in obs.results}
        # A leader that lost the Lease mid-tick (a store query hung) knows the targets of then: it forgets none.
        forget = live if live != self._live_targets and self._leads() else None
        if changed or forget is not None:
            await self.store.record_targets([row for row, _ in changed], live=forget)
            # Remembered once written: a change the store refused is written again next tick.
            self._target_state.update((row[0].key, state) for row, state in changed)
            for key in set(self._target_state) - live:
                del self._target_state[key]
            self._live_targets = live

    async def _pools(self, now: float, report: TickReport) -> dict[str, PoolState]:
        """Every pool as the actuator sees it now. A pool whose workload cannot be read keeps its last replicas,
        marked unreadable so that nothing acts on it; detection goes on for it and for every other pool."""
        try:
            view = await self.actuator.observe()
        except Exception as exc:
            if not isinstance(exc, FleetError):
                log.exception("actuator %s raised reading the fleet", self.actuator.name)
            why = str(exc) if isinstance(exc, FleetError) else f"{type(exc).__name__}: {exc}"
            view = FleetView({}, self.changed_at, {p.name: why for p in self.config.pools})
        for name, why in view.unreadable.items():
            report.errors[f"pool {name}"] = f"its workload cannot be read, nothing acts on it: {why}"
        self._last_replicas.update(view.pools)
        # A revision not dated this time (its ReplicaSets could not be listed) keeps its last date: gone for a tick, a
        # failing canary's finding would resolve as a rollout that ended, and its rollback expire.
        self.changed_at = {**self.changed_at, **view.changed_at}
        self._router_template = view.router_template
        # A pool that may scale to zero and is there has no series to stop; one that may not is down, not idle.
        serving = [p.name for p in self.config.pools
                   if p.replicas.min > 0 or (r := self._last_replicas.get(p.name)) is None or r.desired > 0]
        for pool in self.config.pools:
            for name in VANISH_WATCH:
                if (ts := self.windows.latest_ts(f"pool/{pool.name}", name)) is not None:
                    self._last_seen[(pool.name, name)] = ts
        stale = stopped_or_frozen(self.windows, serving, now, self.config.scrape.interval,
                                  self.config.rails.frozen_after, self._last_seen)
        out = {}
        record: list[Signal] = []
        for pool in self.config.pools:
            unreadable = view.unreadable.get(pool.name)
            rep = self._last_replicas.get(pool.name) if unreadable else view.pools.get(pool.name)
            stalled = None if rep is None or unreadable or rep.rolling else self._stalled_for(pool.name, rep, now)
            out[pool.name] = state = PoolState(
                name=pool.name, role=str(pool.role),
                desired=rep.desired if rep else 0, ready=rep.ready if rep else 0,
                min_replicas=pool.replicas.min, max_replicas=pool.replicas.max,
                ttft_p95_slo=pool.slo.ttft_p95, tpot_p95_slo=pool.slo.tpot_p95,
                max_unavailable=rep.max_unavailable if rep else None, gang=rep.gang if rep else 1,
                stale_inputs={**self._unfit.get(pool.name, {}), **stale.get(pool.name, {})},
                unreadable=unreadable, rolling=rep.rolling if rep else False, template=rep.template if rep else None,
                stalled_for=stalled, scaled_by=rep.scaled_by if rep else None,
                expert_parallel=pool.engine.expert_parallel,
                keeps_names=pool.workload is not None and pool.workload.by_ordinal,
            )
            if rep is not None and unreadable is None:
                record += [Signal(now, f"pool/{pool.name}", DESIRED, float(state.desired)),
                           Signal(now, f"pool/{pool.name}", READY, float(state.ready))]
                # `fleetctl autoscale plan` reads it back to plan in whole groups as the loop does.
                record.append(Signal(now, f"pool/{pool.name}", GANG, float(state.gang)))
                record.append(Signal(now, f"pool/{pool.name}", ROLLING, float(state.rolling)))
        # Replica counts are signals too: start-up times are measured from them and the dashboard plots them.
        self._keep(record)
        return out

    def _stalled_for(self, pool: str, rep: PoolReplicas, now: float) -> float | None:
        """How long the pool has been short of ready engines, once that is longer than a start-up takes: the larger
        of `rails.settle_timeout` and three times the pool's last measured start-up (a large model loads for long)."""
        since = stalled_since(self.windows, pool, now, rep.desired, rep.ready, gap=4 * self.config.scrape.interval)
        startup = self.windows.latest(f"pool/{pool}", STARTUP) or 0.0
        if since is None or now - since < max(self.config.rails.settle_timeout, 3 * startup):
            return None
        return now - since

    def _keep(self, signals: list[Signal]) -> None:
        """Add signals the loop derives itself to the windows now (the sizer reads them this tick); they are
        stored with the tick's other derived signals in one write."""
        self.windows.extend((s.ts, s.subject, s.name, s.value) for s in signals)
        self._derived += signals

    async def _store_derived(self) -> None:
        if self._derived:
            await self.store.write_signals(self._derived)
            self._derived = []

    async def _size(self, inp: PolicyInput, report: TickReport) -> list[tuple[int | None, Proposal]]:
        """The sizer's plans, recorded as signals; a plan that changes a pool's size goes to the rails."""
        if self.sizer is None:
            return []
        with self.telemetry.span(f"sizer.{self.sizer.name}"):
            report.plans = self._plans(self.sizer, inp, report)
        self._keep([sig for p in report.plans for sig in (
            Signal(inp.now, f"pool/{p.pool}", TARGET, float(p.recommended)),
            *([Signal(inp.now, f"pool/{p.pool}", FORECAST, float(p.evidence["planned_for"]))]
              if "planned_for" in p.evidence else []),
            *([Signal(inp.now, f"pool/{p.pool}", STARTUP, float(p.evidence["startup_s"]))]
              if p.evidence.get("startup_s") is not None else []))])
        proposals: list[tuple[int | None, Proposal]] = [
            (None, prop) for p in report.plans if (prop := p.proposal()) is not None]
        if proposals and self.config.mode is Mode.OBSERVE:
            # Observing, the fleet never moves, so the same plan would be advised again every cooldown:
            # a pool's advice is written once until its target changes (the target asked for, not the step the
            # rails allow towards it, which never equals a target more than `max_step` away).
            advised = {a.pool: a.params.get("asked_replicas", a.params.get("replicas")) for a in sorted(
                await self.store.recent_actions(since=inp.now - 3600.0), key=lambda a: a.created_at)
                if a.kind == ActionKind.SCALE_POOL and a.finding_id is None and a.state is ActionState.ADVISORY}
            proposals = [(f, p) for f, p in proposals if advised.get(p.pool) != getattr(p.change, "replicas", None)]
        return proposals

    def _plans(self, sizer: Sizer, inp: PolicyInput, report: TickReport) -> list[PoolPlan]:
        """Every pool's plan. A pool whose numbers break the sizer keeps its size, and the failure is logged and
        counted: the other pools are still sized and the rest of the tick (findings, outcomes, other actions) runs."""
        sizing = plan_each(sizer, inp)
        for name, error in sizing.errors().items():
            self.telemetry.sizing_failures.labels(name).inc()
            report.errors[f"sizing {name}"] = error
            log.error("sizer %s failed on pool %s: its size is kept this tick", sizer.name, name,
                      exc_info=sizing.failed[name])
        return sizing.plans

    # detect -----------------------------------------------------------------------------------

    async def _detect(self, now: float, pools: dict[str, PoolState], report: TickReport
                      ) -> tuple[PolicyInput, list[tuple[int | None, Proposal]]]:
        await self._keep_unkept()
        open_rows = {FindingKey(f.kind, f.subject): f for f in await self.store.open_findings()}
        open_view = {k: OpenFinding(k, f.opened_at, f.evidence) for k, f in open_rows.items()}
        inp = PolicyInput(now=now, windows=self.windows, pools=pools, open_findings=open_view, changed_at=self.changed_at)
        proposals: list[tuple[int | None, Proposal]] = []
        for policy in self.policies:
            with self.telemetry.span(f"policy.{policy.kind}"):
                try:
                    result = policy.evaluate(inp)
                except Exception as exc:
                    # One policy that cannot read this tick's numbers must not stop the others, the sizer, the
                    # changes that wait (engines out of routing) or the outcomes; its findings stay as they were.
                    log.exception("policy %s failed", policy.kind)
                    self.telemetry.policy_failures.labels(str(policy.kind)).inc()
                    report.errors[f"policy {policy.kind}"] = f"{type(exc).__name__}: {exc}"
                    continue
            for key, reason in result.resolved:
                row = open_rows.pop(key, None)
                if row is None:
                    continue
                # Its actions expire first: resolved with them still waiting (the store failing in between), the
                # finding would not be reported again, and they would run for a problem that is gone.
                await self._expire(now, "its finding resolved before it ran", functools.partial(_caused_by, row.id))
                await self.store.resolve_finding(row.id, reason, now)
                report.resolved.append(row)
            for finding in result.findings:
                row = open_rows.get(finding.key)
                if row is None:
                    row = await self.store.open_finding(_new_finding(finding), now)
                    open_rows[finding.key] = row
                    report.opened.append(row)
                    if finding.verdict is not None:
                        await self._keep_verdict(finding, finding.verdict)
                else:
                    await self.store.update_finding(row.id, _new_finding(finding), now)
                    row = replace(row, severity=str(finding.severity), summary=finding.summary, cause=finding.cause,
                                  evidence=dict(finding.evidence), updated_at=now)
                    open_rows[finding.key] = row
                    report.updated.append(row)
                # A proposal rests on what its policy reads unless it says otherwise (the rails check them).
                proposals.extend((row.id, p if p.inputs else replace(p, inputs=policy.reads)) for p in finding.proposals)
        for key, row in list(open_rows.items()):  # the loop's own findings: no policy resolves them
            why = await self._ineffective_over(row) if row.kind == INEFFECTIVE else None
            if why is not None:
                await self.store.resolve_finding(row.id, why, now)
                report.resolved.append(open_rows.pop(key))
        self.telemetry.open_findings.clear()
        for f in open_rows.values():
            self.telemetry.open_findings.labels(f.kind, f.severity).inc()
        return inp, proposals

    async def _keep_verdict(self, finding: FindingReport, v: Mapping[str, Any]) -> None:
        """A finding's gate verdict goes where `fleetctl gate` keeps its own: the dashboard's Canary page. Its finding
        is open already, so the policy will not report it as new again: one the store refuses is kept and written
        at the next tick."""
        self._unkept.append(NewVerdict(
            str(v["gate"]), finding.key.subject.removeprefix("pool/"), str(v["baseline"]), str(v["canary"]),
            float(v["started_at"]), float(v["ended_at"]), str(v["result"]), v.get("score"),
            {**v, "finding": finding.summary}))
        await self._keep_unkept()

    async def _keep_unkept(self) -> None:
        """Write the gate verdicts kept since the store refused them, oldest first; one the store refuses as a row (not
        as a store that is down) is logged and dropped, or every tick after it would stop on it."""
        while self._unkept:
            try:
                await self.store.record_verdict(self._unkept[0])
            except StoreConflict as exc:
                log.error("the canary verdict on %s is not kept: the store refuses it: %s", self._unkept[0].pool, exc)
            self._unkept.pop(0)

    # act --------------------------------------------------------------------------------------

    async def _expire(self, now: float, why: str, which: Callable[[ActionRecord], bool]) -> None:
        """Expire the undecided or not yet run actions `which` selects; one that moved meanwhile is left alone, unless
        only approved (a person deciding as this runs) where `which` selects it approved too: the approval must not
        make it run for a problem that is gone."""
        for action in await self.store.actions(states=[ActionState.PROPOSED, ActionState.APPROVED]):
            if which(action):
                states = [action.state] + ([ActionState.APPROVED] if action.state is ActionState.PROPOSED
                                           and which(replace(action, state=ActionState.APPROVED)) else [])
                try:
                    await self.store.transition(action.id, states, ActionState.EXPIRED, now, {"why": why})
                except ActionConflict:
                    continue
                self.telemetry.actions.labels(action.kind, "expired").inc()

    async def _act(
        self, now: float, pools: dict[str, PoolState], proposals: list[tuple[int | None, Proposal]], report: TickReport
    ) -> None:
        """The single audited path from proposals (and approvals) to the actuator."""
        rails = self.config.rails
        await self._expire(now, "not decided and run within its time to live (rails.proposal_ttl, or revert_ttl for "
                                "an approved revert)", lambda a: not -self._ahead <= now - a.created_at < _ttl(rails, a))
        self._finished_now = []
        await self._approve_orphans(now)
        await self._supersede(now, report)
        await self._record_unrecorded()
        await self._advance_waiting(now, report)
        await self._adopt_strays(now, pools)  # after the waits: one it starts waiting is taken further next tick
        await self._recover_reverts(now, pools)
        history: list[ActionRecord] = await self.store.recent_actions(since=now - rails.history_s)
        paused = await self.switch.paused()
        for finding_id, proposal in proposals:
            decision = self._check(proposal, finding_id, pools, history, now, paused)
            if not decision.may_record or decision.change is None:
                # Held-back proposals are counted, not written: a cooldown would repeat them every tick.
                self.telemetry.actions.labels(str(proposal.kind), f"held_{decision.reason}").inc()
                report.held.append((proposal, decision.reason, decision.note))
                continue
            history.append(await self._record(proposal, decision, finding_id, now, pools, report))
        for action in await self.store.actions(states=[ActionState.APPROVED]):
            await self._execute(action, pools, history, now, report)

    async def _adopt_strays(self, now: float, pools: dict[str, PoolState]) -> None:
        """Take over a started action this replica neither waits on nor holds an end for: its start was written though
        the tick that wrote it failed before carrying it out (the store's answer lost), and left alone it would never
        run nor end, holding its pool and every other pool's disruptive changes."""
        for action in await self.store.actions(states=[ActionState.STARTED]):
            # At least a tick old: one this tick started is being carried out now (none is, when this runs).
            fresh = action.started_at is not None and 0 <= now - action.started_at < self.config.scrape.interval
            if action.id not in self._waiting and action.id not in self._unrecorded and not fresh and self._leads():
                log.warning("action %d is started with nothing carrying it out: taken over", action.id)
                await self._take_over(action, now, pools)

    async def _recover_reverts(self, now: float, pools: dict[str, PoolState]) -> None:
        """Record again a revert that a take-over cancelled for now but did not record afresh (the store failed, or the
        process stopped, in between): nothing else would propose it, and the change it undoes would stay."""
        if self.config.mode is Mode.OBSERVE or not self._reverts_unsure:
            return
        recent = await self.store.actions(since=now - self.config.rails.revert_ttl)
        pending = {a.params["reverts"] for a in recent if "reverts" in a.params and a.state is not ActionState.CANCELLED}
        waits = {str(r) for r in WAIT_REASONS}
        for action in recent:
            if action.state is not ActionState.CANCELLED or action.params.get("reverts") in (None, *pending):
                continue
            log_ = await self.store.audit_log(action.id)
            if any(e.event == "taken_over" and {"reverting_as", "revert_held"} & e.detail.keys() for e in log_):
                continue  # recorded again, or left to a person, when it was cancelled
            cancelled = next((e.detail for e in reversed(log_) if e.event == "cancelled"), {})
            if cancelled.get("rails") in waits and "not applied before the stop" in str(cancelled.get("why")):
                log.warning("action %d: its revert was not recorded again when it was cancelled; recorded now",
                            action.id)
                held = RailsDecision(RailsReason(cancelled["rails"]), None, str(cancelled["why"]))
                await self._revert_again(action, change_from_dict(action.params["change"]), held, now, pools)
                pending.add(action.params["reverts"])
        self._reverts_unsure = False

    async def _approve_orphans(self, now: float) -> None:
        """Approve act mode's proposals left unapproved: in act mode the rails approve what they record at once, so one
        still proposed was cut off in between (the store failed, or the control plane stopped). Left, it would hold its
        pool until `proposal_ttl`; approved, the rails check it again before it runs, as any approval. Observe mode's,
        cut off the same way, become the advisories they were recorded to be."""
        for orphan in await self.store.actions(states=[ActionState.PROPOSED]):
            try:
                if orphan.mode == str(Mode.OBSERVE):
                    # Observe mode's record of what act would have done, cut off before it became one: left
                    # proposed it would hold its pool's advisories, and expire as though a person let it lapse.
                    await self.store.transition(orphan.id, ActionState.PROPOSED, ActionState.ADVISORY, now,
                                                {"why": "observe mode: act would have run it now",
                                                 "resumed": "recorded, not yet marked advisory, when a tick failed"})
                elif orphan.mode == str(Mode.ACT) and self.config.mode is Mode.ACT:
                    await self.store.transition(orphan.id, ActionState.PROPOSED, ActionState.APPROVED, now,
                                                {"by": "rails", "mode": str(Mode.ACT),
                                                 "resumed": "recorded, not yet approved, when the last tick failed"},
                                                approved_by="rails")
                # Otherwise proposed for a person (before a switch to act, or in propose mode): theirs to decide.
            except ActionConflict:
                continue

    async def _supersede(self, now: float, report: TickReport) -> None:
        """Cancel the sizer's approved scales that wait (a pool settling, another action in flight) while its plan
        moved on: run later, they would set a size worked out from the load of minutes before, and they hold the
        fresh plan back meanwhile. This tick's plan goes to the rails in their place."""
        planned = {p.pool: p.target for p in report.plans}
        for action in await self.store.actions(states=[ActionState.APPROVED]):
            asked = action.params.get("asked_replicas")
            if (action.kind != ActionKind.SCALE_POOL or action.finding_id is not None or action.approved_by != "rails"
                    or "reverts" in action.params or action.pool not in planned or asked == planned[action.pool]):
                continue
            try:
                await self.store.transition(action.id, ActionState.APPROVED, ActionState.CANCELLED, now,
                                            {"why": f"superseded: the sizer plans {planned[action.pool]} now, not "
                                                    f"{asked}", "rails": str(RailsReason.STALE)})
            except ActionConflict:
                continue
            self.telemetry.actions.labels(action.kind, "cancelled").inc()

    def _check(self, proposal: Proposal, finding_id: int | None, pools: dict[str, PoolState],
               history: Sequence[ActionRecord], now: float, paused: str | None) -> RailsDecision:
        """The rails on a fresh proposal. Observe mode asks what `act` would allow: its advisory
        record of what would have been done, judged like real actions."""
        mode = self.config.mode
        return check(proposal, pools.get(proposal.pool), mode=Mode.ACT if mode is Mode.OBSERVE else mode,
                     rails=self.config.rails, history=history, now=now, supported=self.actuator.kinds, paused=paused,
                     unsettled=self._changing(pools, history, now), finding_id=finding_id,
                     observing=mode is Mode.OBSERVE)

    async def _record(self, proposal: Proposal, decision: RailsDecision, finding_id: int | None, now: float,
                      pools: dict[str, PoolState], report: TickReport, extra: dict[str, Any] | None = None
                      ) -> ActionRecord:
        """Write a proposal the rails let through: approved in act mode, awaiting a person in propose
        mode, an advisory in observe mode."""
        assert decision.change is not None
        mode = self.config.mode
        params = {
            "change": change_as_dict(decision.change),
            "from_replicas": pools[proposal.pool].desired,
            "verify_signal": proposal.verify_signal,
            "verify_lower_is_better": proposal.verify_lower_is_better,
            "verify_before": self._recent_mean(proposal.pool, proposal.verify_signal, points=2),
            # Judged by the objectives it was made for: a fleet file changed later does not move them.
            **({"verify_slo": True, "verify_slos": pools[proposal.pool].slos} if proposal.verify_slo else {}),
            "inputs": list(proposal.inputs),
            **(extra or {}),
        }
        if decision.target_replicas is not None:
            params["replicas"] = decision.target_replicas
        if (template := rests_on(proposal.change, pools[proposal.pool], self._router_template)) is not None:
            params["from_template"] = template
        if (asked := getattr(proposal.change, "replicas", None)) is not None:
            params["asked_replicas"] = asked
        action = await self.store.create_action(NewAction(
            finding_id=finding_id, kind=str(proposal.kind), pool=proposal.pool, params=params, mode=str(mode),
            reason=f"{proposal.reason}; rails: {decision.note}"), now)
        if mode is Mode.OBSERVE:
            action = await self.store.transition(action.id, ActionState.PROPOSED, ActionState.ADVISORY, now,
                                                 {"why": "observe mode: act would have run it now"})
        elif decision.reason is RailsReason.ALLOWED:
            action = await self.store.transition(action.id, ActionState.PROPOSED, ActionState.APPROVED, now,
                                                 {"by": "rails", "mode": str(mode)}, approved_by="rails")
        report.actions.append(action)
        self.telemetry.actions.labels(action.kind, str(action.state)).inc()
        return action

    async def _execute(self, action: ActionRecord, pools: dict[str, PoolState], history: list[ActionRecord],
                       now: float, report: TickReport) -> None:
        """Run one approved action if the rails (and the kill switch, read again now) still allow it."""
        decision = recheck(action, pools.get(action.pool), mode=self.config.mode, rails=self.config.rails,
                           history=history, now=now, supported=self.actuator.kinds,
                           paused=await self.switch.paused(),
                           unsettled=self._changing(pools, history, now), router_template=self._router_template)
        if decision.reason in WAIT_REASONS or not self._leads():
            return
        if decision.reason is not RailsReason.ALLOWED or decision.change is None:
            try:
                await self.store.transition(action.id, ActionState.APPROVED, ActionState.CANCELLED, now,
                                            {"why": decision.note, "rails": str(decision.reason)})
            except ActionConflict:
                return
            self.telemetry.actions.labels(action.kind, "cancelled").inc()
            return
        try:
            # Conditional: of two control planes (or a loop and an expiry) only one starts it.
            action = await self.store.transition(
                action.id, ActionState.APPROVED, ActionState.STARTED, now,
                {"actuator": self.actuator.name, "dry_run": self.actuator.dry_run,
                 "verify_before": self._recent_mean(action.pool, action.params.get("verify_signal"), points=2)},
                actuator=self.actuator.name, dry_run=self.actuator.dry_run)
        except ActionConflict as exc:
            log.info("action %d was not started here: %s", action.id, exc)
            return
        if not self._leads():
            # Lost while the write was slow: another leader may be acting by now. Left started, the leader that takes
            # it over finds whether it was made.
            log.warning("action %d recorded started, but leadership was lost meanwhile: left to the next leader",
                        action.id)
            return
        history.append(action)
        order = self._with_engines(_order(action, decision.change))
        await self._run(order, self.actuator.carry_out(order), now, report)

    async def _advance_waiting(self, now: float, report: TickReport) -> None:
        """Take every change that waits (an engine draining) a tick further, with fresh numbers; the
        kill switch holds each step as it holds a new action (the engines stay out of routing meanwhile)."""
        for order, wait in list(self._waiting.values()):
            if not self._leads() or await self.switch.paused() is not None:
                return
            fresh = self._with_engines(order)
            await self._run(fresh, self.actuator.resume(fresh, wait, now), now, report)

    async def _run(self, order: Order, call: Awaitable[dict[str, Any]], now: float, report: TickReport) -> None:
        """Await the actuator and record what came of it: done, failed, or still waiting."""
        kind = str(order.kind)
        with self.telemetry.span("action", kind=kind, pool=order.pool):
            try:
                detail = await call
            except Exception as exc:
                # ActuationError carries the actuator's own message; anything else is a bug or an
                # untranslated client error, recorded as such instead of taking the loop down.
                if not isinstance(exc, ActuationError):
                    log.exception("actuator %s raised on action %d", self.actuator.name, order.action_id)
                error = str(exc) if isinstance(exc, ActuationError) else f"{type(exc).__name__}: {exc}"
                # A wait that failed may have evicted pods.
                self._finished_now += _touched(order, self._waiting.pop(order.action_id, None))
                report.errors[f"action {order.action_id}"] = error
                await self._finish(order.action_id, kind, ActionState.FAILED, {"error": error}, error)
                return
        if "wait" in detail:
            before = self._waiting.get(order.action_id)
            self._waiting[order.action_id] = (order, detail["wait"])
            # The audit log gets each new wait, not every tick; one whose note failed is noted again next tick.
            if before is None or before[1] != detail["wait"] or order.action_id in self._unnoted:
                self._unnoted.add(order.action_id)
                await self.store.note(order.action_id, "waiting", self.clock.now(), detail)
                self._unnoted.discard(order.action_id)
            return
        self._finished_now += _touched(order, self._waiting.pop(order.action_id, None))
        await self._finish(order.action_id, kind, ActionState.DRY_RUN if self.actuator.dry_run else ActionState.SUCCEEDED,
                           detail)

    async def _finish(self, action_id: int, kind: str, state: ActionState, detail: dict[str, Any],
                      error: str | None = None) -> None:
        """Record how a started action ended. The fleet has changed already, so a write the store refuses is kept and
        tried again every tick (`_record_unrecorded`): until it lands the action stays started, holding its pool."""
        self._unrecorded[action_id] = (kind, state, detail, error, self.clock.now())
        await self._record_unrecorded()

    async def _record_unrecorded(self) -> None:
        """Write the ends of started actions that the store refused before (`_finish`), oldest first."""
        for action_id, (kind, state, detail, error, at) in list(self._unrecorded.items()):
            try:
                await self.store.transition(action_id, ActionState.STARTED, state, at, detail, error=error)
            except (ActionConflict, ActionNotFound) as exc:
                # Moved already (a write that landed though its answer was lost, another leader's take-over).
                log.warning("action %d ended %s, not recorded: %s", action_id, state, exc)
            else:
                self.telemetry.actions.labels(kind, str(state)).inc()
            del self._unrecorded[action_id]

    def _with_engines(self, order: Order) -> Order:
        """`order` with the loop's view of its pool's engines: requests running or waiting on each at its
        latest fresh scrape, and which still answer (None where this tick scraped none of them itself)."""
        fresh = self.clock.now() - 2 * self.config.scrape.interval
        # A cordon moves every pool's engines on its node: it sees them all.
        cordon = order.kind is ActionKind.CORDON_NODE
        busy: dict[str, float] = {}
        counted: set[str] = set()
        for name in ("requests_running", "requests_waiting"):
            for subject in self.windows.subjects(name, prefix="engine/" if cordon else f"engine/{order.pool}/"):
                pod = subject.split("/")[2]
                counted.add(pod)
                points = self.windows.series(subject, name, since=fresh)
                if points:
                    busy[pod] = busy.get(pod, 0.0) + points[-1][1]
        # Per pool scraped here; None where one whose engines the change may move is not (a pool with engines that
        # is not scraped here would read as down, and its busy engines be evicted at once).
        pools = [p.name for p in self.config.pools] if cordon else [order.pool]
        unseen = [p for p in pools if p not in self._answering
                  and ((rep := self._last_replicas.get(p)) is None or rep.desired > 0)]
        answering = None if unseen else frozenset(e for p in pools for e in self._answering.get(p, ()))
        return replace(order, busy=busy, answering=answering, counted=frozenset(counted))

    # verify -----------------------------------------------------------------------------------

    def _recent_mean(self, pool: str, signal: str | None, points: int = 5, since: float | None = None,
                     until: float = math.inf) -> float | None:
        """Mean of a pool signal over its last `points` intervals (taken at or after `since`, before `until`): before
        an action, the degraded state that prompted it; at verification, the settled state after it, never points
        from before it or from after the next change."""
        if signal is None:
            return None
        subject = f"pool/{pool}"
        window = (self.windows.last(subject, signal, points) if since is None else
                  [v for ts, v in self.windows.series(subject, signal, since=since) if ts < until][-points:])
        return statistics.fmean(window) if window else None

    @property
    def _ahead(self) -> float:
        """How far ahead of the clock an action may have been created and still be taken as new: a clock corrected
        back by a few scrapes loses nothing (a revert expired is never asked again); a longer step would keep an
        action for the step and its time to live."""
        return 4 * self.config.scrape.interval

    def _changing_at(self, pool: str, since: float) -> set[float]:
        """The scrapes after `since` at which the pool was mid-change: rolling out a template, or its ready engines
        not its desired ones."""
        subject = f"pool/{pool}"
        ready = dict(self.windows.series(subject, READY, since=since))
        return {ts for ts, v in self.windows.series(subject, ROLLING, since=since) if v} | {
            ts for ts, v in self.windows.series(subject, DESIRED, since=since) if ts in ready and ready[ts] != v}

    def _changing_until(self, pool: str, since: float, until: float, first: bool = False) -> float:
        """The last scrape in (`since`, `until`) at which the pool was mid-change, else `since`: a change that
        restarts or adds engines is judged once they all serve. With `first`, the last before it first settled: a
        pool judged on its SLOs keeps the minutes before a later restart (`_slo_outcome` leaves out the restart's)."""
        changing = self._changing_at(pool, since)
        if first:
            until = min((ts for ts, _ in self.windows.series(f"pool/{pool}", DESIRED, since=since)
                         if since < ts < until and ts not in changing), default=until)
        return max((ts for ts in changing if ts < until), default=since)

    def _note_unfit(self, pools: dict[str, PoolState], now: float) -> None:
        """Remember which of each pool's inputs are unfit this tick, for the history's length (none from a clock
        that since stepped back)."""
        for pool_key, times in list(self._unfit_at.items()):
            kept = [t for t in times if now - HISTORY_S <= t <= now]
            if kept:
                self._unfit_at[pool_key] = kept
            else:
                del self._unfit_at[pool_key]
        for name, pool in pools.items():
            for key in [*pool.stale_inputs, *([""] if pool.unreadable is not None else [])]:
                self._unfit_at.setdefault((name, key), []).append(now)

    def _whole_since(self, action: ActionRecord, judged: Iterable[str], until: float) -> float:
        """The last tick before `until` at which an input the action's outcome rests on was unfit (a signal it is
        `judged` by or one of its inputs stale, or its pool unreadable), as this replica saw; -inf if none."""
        names = [*judged, *action.params.get("inputs", ())]
        keys = {key: "" for pool, key in self._unfit_at if pool == action.pool and key}
        return max((t for key in [*stale_among(names, keys), ""] for t in self._unfit_at.get((action.pool, key), ())
                    if t < until), default=-math.inf)

    @staticmethod
    def _next_change(action: ActionRecord, others: Sequence[ActionRecord], after: float) -> ActionRecord | None:
        """Of `others` (the actions created since `rails.history_s` before it finished, so one created before it and
        started after it counts too), the first that changed the action's pool after `after` (when it finished, or
        was asked for) (a cordon of any pool's moves its engines too), its own revert aside: points from then on are
        that change's as much as its."""
        later = [a for a in others
                 if a.id != action.id and a.params.get("reverts") != action.id and not a.dry_run
                 and a.started_at is not None and a.started_at > after
                 and (a.pool == action.pool or a.kind == ActionKind.CORDON_NODE)]
        return min(later, key=lambda a: (a.started_at or 0.0, a.id), default=None)

    async def _judge_outcomes(self, now: float, pools: dict[str, PoolState], report: TickReport) -> None:
        """Did the signal recover after the action (a remedy), or did its pool keep its SLOs (a scale for the load, a
        cordon)? Recorded once, never retried blindly; a remedy that did not help is reverted where it can be, and a
        finding says so."""
        verify_after = self.config.rails.verify_after
        self._note_unfit(pools, now)
        due = await self.store.awaiting_outcome(finished_before=now - verify_after)
        # Read once for all of them: what changed their pools since.
        finished = [a.finished_at for a in due if a.finished_at is not None
                    and (a.params.get("verify_signal") or a.params.get("verify_slo"))]
        others = await self.store.actions(since=min(finished) - self.config.rails.history_s) if finished else []
        for action in due:
            p = action.params
            judged = _judged_by(p, pools.get(action.pool))
            unfit = _unfit_to_judge(action, pools.get(action.pool), judged)
            # Objectives are judged per whole minute: enough points to hold one wherever the minutes fall.
            need = max(VERIFY_POINTS, 2 * whole_minute(self.windows, f"pool/{action.pool}") + 1) \
                if p.get("verify_slo") else VERIFY_POINTS
            # Judged on the points after the pool settled (its engines restarted or started, all serving) and its
            # inputs were whole again, and before the next change to it, which would take credit or blame for it.
            start, until, confounded, as_it_is = action.finished_at, math.inf, None, False
            if action.finished_at is not None and judged:
                # A scale or cordon a person rejected or left to expire is scored on how the pool fared without it
                # from when it was asked for, not from when it lapsed.
                base = action.created_at if p.get("verify_slo") and action.state in _DECLINED else action.finished_at
                nxt = self._next_change(action, others, base)
                until = nxt.started_at if nxt is not None and nxt.started_at is not None else math.inf
                whole = self._whole_since(action, judged, until)
                settled = self._changing_until(action.pool, base, until, first=bool(p.get("verify_slo")))
                if now - action.finished_at >= 3 * verify_after and settled > whole:
                    # Still not settled three verify windows on (its engines crash-loop, its rollout stalled): the
                    # change is judged on what it has done, as it is, rather than escape judging and its revert.
                    settled, as_it_is = base, True
                start = max(base, settled, whole)
                # Strictly after: a tick scrapes before it acts, so a point stamped when it finished predates it.
                seen = sorted({ts for name in judged for ts, _ in self.windows.series(
                    f"pool/{action.pool}", name, since=math.nextafter(start, math.inf)) if ts < until})
                if nxt is not None and len(seen) < need:
                    confounded = (f"action {nxt.id} ({nxt.kind}) changed {nxt.pool} {until - start:.0f}s after "
                                  f"{action.pool} settled: {len(seen)} point(s) before it")
                elif unfit is None and start > base and len(seen) < need:
                    unfit = (f"{action.pool} was still changing, or its inputs unfit, {now - start:.0f}s ago "
                             f"({len(seen)} point(s) since)")
                elif unfit is None and 0 < len(seen) < need:
                    # A clock stepped forward makes an action due with a point or two after it: not a settled state.
                    unfit = f"{len(seen)} point(s) of {' or '.join(judged)} since it finished"
            if confounded is None and unfit is not None and action.finished_at is not None \
                    and now - action.finished_at < 3 * verify_after:
                continue  # judged once its numbers are fit again: a verdict from them would stand for good
            log_ = await self.store.audit_log(action.id)
            if p.get("verify_slo"):
                # Minutes in which the pool changed again after it first settled (an engine restarting, a rollout
                # nobody here made) measure the change, not the size this action set; one judged as it is, never
                # settled, has no others.
                changing = set() if start is None or as_it_is else {
                    math.ceil(ts / 60.0) for ts in self._changing_at(action.pool, start) if start < ts < until}
                outcome, detail = self._slo_outcome(action.pool, pools.get(action.pool), _slos_of(p, pools.get(
                    action.pool)), start, until, changing)
                if "replicas" in p and (pool := pools.get(action.pool)) is not None:
                    # A breach at the pool's most engines is the bound's to answer (`pool_at_max`), not the sizer's.
                    detail.update(engines=p["replicas"], max_engines=pool.max_replicas)
            else:
                outcome, detail = await self._signal_outcome(action, log_, start, until)
            if confounded is not None:  # another change came too soon after it: no verdict is this one's alone
                outcome, detail = "unmeasured", {**detail, "confounded": confounded}
            elif unfit is not None:  # unfit for three verify windows: not judged from them
                outcome, detail = "unmeasured", {**detail, "unfit": unfit}
            if outcome == "not_recovered" and action.state is ActionState.SUCCEEDED:
                # Before the outcome, which ends the judging: a revert or finding the store refused is written again
                # next tick (each once), not lost with a judging that is over.
                done = next((e.detail for e in reversed(log_) if e.event == "succeeded"), {})
                try:
                    if not any(e.event == "ineffective" for e in log_):  # not done twice by a judging cut off after it
                        await self._ineffective(action, detail, done, now, pools, report)
                except FleetError:
                    raise
                except Exception:  # a row it cannot read: judged all the same, not retried every tick
                    log.exception("action %d: its revert and finding could not be made", action.id)
            try:
                await self.store.record_outcome(action.id, outcome, now, detail)
            except ActionConflict:  # judged by the last leader's tick meanwhile: its verdict stands
                continue
            report.outcomes.append((action.id, outcome))
            if action.state is ActionState.SUCCEEDED:  # advisories and proposals left undecided are judged too
                self.telemetry.outcomes.labels(action.kind, outcome).inc()

    async def _signal_outcome(self, action: ActionRecord, log_: Sequence[ActionEvent], start: float | None,
                              until: float) -> tuple[str, dict[str, Any]]:
        """Whether the action's verify signal improved: the state it ran from (read when it started, as an approval
        can come long after the proposal) against the state after it, from points after `start` only (a signal that
        stopped is no recovery)."""
        p = action.params
        # Where it began: its redo at a take-over, else its start.
        began = next((e.detail for e in reversed(log_) if e.event == "taken_over" and "redo" in e.detail), None)
        began = began or next((e.detail for e in log_ if e.event == "started"), {})
        before = began.get("verify_before", p.get("verify_before"))
        after = self._recent_mean(action.pool, p.get("verify_signal"),
                                  since=None if start is None else math.nextafter(start, math.inf), until=until)
        finding = await self.store.finding(action.finding_id) if action.finding_id else None
        resolved = finding is not None and finding.state == "resolved"
        if before is None or after is None:
            outcome = "recovered" if resolved else "unmeasured"
        else:
            gain = before - after if p.get("verify_lower_is_better", True) else after - before
            change = gain / max(abs(before), 1e-9)
            # A finding can resolve because the action removed the series it watched (speculation switched off
            # ends its acceptance rate): that is no recovery where the signal the action was to improve got worse.
            outcome = ("recovered" if change >= IMPROVEMENT or (resolved and change >= -IMPROVEMENT)
                       else "not_recovered")
        return outcome, {"signal": p.get("verify_signal"), "before": before, "after": after,
                         "finding_resolved": resolved}

    def _slo_outcome(self, pool: str, state: PoolState | None, slos: Mapping[str, float], start: float | None,
                     until: float, changing: Collection[int] = ()) -> tuple[str, dict[str, Any]]:
        """Whether the pool kept `slos` from `start` to `until` or now (a scale for the load, a cordon), leaving out
        the `changing` minutes: `held`, or `breached` where most of a whole minute's points broke one; no revert
        either way, the sizer plans again every tick."""
        if not slos:
            why = f"{pool} has no SLO set" if state is not None else f"{pool} is not in the fleet file"
            return "unmeasured", {"slos": {}, "why": why}
        every = {name: [] if start is None else
                 [(ts, v) for ts, v in self.windows.series(f"pool/{pool}", name, since=math.nextafter(start, math.inf))
                  if ts < until] for name in slos}
        series = {name: [(ts, v) for ts, v in points if math.ceil(ts / 60.0) not in changing]
                  for name, points in every.items()}
        whole = whole_minute(self.windows, f"pool/{pool}")
        minutes = {m for points in series.values() for m, values in by_minute(points).items() if len(values) >= whole}
        broken = {name: [m * 60.0 for m in slo_broken_minutes(points, slos[name], whole)]
                  for name, points in series.items()}
        detail = {"slos": dict(slos), "minutes": len(minutes), "changing_minutes": len(changing),
                  "broken": {n: b for n, b in broken.items() if b},
                  "worst": {n: max(v for _, v in points) for n, points in series.items() if points}}
        if detail["broken"]:
            return "breached", detail
        # Broken only while the pool changed: its engines crash-looping under the load, or a rollout made elsewhere;
        # which of them the numbers cannot say, so neither verdict.
        while_changing = sorted({m for name, points in every.items()
                                 for m in slo_broken_minutes(points, slos[name], whole) if m in changing})
        if while_changing:
            return "unmeasured", {**detail, "why": f"it broke an objective only in minutes its pool was changing "
                                                   f"again (engines restarting, or a rollout): {len(while_changing)}"}
        if not minutes:  # judged only once `need` points came, so there is one unless the scrapes were patchy
            return "unmeasured", {**detail, "why": "not a whole minute of points" + (
                " before the next change" if until < math.inf else "")}
        return "held", detail

    async def _ineffective(self, action: ActionRecord, measured: dict[str, Any], done: Mapping[str, Any], now: float,
                           pools: dict[str, PoolState], report: TickReport) -> None:
        """Open a finding on an action that did not help (`done`: what the actuator reported of it), and revert it
        through the rails if it can be."""
        p = action.params
        moved = f"from {measured['before']:.4g} to {measured['after']:.4g}"
        undo = None
        if "reverts" not in p:  # a revert that did not help either is left to a person, never undone in turn
            undo = revert_of(ActionKind(action.kind), change_from_dict(p["change"]), done)
        proposal = None if undo is None else Proposal(
            undo[0], action.pool, undo[1],
            f"revert action {action.id} ({action.kind}): {p.get('verify_signal')} did not improve ({moved})",
            verify_signal=p.get("verify_signal"), verify_lower_is_better=p.get("verify_lower_is_better", True),
            inputs=tuple(p.get("inputs", ())))
        revert_id, why = None, "not reverted automatically: " + (
            "it is a revert" if "reverts" in p else f"a {action.kind} is undone by hand")
        # The original's cooldown does not hold back its own undoing; every other rail does.
        history = [a for a in await self.store.recent_actions(since=now - self.config.rails.history_s)
                   if a.id != action.id]
        if (earlier := next((a for a in history if a.params.get("reverts") == action.id), None)) is not None:
            proposal = None  # recorded by a judging the store cut off before its outcome: not twice
            revert_id, why = earlier.id, f"reverting as action {earlier.id} ({earlier.state})"
        if proposal is not None:
            decision = self._check(proposal, None, pools, history, now, await self.switch.paused())
            why = f"revert held: {decision.note}"
            if decision.reason in REVERT_WAITS and self.config.mode is not Mode.OBSERVE:
                # Held only for now (paused, a pool settling, another pool's rollout, the hour's budget spent): recorded
                # to wait, as an approved action waits, so the undoing is not lost with this one judging.
                decision = RailsDecision(RailsReason.ALLOWED if self.config.mode is Mode.ACT
                                         else RailsReason.NEEDS_APPROVAL, proposal.change, f"waits: {decision.note}")
            if decision.may_record and decision.change is not None:
                try:
                    revert = await self._record(proposal, decision, action.finding_id, now, pools, report,
                                                extra={"reverts": action.id})
                except StoreConflict:  # an action of its kind on the pool is active (awaiting a person, say)
                    why = f"revert held: a {proposal.kind} on {action.pool} is active already; undo it by hand"
                else:
                    revert_id, why = revert.id, f"reverting as action {revert.id} ({revert.state})"
        # Opened already by a judging the store cut off before its outcome (or before this note): its note is written.
        finding = next((f for f in await self.store.open_findings()
                        if f.kind == INEFFECTIVE and f.subject == f"action/{action.id}"), None)
        if finding is None:
            finding = await self.store.open_finding(NewFinding(
                INEFFECTIVE, f"action/{action.id}", "warning",
                f"action {action.id} ({action.kind} on {action.pool}) did not improve {p.get('verify_signal')}",
                f"{measured['signal']} went {moved} after the change; {why}.",
                {**measured, "action_id": action.id, "revert_id": revert_id, "finding_id": action.finding_id},
                INEFFECTIVE), now)
            report.opened.append(finding)
        await self.store.note(action.id, "ineffective", now, {"finding": finding.id, "revert": revert_id, "why": why})

    async def _ineffective_over(self, f: FindingRecord) -> str | None:
        """Why an `action_ineffective` finding resolves now: its revert ran, or, with none (or one that ended otherwise:
        rejected, expired, cancelled, failed, or unknown), the finding the action answered resolved; None while it
        stays open."""
        revert_id, cause_id = f.evidence.get("revert_id"), f.evidence.get("finding_id")
        ended = ""
        if revert_id is not None:
            # A judging the store cut off before its finding recorded the revert ticks before the finding opened.
            since = f.opened_at - self.config.rails.history_s
            # The newest revert of the action: a take-over that could not redo the one recorded cancelled it and
            # recorded another (`reverting_as`), whose end is the finding's.
            reverts = [a for a in await self.store.actions(since=since)
                       if a.id == revert_id or a.params.get("reverts") == f.evidence.get("action_id")]
            revert = max(reverts, key=lambda a: (a.created_at, a.id), default=None)
            if revert is None:  # recorded with the finding, so gone since: past store.record_retention
                return f"its revert (action {revert_id}) is no longer on record"
            revert_id = revert.id
            if revert.state not in FINISHED_STATES:
                return None
            if revert.state in (ActionState.SUCCEEDED, ActionState.DRY_RUN):
                return f"its revert (action {revert_id}) ended {revert.state}"
            # The change it undoes is still in place: the finding stays while the problem it answered does.
            ended = f"; its revert (action {revert_id}) ended {revert.state}"
        cause = await self.store.finding(cause_id) if cause_id else None
        return f"the finding the action answered resolved{ended}" if cause is None or cause.state == "resolved" \
            else None

    async def _compact(self, now: float) -> None:
        every = self.config.store.compact_every
        if self._last_compaction is not None and now - self._last_compaction < every:
            return
        self._last_compaction = now
        s = self.config.store
        retention = Retention(s.raw_retention, s.minute_retention, s.hour_retention, s.record_retention)
        with self.telemetry.span("store.compact"):
            await self.store.compact(now, retention)


def _order(action: ActionRecord, change: Change) -> Order:
    """The order an action is carried out by, with what it was approved against for the actuator to check again."""
    start, template = action.params.get("from_replicas"), action.params.get("from_template")
    return Order(action.id, ActionKind(action.kind), action.pool, change, action.reason, created_at=action.created_at,
                 from_replicas=int(start) if start is not None else None,
                 from_template=str(template) if template is not None else None)


def _unsettled(pools: dict[str, PoolState], history: Sequence[ActionRecord], now: float, within: float) -> list[str]:
    """The pools mid-change: short of ready engines, rolling out a template, or unreadable within `within` of an
    action on them ending (its engines may be restarting now, which the last read from before it cannot show)."""
    ran = [a for a in history if a.state in _RAN and a.finished_at is not None and 0 <= now - a.finished_at < within]
    # A cordon moves any pool's engines off its node.
    changed = set(pools) if any(a.kind == ActionKind.CORDON_NODE for a in ran) else {a.pool for a in ran}
    return [name for name, p in pools.items()
            if p.ready != p.desired or p.rolling or (p.unreadable is not None and name in changed)]


# The ends of an action that ran (it may have changed the fleet).
_RAN = frozenset({ActionState.SUCCEEDED, ActionState.FAILED, ActionState.UNKNOWN})


def _judged_by(params: Mapping[str, Any], pool: PoolState | None) -> list[str]:
    """The signals an action's outcome is judged by: those of its pool's objectives (a scale for the load, a cordon),
    or the one it was to improve (a remedy)."""
    if params.get("verify_slo"):
        return list(_slos_of(params, pool))
    return [params["verify_signal"]] if params.get("verify_signal") else []


def _slos_of(params: Mapping[str, Any], pool: PoolState | None) -> dict[str, float]:
    """The objectives an action judged by its pool's SLOs was made for (its pool's now, for one recorded without)."""
    if (slos := params.get("verify_slos")) is not None:
        return dict(slos)
    return pool.slos if pool is not None else {}


def _unfit_to_judge(action: ActionRecord, pool: PoolState | None, judged: Iterable[str]) -> str | None:
    """Why the numbers an action's outcome is judged by cannot be trusted now (its pool unreadable, a signal it is
    `judged` by or one it rests on stale), or None."""
    if pool is None:
        return None
    if pool.unreadable is not None:
        return f"{pool.name} cannot be read: {pool.unreadable}"
    names = [*judged, *action.params.get("inputs", ())]
    stale = stale_among(names, pool.stale_inputs)
    return "; ".join(f"{k}: {v}" for k, v in sorted(stale.items())) or None


def _caused_by(finding_id: int, action: ActionRecord) -> bool:
    # An approved revert still runs: the finding the change it undoes answered resolving does not make it help.
    return action.finding_id == finding_id and not (action.state is ActionState.APPROVED and "reverts" in action.params)


def _ttl(rails: Rails, action: ActionRecord) -> float:
    """How long an action may wait undecided or unrun (`Rails.ttl_for`)."""
    return rails.ttl_for(action.params, approved=action.state is ActionState.APPROVED)[1]


def _new_finding(report: FindingReport) -> NewFinding:
    """A policy's report as the store records it."""
    return NewFinding(report.key.kind, report.key.subject, str(report.severity), report.summary, report.cause,
                      dict(report.evidence), report.runbook)


def _touched(order: Order, waited: tuple[Order, dict[str, Any]] | None) -> list[str]:
    """The pools a change that waited touched, once it ends: its own, and for a cordon every pool whose engines it
    evicted (none where it did not wait)."""
    if waited is None:
        return []
    return sorted({order.pool, *(waited[1].get("pools") or {}).values()})
