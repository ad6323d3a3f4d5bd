"""An action whose signal did not improve: a finding, a revert through the rails, no flapping.

In-memory store, virtual time. The pool's TPOT stays high whatever speculation does, so the
speculation change (3 -> 1 tokens) does not help: after `verify_after` it is judged
`not_recovered`, an `action_ineffective` finding opens, the revert (back to 3) is carried out,
the finding resolves with it, and the same change is not asked for again for that finding.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from collectors.types import Signal
from controlplane.actions import ActionState as S
from controlplane.actuators.base import FleetView, Order, PoolReplicas
from controlplane.clock import VirtualClock
from controlplane.config import parse_config
from controlplane.errors import ActuationError, StoreUnavailable
from controlplane.killswitch import StoreSwitch
from controlplane.loop import INEFFECTIVE, ControlLoop
from controlplane.observe import Observation
from controlplane.store.compaction import Retention
from controlplane.store.memory import MemoryStore
from controlplane.store.records import NewAction, NewFinding
from controlplane.telemetry import Telemetry
from policies.types import (
    ActionKind,
    FindingKey,
    FindingReport,
    Policy,
    PolicyInput,
    PolicyResult,
    Proposal,
    ScaleTo,
    Severity,
    Speculation,
    change_as_dict,
)

FLEET = """
mode: {mode}
pools: [{{name: chat, role: unified, model: m, replicas: {{min: 1, max: 8}}}}]
rails: {{cooldown: 60s, verify_after: 5m, max_actions_per_hour: 20{rails}}}
"""
COOLS_2H = "cooldowns: {tune_speculation: 2h}"  # longer than the change takes to be judged and reverted


class SlowTpot:
    """TPOT at 100 ms, whatever happens."""

    async def observe(self, now: float) -> Observation:
        return Observation(signals=[Signal(now, "pool/chat", "tpot_p95", 0.1)])


class Collapse:
    """A finding that asks for fewer speculative tokens, open all along."""

    kind = "test_spec"
    reads = ("tpot_p95",)

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        proposal = Proposal(ActionKind.TUNE_SPECULATION, "chat", Speculation(step=-2), "fewer drafts",
                            verify_signal="tpot_p95", verify_lower_is_better=True)
        return PolicyResult([FindingReport(FindingKey("test_spec", "pool/chat"), Severity.WARNING, "collapse", "",
                                           {}, "spec_decode_collapse", (proposal,))])


class Engines:
    name = "fake"
    dry_run = False
    kinds = frozenset({ActionKind.TUNE_SPECULATION})

    def __init__(self) -> None:
        self.tokens = 3
        self.history: list[int] = []

    async def observe(self) -> FleetView:
        return FleetView({"chat": PoolReplicas(3, 3)})

    async def carry_out(self, order: Order) -> dict[str, Any]:
        assert isinstance(order.change, Speculation)
        before, self.tokens = self.tokens, order.change.resolve(self.tokens)
        self.history.append(self.tokens)
        return {"num_speculative_tokens": self.tokens, "from": before}

    async def resume(self, order: Order, wait: dict[str, Any], now: float) -> dict[str, Any]:
        return {}

    async def applied(self, order: Order) -> bool | None:
        return None


async def test_an_ineffective_change_is_reverted_once_and_not_tried_again() -> None:
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    loop = make_loop(store, engines, clock)
    await ticks(loop, clock, 4 * 12)  # twelve minutes
    assert engines.history == [1, 3], "lowered, then put back when it did not help"
    first, revert = await store.actions()
    assert (first.state, first.outcome) == (S.SUCCEEDED, "not_recovered")
    assert revert.params["reverts"] == first.id and revert.state is S.SUCCEEDED
    assert revert.params["change"] == {"type": "Speculation", "num_speculative_tokens": 3, "step": 0}
    ineffective = {f.evidence["action_id"]: f for f in store.findings.values() if f.kind == INEFFECTIVE}
    assert ineffective[first.id].state == "resolved" and ineffective[first.id].evidence["revert_id"] == revert.id
    assert "did not improve tpot_p95" in ineffective[first.id].summary
    assert [e.event for e in store.action_events(first.id)][-2:] == ["ineffective", "outcome:not_recovered"]
    await ticks(loop, clock, 4 * 20)  # twenty minutes more: the finding is still open, the change still asked for
    assert engines.history == [1, 3], "never flaps between the change and its revert"
    assert len(await store.actions()) == 2, "not tried again for this finding, and a revert is never reverted"
    again = ineffective_of(store, revert.id)
    assert again.state == "open" and again.evidence["revert_id"] is None and "it is a revert" in again.cause


def ineffective_of(store: MemoryStore, action_id: int) -> Any:
    [f] = [f for f in store.findings.values() if f.kind == INEFFECTIVE and f.evidence["action_id"] == action_id]
    return f


def make_loop(store: MemoryStore, engines: Engines, clock: VirtualClock, *, mode: str = "act", rails: str = "",
              policy: Policy | None = None, source: SlowTpot | None = None) -> ControlLoop:
    """A loop over the chat pool, its kill switch read from the store; `rails` adds to the fleet file's rails."""
    fleet = FLEET.format(mode=mode, rails=f", {rails}" if rails else "")
    return ControlLoop(config=parse_config(fleet), source=source or SlowTpot(), store=store,
                       policies=[policy or Collapse()], actuator=engines, clock=clock, telemetry=Telemetry(),
                       switch=StoreSwitch(store))


