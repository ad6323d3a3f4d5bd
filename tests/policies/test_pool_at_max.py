"""A pool held at its maximum while the sizer asks for more: a finding that names the ceiling, not the symptom."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from policies.autoscale import TARGET
from policies.pool_at_max import KIND, PoolAtMax, PoolAtMaxSettings
from policies.types import FindingKey, OpenFinding, PolicyInput, PoolState, Severity
from policies.windows import SignalWindows

NOW = 3600.0
KEY = FindingKey(KIND, "pool/prefill")


def prefill(desired: int = 6, max_replicas: int = 6) -> PoolState:
    return PoolState("prefill", "prefill", desired, desired, 1, max_replicas, ttft_p95_slo=0.5)


def plans(asked: Sequence[tuple[float, float]], ttft: float = 0.3, since: float = NOW - 1200,
          until: float = NOW) -> SignalWindows:
    """The sizer's plan every 15 s from `since` to `until`: `asked` as (from, engines) steps; TTFT p95 at `ttft`."""
    w = SignalWindows(7200.0)
    t = since
    while t <= until:
        engines = next(n for start, n in reversed(asked) if t >= start)
        w.extend([(t, "pool/prefill", TARGET, engines), (t, "pool/prefill", "ttft_p95", ttft)])
        t += 15.0
    return w


def run(w: SignalWindows, pool: PoolState | None = None, open_: bool = False) -> tuple[list, list]:
    opened = {KEY: OpenFinding(KEY, NOW - 900, {})} if open_ else {}
    res = PoolAtMax().evaluate(PolicyInput(NOW, w, {"prefill": pool or prefill()}, opened))
    return res.findings, res.resolved


def test_a_pool_held_at_its_maximum_while_every_plan_asks_for_more_opens_a_warning() -> None:
    # The last plan is the tick before's: the policies run before the sizer plans.
    [f], _ = run(plans([(0.0, 5.0), (NOW - 700, 9.0), (NOW - 200, 11.0)], until=NOW - 15))
    assert (f.key, f.severity, f.runbook) == (KEY, Severity.WARNING, KIND)
    assert f.evidence | {"broken": None} == {"signal": TARGET, "max": 6, "desired": 6, "asked": 11, "asked_most": 11,
                                               "hold_s": 600.0, "broken": None}
    assert "maximum of 6 replicas; the load asks for 11 (up to 11 over 10 min)" in f.summary
    assert "objectives held so far" in f.cause and "raise `replicas.max`" in f.cause


def test_with_its_objective_broken_meanwhile_it_is_critical() -> None:
    [f], _ = run(plans([(0.0, 9.0)], ttft=0.8))
    assert f.severity is Severity.CRITICAL and len(f.evidence["broken"]["ttft_p95"]) == 10
    assert "it broke TTFT p95 in 10 minute(s)" in f.cause


@pytest.mark.parametrize(("w", "pool"), [
    pytest.param(plans([(0.0, 5.0), (NOW - 300, 9.0)]), None, id="a-burst-shorter-than-the-hold"),
    pytest.param(plans([(0.0, 9.0), (NOW - 400, 6.0), (NOW - 380, 9.0)]), None, id="one-plan-within-it-meanwhile"),
    pytest.param(plans([(0.0, 9.0)]), prefill(desired=5), id="below-its-maximum-it-can-still-grow"),
    pytest.param(plans([(0.0, 9.0)], since=NOW - 300), None, id="planned-for-too-little-of-the-hold"),
    pytest.param(plans([(0.0, 9.0)], until=NOW - 45), None, id="not-planned-lately"),
])
def test_it_opens_on_nothing_less(w: SignalWindows, pool: PoolState | None) -> None:
    findings, resolved = run(w, pool)
    assert findings == [] and resolved == []


def test_it_resolves_once_the_plans_fit_for_resolve_points_in_a_row() -> None:
    three = plans([(0.0, 9.0), (NOW - 30, 6.0)])
    assert run(three, open_=True) == ([], []), "three plans within it: not yet"
    [(key, why)] = run(plans([(0.0, 9.0), (NOW - 45, 6.0)]), open_=True)[1]
    assert key == KEY and "the last 4 plans fit within its maximum of 6" in why
    raised = run(plans([(0.0, 9.0)]), prefill(max_replicas=10), open_=True)
    assert raised[1] and raised[0] == [], "a raised maximum resolves it too"
    gap = plans([(0.0, 9.0)], until=NOW - 300)
    assert run(gap, open_=True) == ([], []), "not planned lately: neither re-opened nor resolved"
    [(_, why)] = run(plans([(0.0, 9.0)], until=NOW - 700), open_=True)[1]
    assert why == "not planned for 10 min", "the sizer off, the pool scaled to zero: nothing would resolve it"


def test_a_pool_gone_from_the_fleet_file_resolves_it() -> None:
    opened = {FindingKey(KIND, "pool/old"): OpenFinding(FindingKey(KIND, "pool/old"), NOW - 900, {})}
    res = PoolAtMax().evaluate(PolicyInput(NOW, SignalWindows(60.0), {}, opened))
    assert [k for k, _ in res.resolved] == [FindingKey(KIND, "pool/old")]


def test_a_hold_too_short_for_three_plans_is_refused() -> None:
    assert PoolAtMaxSettings(hold=30.0).problems(15.0)[0][0] == "hold"
    assert PoolAtMaxSettings().problems(15.0) == []


def test_a_gang_pool_whose_maximum_is_no_whole_number_of_groups_is_held_at_the_groups_it_can_have() -> None:
    # Groups of two pods, replicas.max 5: the rails and the sizer stop it at 4.
    gang = PoolState("prefill", "prefill", 4, 4, 2, 5, ttft_p95_slo=0.5, gang=2)
    [f], _ = run(plans([(0.0, 8.0)]), gang)
    assert f.evidence["max"] == 4 and "maximum of 4 replicas (whole groups of 2 within replicas.max 5)" in f.summary


def test_an_open_finding_follows_the_load_while_the_pool_stays_at_its_maximum() -> None:
    # Opened an hour ago; the plans went between 9 and 5 since, and now the objective breaks at 9: told again, critical,
    # though the plans were not all over the maximum for the hold.
    [f], resolved = run(plans([(0.0, 9.0), (NOW - 400, 5.0), (NOW - 380, 9.0)], ttft=0.8), open_=True)
    assert resolved == [] and f.severity is Severity.CRITICAL and f.evidence["asked"] == 9
    assert run(plans([(0.0, 9.0), (NOW - 10, 5.0)]), open_=True) == ([], []), "a plan within it: neither told nor resolved"