async def ticks(loop: ControlLoop, clock: VirtualClock, n: int) -> None:
    """`n` scrape intervals of 15 s."""
    for _ in range(n):
        clock.advance(15)
        await loop.tick()


async def test_observe_mode_advises_the_revert_too() -> None:
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    await ticks(make_loop(store, engines, clock, mode="observe"), clock, 4 * 12)
    assert engines.history == []
    [advice] = await store.actions()
    assert (advice.state, advice.outcome) == (S.ADVISORY, "not_recovered")
    assert [f.kind for f in store.findings.values()] == ["test_spec"], "an advisory that would not help is scored, not reverted"


async def test_once_acting_the_remedy_observe_mode_advised_runs() -> None:
    """Advice changed nothing on the fleet: scored not_recovered while observing (the signal stayed bad without it), it
    held the remedy as tried for hours once the control plane was switched to act."""
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    await ticks(make_loop(store, engines, clock, mode="observe"), clock, 4 * 12)
    [advice] = await store.actions()
    assert (advice.state, advice.outcome, engines.history) == (S.ADVISORY, "not_recovered", [])
    acting = make_loop(store, engines, clock)  # restarted with mode: act, the finding still open
    await acting.start()
    await ticks(acting, clock, 1)
    assert engines.history == [1]


class RefusesEnds(MemoryStore):
    """A store that refuses the next `refuse` ends of actions."""

    refuse = 0

    async def transition(self, action_id: int, expected: Any, to: S, now: float, detail: dict[str, Any] | None = None,
                         **fields: Any) -> Any:
        if self.refuse and to in (S.SUCCEEDED, S.FAILED):
            self.refuse -= 1
            raise StoreUnavailable("transition: connection reset")
        return await super().transition(action_id, expected, to, now, detail, **fields)


async def test_an_end_known_here_survives_a_store_blip_as_leadership_comes_back() -> None:
    """The take-over went on without the ends the store refused, then dropped them: the action was taken over from an
    actuator that cannot tell, and recorded unknown, with the detail its revert needs lost."""
    clock, store, engines = VirtualClock(), RefusesEnds(), Engines()
    loop = make_loop(store, engines, clock)
    await loop.start()
    store.refuse = 1
    clock.advance(15)
    with pytest.raises(StoreUnavailable):
        await loop.tick()  # the change is made on the fleet; its end is refused
    store.refuse = 1  # and again as leadership comes back
    clock.advance(30)
    with pytest.raises(StoreUnavailable):
        await loop.start()  # tried again by the runtime, as a tick is
    await loop.start()
    [action] = await store.actions()
    assert (action.state, engines.history) == (S.SUCCEEDED, [1])
    assert next(e.detail for e in store.action_events(action.id) if e.event == "succeeded")["from"] == 3


class Quiet(Collapse):
    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        return PolicyResult()


async def test_a_redone_change_is_judged_from_the_state_it_was_redone_from() -> None:
    """The stopped leader read TPOT 200 ms when it started the change; 40 minutes later TPOT was 100 ms on its own, and
    the redo made it 150: judged against the stopped leader's number it read as a 25 % gain, and was never reverted."""
    clock, store, engines = VirtualClock(), MemoryStore(), NotApplied()
    params = {"change": change_as_dict(Speculation(step=-2)), "verify_signal": "tpot_p95",
              "verify_lower_is_better": True, "verify_before": 0.2, "inputs": ["tpot_p95"]}
    a = await store.create_action(NewAction(None, "tune_speculation", "chat", params, "act", "fewer drafts"),
                                  clock.now())
    await store.transition(a.id, S.PROPOSED, S.APPROVED, clock.now(), {"by": "rails"}, approved_by="rails")
    await store.transition(a.id, S.APPROVED, S.STARTED, clock.now(), {"actuator": "fake", "verify_before": 0.2})
    clock.advance(40 * 60)  # no leader meanwhile, within proposal_ttl
    loop = make_loop(store, engines, clock, policy=Quiet(), source=WorseOnceChanged(engines))
    await loop.start()
    assert engines.history == [1], "redone"
    await ticks(loop, clock, 4 * 7)
    action = next(x for x in await store.actions() if x.id == a.id)
    assert action.outcome == "not_recovered"


async def test_a_revert_held_for_now_waits_instead_of_being_lost() -> None:
    # Paused at the very tick the change is judged: the revert is recorded to wait, and runs once unpaused.
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    loop = make_loop(store, engines, clock)
    await judged_then_paused(loop, clock, store)
    assert engines.history == [1]
    store.pause = None
    await ticks(loop, clock, 8)
    assert engines.history == [1, 3], "reverted once the pause ended"


async def test_a_revert_the_hours_budget_holds_waits_and_runs() -> None:
    """Judged with the hour's budget spent (a sizer's scales elsewhere), the revert was held for good: nothing proposes
    it again, and the change that made things worse stayed."""
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    fleet = FLEET.replace("max_actions_per_hour: 20", "max_actions_per_hour: 2").format(mode="act", rails="")
    loop = ControlLoop(config=parse_config(fleet), source=SlowTpot(), store=store, policies=[Collapse()],
                       actuator=engines, clock=clock, telemetry=Telemetry(), switch=StoreSwitch(store))
    await ticks(loop, clock, 4)
    assert engines.history == [1]
    for _ in range(2):  # two more actions within the hour, finished
        a = await store.create_action(NewAction(None, "scale_pool", "other", {"change": change_as_dict(ScaleTo(2)),
                                                                               "from_replicas": 1}, "act", "load"),
                                      clock.now())
        await store.transition(a.id, S.PROPOSED, S.APPROVED, clock.now(), {}, approved_by="rails")
        await store.transition(a.id, S.APPROVED, S.STARTED, clock.now(), {})
        await store.transition(a.id, S.STARTED, S.SUCCEEDED, clock.now(), {})
    await ticks(loop, clock, 4 * 12)
    [first] = [a for a in await store.actions() if a.kind == "tune_speculation" and "reverts" not in a.params]
    assert first.outcome == "not_recovered"
    assert engines.history == [1, 3], "recorded to wait, as an approval waits, and run"


async def judged_then_paused(loop: ControlLoop, clock: VirtualClock, store: MemoryStore) -> None:
    """Tick until the change is judged, pausing acting at that tick: its revert is recorded to wait."""
    from controlplane.store.base import Pause

    while not any(a.outcome for a in await store.actions()):
        clock.advance(15)
        if (done := [a for a in await store.actions() if a.finished_at]) and clock.now() - done[0].finished_at >= 300:
            store.pause = Pause(by="oncall", reason="maintenance", at=clock.now())
        await loop.tick()


class Fades(Collapse):
    """The collapse, until `on` is turned off: then its finding resolves."""

    on = True

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        if self.on:
            return super().evaluate(inp)
        key = FindingKey("test_spec", "pool/chat")
        return PolicyResult(resolved=[(key, "gone")] if key in inp.open_findings else [])


# Paused for longer than proposal_ttl (1 h) right after the change is judged, within revert_ttl or past it.
@pytest.mark.parametrize(("ttl_h", "paused_min", "reverted"), [(6, 70, True), (2, 180, False)])
async def test_a_waiting_revert_survives_its_finding_resolving_and_ends_at_revert_ttl(ttl_h: int, paused_min: int,
                                                                                      reverted: bool) -> None:
    clock, store, engines, policy = VirtualClock(), MemoryStore(), Engines(), Fades()
    loop = make_loop(store, engines, clock, rails=f"revert_ttl: {ttl_h}h", policy=policy)
    await judged_then_paused(loop, clock, store)
    policy.on = False  # the problem the change answered went away on its own; the change is still in place
    await ticks(loop, clock, 4 * paused_min)
    first, waiting = await store.actions()
    if waiting.state is S.APPROVED:
        assert ineffective_of(store, first.id).state == "open", "open while its revert waits"
    store.pause = None
    await ticks(loop, clock, 4)
    first, revert = await store.actions()
    assert engines.history == ([1, 3] if reverted else [1]), (ttl_h, paused_min)
    assert revert.state is (S.SUCCEEDED if reverted else S.EXPIRED)
    finding = ineffective_of(store, first.id)
    assert finding.state == "resolved"
    why = store.resolve_reasons[finding.id]
    assert why == (f"its revert (action {revert.id}) ended succeeded" if reverted else
                   f"the finding the action answered resolved; its revert (action {revert.id}) ended expired")


class NotApplied(Engines):
    """Says the fleet does not carry an action (its stamp is absent): a taken-over action is redone."""

    async def applied(self, order: Order) -> bool | None:
        return False


async def test_a_revert_taken_over_is_not_held_by_the_cooldown_of_the_change_it_undoes() -> None:
    clock, store, engines = VirtualClock(), MemoryStore(), NotApplied()
    await judged_then_paused(make_loop(store, engines, clock, rails=COOLS_2H), clock, store)
    _, revert = await store.actions()
    # A control plane started the revert and died before it applied it; the next one takes it over, unpaused.
    await store.transition(revert.id, S.APPROVED, S.STARTED, clock.now(), {"actuator": "fake"})
    store.pause = None
    clock.advance(15)
    await make_loop(store, engines, clock, rails=COOLS_2H).start()
    assert engines.history == [1, 3], "redone within the two hours' cooldown of the change it undoes"
    assert (await store.actions())[1].state is S.SUCCEEDED


class RevertFails(Engines):
    """Carries out the change; the revert fails (a webhook refuses the template)."""

    async def carry_out(self, order: Order) -> dict[str, Any]:
        if self.history:
            raise ActuationError("admission webhook denied the patch")
        return await super().carry_out(order)


async def test_a_revert_that_did_not_run_leaves_its_finding_open() -> None:
    clock, store, engines = VirtualClock(), MemoryStore(), RevertFails()
    await ticks(make_loop(store, engines, clock), clock, 4 * 12)
    first, revert = await store.actions()
    assert revert.state is S.FAILED and engines.history == [1]
    assert ineffective_of(store, first.id).state == "open", "the change it could not undo is still in place"
    # A year on, the failed revert is past the record retention: the finding that waited on it resolves, saying so.
    loop = make_loop(store, engines, clock)
    await store.compact(clock.now() + 1.0, Retention(raw_s=3600, minute_s=3600, hour_s=3600, records_s=1.0))
    assert revert.id not in store.action_rows
    await ticks(loop, clock, 1)
    gone = ineffective_of(store, first.id)
    assert gone.state == "resolved" and "no longer on record" in store.resolve_reasons[gone.id]


async def test_a_revert_is_not_held_by_the_cooldown_of_the_change_it_undoes() -> None:
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    await ticks(make_loop(store, engines, clock, rails=COOLS_2H), clock, 4 * 12)
    assert engines.history == [1, 3]


class GoesQuiet(SlowTpot):
    """TPOT at 100 ms until the change, then nothing: the pool stopped reporting it."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines

    async def observe(self, now: float) -> Observation:
        return Observation(signals=[] if self.engines.history else [Signal(now, "pool/chat", "tpot_p95", 0.1)])


async def test_an_outcome_is_never_judged_on_points_from_before_the_change() -> None:
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    await ticks(make_loop(store, engines, clock, source=GoesQuiet(engines)), clock, 4 * 12)
    first = (await store.actions())[0]
    assert first.outcome == "unmeasured", "judged on nothing from before it"
    assert not [a for a in await store.actions() if "reverts" in a.params], "and not reverted on such numbers"


class WorseOnceChanged(SlowTpot):
    """TPOT at 100 ms, and 150 ms once the engines run with fewer speculative tokens."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines

    async def observe(self, now: float) -> Observation:
        return Observation(signals=[Signal(now, "pool/chat", "tpot_p95", 0.1 if self.engines.tokens == 3 else 0.15)])


class GoesWithTheChange(Collapse):
    """A finding that resolves once the change ran: the series it watched ends with it (speculation switched off)."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines

    def evaluate(self, inp: PolicyInput) -> PolicyResult:
        if self.engines.tokens == 3:
            return super().evaluate(inp)
        key = FindingKey("test_spec", "pool/chat")
        return PolicyResult(resolved=[(key, "no drafts to judge")] if key in inp.open_findings else [])


async def test_a_finding_that_went_with_the_change_is_no_recovery_when_the_signal_got_worse() -> None:
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    loop = make_loop(store, engines, clock, policy=GoesWithTheChange(engines), source=WorseOnceChanged(engines))
    await ticks(loop, clock, 4 * 12)
    first, revert = await store.actions()
    assert (first.outcome, revert.params["reverts"]) == ("not_recovered", first.id)
    assert engines.history == [1, 3], "TPOT went from 100 to 150 ms: put back"
    await ticks(loop, clock, 4 * 20)  # the finding came back with the revert, as a new one: not tried on it again
    assert engines.history == [1, 3] and len(await store.actions()) == 2


class FailsOnce(MemoryStore):
    """The in-memory store, except that opening the first `action_ineffective` finding fails (an outage then)."""

    failed = False

    async def open_finding(self, finding: Any, now: float) -> Any:
        if finding.kind == INEFFECTIVE and not self.failed:
            self.failed = True
            raise StoreUnavailable("open_finding: connection reset")
        return await super().open_finding(finding, now)


async def test_a_judging_the_store_cut_off_is_finished_next_tick_once() -> None:
    clock, store, engines = VirtualClock(), FailsOnce(), Engines()
    loop = make_loop(store, engines, clock)
    with pytest.raises(StoreUnavailable):
        await ticks(loop, clock, 4 * 12)
    first, revert = await store.actions()
    assert first.outcome is None, "not judged until its revert and finding are written"
    await ticks(loop, clock, 8)
    first, revert = await store.actions()  # one revert, not two
    assert (first.outcome, revert.params["reverts"], engines.history) == ("not_recovered", first.id, [1, 3])
    assert ineffective_of(store, first.id).evidence["revert_id"] == revert.id
    # Its revert ran, though it was recorded a tick before the finding opened: the finding resolves with it.
    assert ineffective_of(store, first.id).state == "resolved"


class NoteFailsOnce(MemoryStore):
    """The in-memory store, except that the first "ineffective" note fails: the finding is open, the note not written."""

    failed = False

    async def note(self, action_id: int, event: str, now: float, detail: dict[str, Any]) -> None:
        if event == "ineffective" and not self.failed:
            self.failed = True
            raise StoreUnavailable("note: connection reset")
        await super().note(action_id, event, now, detail)


async def test_an_ineffective_note_the_store_refused_is_written_at_the_judging_after() -> None:
    clock, store, engines = VirtualClock(), NoteFailsOnce(), Engines()
    loop = make_loop(store, engines, clock)
    with pytest.raises(StoreUnavailable):
        await ticks(loop, clock, 4 * 12)
    await ticks(loop, clock, 8)
    first, revert = await store.actions()
    assert (first.outcome, revert.params["reverts"], engines.history) == ("not_recovered", first.id, [1, 3])
    [note] = [e for e in store.action_events(first.id) if e.event == "ineffective"]
    assert note.detail["finding"] == ineffective_of(store, first.id).id and note.detail["revert"] == revert.id


async def test_a_revert_another_active_action_of_its_kind_blocks_is_left_to_a_person() -> None:
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    loop = make_loop(store, engines, clock)
    while engines.history != [1]:
        await ticks(loop, clock, 1)
    # A person's proposal of the same kind on the pool, waiting: the store holds one active action per pool and kind.
    await store.create_action(NewAction(None, "tune_speculation", "chat",
                                        {"change": {"type": "Speculation", "num_speculative_tokens": 2, "step": 0}},
                                        "propose", "asked for by hand"), clock.now())
    await ticks(loop, clock, 4 * 12)  # judged; the ticks go on
    first = (await store.actions())[0]
    assert first.outcome == "not_recovered" and engines.history == [1]
    assert "is active already" in ineffective_of(store, first.id).cause


class TpotGoesStale(SlowTpot):
    """TPOT at 100 ms, with the pool's engine target down from `down_from` until `down_until` (its inputs stale)."""

    def __init__(self, down_from: float, down_until: float) -> None:
        self.down_from, self.down_until = down_from, down_until

    async def observe(self, now: float) -> Observation:
        seen = await super().observe(now)
        if self.down_from <= now < self.down_until:
            seen.unfit = {"chat": {"vllm": "target chat/chat-0/vllm is down (connection refused)"}}
        return seen


async def test_an_outcome_waits_for_numbers_fit_to_judge_it() -> None:
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    start = clock.now()
    # The change runs in the first minute; its five-minute verification falls while the pool's engine is down.
    source = TpotGoesStale(start + 4 * 60, start + 9 * 60)
    loop = make_loop(store, engines, clock, source=source)
    await ticks(loop, clock, 4 * 8)
    [first] = await store.actions()
    assert first.state is S.SUCCEEDED and first.outcome is None, "not judged on numbers it cannot trust"
    await ticks(loop, clock, 4 * 2)  # fit again
    first = (await store.actions())[0]
    assert first.outcome == "not_recovered" and engines.history[:1] == [1]
    # Unfit for three verify windows: judged unmeasured, saying why, and never reverted on them.
    clock2, store2, engines2 = VirtualClock(), MemoryStore(), Engines()
    loop2 = make_loop(store2, engines2, clock2, source=TpotGoesStale(clock2.now() + 60, clock2.now() + 3600))
    await ticks(loop2, clock2, 4 * 20)
    [only] = await store2.actions()
    assert only.outcome == "unmeasured" and engines2.history == [1]
    [judged] = [e for e in store2.action_events(only.id) if e.event == "outcome:unmeasured"]
    assert "chat/chat-0/vllm is down" in judged.detail["unfit"]


async def test_an_outcome_waits_for_points_after_a_clock_that_jumped() -> None:
    """A clock stepped forward past `verify_after` makes the change due with one point after it: not a settled state."""
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    loop = make_loop(store, engines, clock)
    await ticks(loop, clock, 2)
    assert engines.history == [1]
    clock.advance(400)  # a suspended machine resumes, past verify_after (5 min)
    await loop.tick()
    assert (await store.actions())[0].outcome is None
    await ticks(loop, clock, 2)
    assert (await store.actions())[0].outcome == "not_recovered"
    # Gone for longer than three verify windows: judged unmeasured, never reverted on one point.
    clock2, store2, engines2 = VirtualClock(), MemoryStore(), Engines()
    loop2 = make_loop(store2, engines2, clock2)
    await ticks(loop2, clock2, 2)
    clock2.advance(3600)
    await loop2.tick()
    [judged] = await store2.actions()
    assert judged.outcome == "unmeasured" and engines2.history == [1]


async def test_a_clock_stepped_back_drops_the_points_stamped_after_it() -> None:
    """Kept, points stamped after now would keep every new one out of the windows (as older), and the policies would
    read the last values from before the step for as long as the step."""
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    loop = make_loop(store, engines, clock)
    await ticks(loop, clock, 4)
    clock._now -= 45  # an NTP correction steps the wall clock back
    report = await loop.tick()
    assert "stepped back 45s" in report.errors["clock"]
    assert loop.windows.latest_ts("pool/chat", "tpot_p95") == clock.now(), "what the fleet shows now counts"


async def test_a_take_over_drops_points_stamped_ahead_of_its_clock() -> None:
    """Written by a replica whose clock ran ahead (or before a clock stepped back): kept, they would keep every new
    point out of the windows."""
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    await store.write_signals([Signal(clock.now() + 600, "pool/chat", "tpot_p95", 0.3)])
    loop = make_loop(store, engines, clock)
    await loop.start()
    await ticks(loop, clock, 1)
    assert loop.windows.latest("pool/chat", "tpot_p95") == 0.1 and loop.windows.latest_ts("pool/chat", "tpot_p95") == clock.now()


class RollsOut(Engines):
    """The change restarts the pool's engines one by one: for eight minutes after it the pool is rolling out."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock, self.changed_at = clock, None

    async def observe(self) -> FleetView:
        rolling = self.changed_at is not None and self.clock.now() < self.changed_at + 480
        return FleetView({"chat": PoolReplicas(3, 2 if rolling else 3, rolling=rolling)})

    async def carry_out(self, order: Order) -> dict[str, Any]:
        self.changed_at = self.clock.now()
        return await super().carry_out(order)


class FasterOnceRolledOut(SlowTpot):
    """TPOT at 100 ms until the rollout ends, 50 ms after: the change helped, which shows once every engine runs it."""

    def __init__(self, engines: RollsOut) -> None:
        self.engines = engines

    async def observe(self, now: float) -> Observation:
        done = self.engines.changed_at is not None and now >= self.engines.changed_at + 480
        return Observation(signals=[Signal(now, "pool/chat", "tpot_p95", 0.05 if done else 0.1)])


async def test_a_change_is_judged_once_its_rollout_has_settled() -> None:
    # Judged at verify_after (5 min) while two of three engines serve, some on the old arguments, the change reads as
    # no help, is reverted, and restarts every engine again.
    clock, store = VirtualClock(), MemoryStore()
    engines = RollsOut(clock)
    loop = make_loop(store, engines, clock, source=FasterOnceRolledOut(engines))
    await ticks(loop, clock, 4 * 7)
    [first] = await store.actions()
    assert first.outcome is None, "not judged mid-rollout"
    await ticks(loop, clock, 4 * 3)
    first, *_ = await store.actions()
    assert first.outcome == "recovered" and not any("reverts" in a.params for a in await store.actions())


async def test_a_change_another_one_followed_too_soon_is_not_judged_on_both() -> None:
    # A minute after the change finished, another action changed the pool (the autoscaler shed an engine, say): the
    # points after it are both changes', and no verdict on them is this one's.
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    loop = make_loop(store, engines, clock)
    await ticks(loop, clock, 1)
    [change] = await store.actions()
    assert change.finished_at is not None
    other = await store.create_action(NewAction(None, "scale_pool", "chat", {"change": {"type": "ScaleTo", "replicas": 2}},
                                                "act", "fewer engines"), change.finished_at + 30)
    await store.transition(other.id, S.PROPOSED, S.APPROVED, change.finished_at + 30, {"by": "rails"})
    await store.transition(other.id, S.APPROVED, S.STARTED, change.finished_at + 45, {"actuator": "fake"})
    await store.transition(other.id, S.STARTED, S.SUCCEEDED, change.finished_at + 50, {})
    await ticks(loop, clock, 4 * 7)
    judged = next(a for a in await store.actions() if a.id == change.id)
    assert judged.outcome == "unmeasured", "never judged, nor reverted, on another change's numbers"
    assert not any("reverts" in a.params for a in await store.actions())
    [event] = [e for e in store.action_events(change.id) if e.event == "outcome:unmeasured"]
    assert f"action {other.id} (scale_pool) changed chat" in event.detail["confounded"]


async def test_an_ineffective_finding_follows_its_revert_recorded_again_at_a_take_over() -> None:
    # The revert recorded with the finding was cancelled at a take-over that could not redo it, and another recorded
    # in its place ran: the change is undone, and the finding says so rather than staying open on the cancelled one.
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    loop = make_loop(store, engines, clock)
    now = clock.now()
    reverts = []
    for state in (S.CANCELLED, S.SUCCEEDED):
        a = await store.create_action(NewAction(None, "tune_speculation", "chat", {
            "change": {"type": "Speculation", "num_speculative_tokens": 3, "step": 0}, "reverts": 99}, "act",
            "revert action 99"), now)
        await store.transition(a.id, S.PROPOSED, S.APPROVED, now, {"by": "rails"})
        if state is S.CANCELLED:
            await store.transition(a.id, S.APPROVED, S.CANCELLED, now, {"reverting_as": a.id + 1})
        else:
            await store.transition(a.id, S.APPROVED, S.STARTED, now, {})
            await store.transition(a.id, S.STARTED, S.SUCCEEDED, now, {})
        reverts.append(a.id)
    f = await store.open_finding(NewFinding(INEFFECTIVE, "action/99", "warning", "action 99 did not help", "", {
        "action_id": 99, "revert_id": reverts[0], "finding_id": None}, "action_ineffective"), now)
    assert await loop._ineffective_over(f) == f"its revert (action {reverts[1]}) ended succeeded"


class FastWhileStale(TpotGoesStale):
    """TPOT at 100 ms, but 50 ms while the slow engine's target is down: the pool's sums lack its share then."""

    async def observe(self, now: float) -> Observation:
        seen = await super().observe(now)
        if seen.unfit:
            seen.signals = [Signal(now, "pool/chat", "tpot_p95", 0.05)]
        return seen


async def test_an_outcome_is_judged_on_points_from_after_its_inputs_were_whole_again() -> None:
    # The change helps nothing; while the pool's slow engine was not scraped its TPOT read half. Judged on the last
    # points at the first fit tick, four of five from the unfit stretch, it would read as recovered and stay.
    clock, store, engines = VirtualClock(), MemoryStore(), Engines()
    start = clock.now()
    loop = make_loop(store, engines, clock, source=FastWhileStale(start + 4 * 60, start + 9 * 60))
    await ticks(loop, clock, 4 * 9)
    assert (await store.actions())[0].outcome is None
    await ticks(loop, clock, 4)
    first = (await store.actions())[0]
    assert first.outcome == "not_recovered"
    [judged] = [e for e in store.action_events(first.id) if e.event == "outcome:not_recovered"]
    assert judged.detail["after"] == pytest.approx(0.1)


class Shifting(Engines):
    """`ready` of 3 engines per the times given (relative to the first change): engines starting or crash-looping."""

    def __init__(self, clock: VirtualClock, short: tuple[float, float]) -> None:
        super().__init__()
        self.clock, self.short, self.changed_at = clock, short, None

    async def observe(self) -> FleetView:
        t = None if self.changed_at is None else self.clock.now() - self.changed_at
        return FleetView({"chat": PoolReplicas(3, 2 if t is not None and self.short[0] <= t < self.short[1] else 3)})

    async def carry_out(self, order: Order) -> dict[str, Any]:
        self.changed_at = self.changed_at or self.clock.now()
        return await super().carry_out(order)


async def started_later(store: MemoryStore, at: float) -> int:
    """Another action on the pool (the autoscaler's, say), started at `at`."""
    other = await store.create_action(NewAction(None, "scale_pool", "chat", {"change": {"type": "ScaleTo", "replicas": 4}},
                                                "act", "more engines"), at - 15)
    await store.transition(other.id, S.PROPOSED, S.APPROVED, at - 15, {"by": "rails"})
    await store.transition(other.id, S.APPROVED, S.STARTED, at, {"actuator": "fake"})
    await store.transition(other.id, S.STARTED, S.SUCCEEDED, at + 5, {})
    return other.id


async def test_what_came_after_the_next_change_does_not_hold_back_judging_on_the_points_before_it() -> None:
    # Two steady minutes after the change, another scale started engines that took two minutes to come up: the
    # points before it judge the change, unsettled as the pool was after it.
    clock, store = VirtualClock(), MemoryStore()
    engines = Shifting(clock, (135.0, 240.0))
    loop = make_loop(store, engines, clock)
    await ticks(loop, clock, 1)
    [change] = await store.actions()
    assert change.finished_at is not None
    await started_later(store, change.finished_at + 120)
    await ticks(loop, clock, 4 * 7)
    judged = next(a for a in await store.actions() if a.id == change.id)
    assert judged.outcome == "not_recovered"


async def test_a_change_that_leaves_its_pool_unsettled_is_judged_and_reverted_all_the_same() -> None:
    # Its new engines crash-loop: the pool never settles. Three verify windows on it is judged on what it did.
    clock, store = VirtualClock(), MemoryStore()
    engines = Shifting(clock, (0.0, math.inf))
    loop = make_loop(store, engines, clock, rails=COOLS_2H)
    await ticks(loop, clock, 4 * 14)
    assert (await store.actions())[0].outcome is None
    await ticks(loop, clock, 4 * 2)
    first, revert, *_ = await store.actions()
    assert first.outcome == "not_recovered" and revert.params["reverts"] == first.id
