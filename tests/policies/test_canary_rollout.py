"""The rollout policy: the engines that started after a pool's change are judged against the others;
a failed canary is rolled back, an overlapping rollout is held, an ended one resolves."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from policies.canary_rollout import KIND, CanaryRegression, CanaryRolloutSettings
from policies.types import ActionKind, FindingKey, OpenFinding, PolicyInput, PoolState, RollBack, Severity
from policies.windows import SignalWindows

STEP = 15.0
CHANGE = 3600.0  # the pool's workload changed an hour in; its canary engine reports from then on


def fleet(slow: float, minutes: float = 20.0, pools: tuple[str, ...] = ("decode",),
          canary_from: dict[str, float] | None = None, longer: float | None = None) -> tuple[SignalWindows, float]:
    """Three old engines per pool from the start, one new one from its pool's change, TPOT `slow` times theirs (and
    its requests' end-to-end time `longer` times, where given, else `slow` times)."""
    w = SignalWindows(horizon_s=3 * 3600)
    end = CHANGE + minutes * 60
    for pool in pools:
        since = (canary_from or {}).get(pool, CHANGE)
        for pod, first, factor in ((f"{pool}-0", 0.0, 1.0), (f"{pool}-1", 0.0, 1.0), (f"{pool}-2", 0.0, 1.0),
                                   (f"{pool}-7f9c-0", since + 20, slow)):
            t, i = first, 0
            while t <= end:
                wobble = 1 + 0.03 * ((i * 7 + len(pod)) % 5 - 2)
                subject = f"engine/{pool}/{pod}/0"
                e2e = longer if longer is not None and pod.startswith(f"{pool}-7f9c") else factor
                for name, value in (("request_rate", 4.0), ("tpot_mean", 0.02 * factor * wobble),
                                    ("ttft_mean", 0.3 * wobble), ("e2e_mean", 4.0 * e2e * wobble),
                                    ("request_error_rate", 0.0)):
                    w.add(t, subject, name, value)
                t, i = t + STEP, i + 1
    return w, end


def run(w: SignalWindows, now: float, changed: dict[str, float], open_findings: dict | None = None,
        settings: CanaryRolloutSettings | None = None):
    pools = {p: PoolState(p, "decode", 4, 4, 1, 8) for p in ("decode", "prefill")}
    return CanaryRegression(settings).evaluate(PolicyInput(now, w, pools, open_findings or {}, changed))


def test_a_slower_new_revision_is_rolled_back_with_the_verdict_as_evidence() -> None:
    w, now = fleet(1.15)
    res = run(w, now, {"decode": CHANGE})
    [f] = res.findings
    assert f.key == FindingKey(KIND, "pool/decode") and f.severity is Severity.CRITICAL
    assert "decode-7f9c-0" in f.summary and "tpot" in f.summary
    [p] = f.proposals
    assert p.kind is ActionKind.ROLLBACK and p.change == RollBack("decode") and "tpot +1" in p.reason
    assert f.evidence["canary"] == ["decode-7f9c-0"] and f.evidence["baseline"] == ["decode-0", "decode-1", "decode-2"]
    tpot = next(m for m in f.evidence["metrics"] if m["name"] == "tpot")
    assert tpot["result"] == "fail" and tpot["lower"] > 1.0 and "canary" in tpot["reason"]
    assert set(CanaryRegression().reads) >= {"tpot_mean", "request_rate"}


def test_the_same_revision_is_not_a_finding_and_nothing_is_judged_without_a_change() -> None:
    w, now = fleet(1.0)
    assert run(w, now, {"decode": CHANGE}).findings == []
    w, now = fleet(1.3)
    assert run(w, now, {}).findings == []  # no rollout known: every engine is as old as the others


def test_a_canary_that_restarts_is_rolled_back_though_its_latency_reads_as_the_baseline() -> None:
    # Between crashes a crash-looping canary serves as fast as the others; the loop's scrapes record each new process
    # in its pod. A baseline pod's restart is no canary's fault, nor is one of the canary's before its rollout.
    w, now = fleet(1.0, minutes=4)
    w.add(CHANGE - 60, "target/decode/decode-7f9c-0/vllm", "restarts", 1.0)
    w.add(CHANGE + 100, "target/decode/decode-1/vllm", "restarts", 1.0)
    assert run(w, now, {"decode": CHANGE}).findings == []
    w.add(CHANGE + 130, "target/decode/decode-7f9c-0/vllm", "restarts", 1.0)
    [f] = run(w, now, {"decode": CHANGE}).findings
    assert f.severity is Severity.CRITICAL and "restarts" in f.summary
    assert "decode-7f9c-0 1 time" in f.cause
    # A pod a pattern names beside the stable ones (a canary Deployment's) likewise.
    named = CanaryRolloutSettings(canary_pods={"decode": "decode-7f9c-.*"})
    [f] = run(w, now, {}, settings=named).findings
    assert "restarts" in f.summary
    # A StatefulSet's pod is recreated under its name as the rollout reaches it, a new process as a crash is: such a
    # pool's restarts are the gate's to read.
    pools = {"decode": PoolState("decode", "decode", 4, 4, 1, 8, keeps_names=True)}
    inp = PolicyInput(now, w, pools, {}, {})
    assert CanaryRegression(named).evaluate(inp).findings == []
    [p] = f.proposals
    assert p.kind is ActionKind.ROLLBACK and "restarts" not in p.inputs


def test_a_canary_pattern_names_the_canary_of_a_deployment_beside_the_stable_one() -> None:
    w, now = fleet(1.3)
    s = CanaryRolloutSettings(canary_pods={"decode": r"decode-7f9c-\d+"})
    [f] = run(w, now, {}, settings=s).findings
    assert f.severity is Severity.CRITICAL
    with pytest.raises(ValidationError, match="not a regular expression"):
        CanaryRolloutSettings(canary_pods={"decode": "(("})
    with pytest.raises(ValidationError, match="quantiles need"):
        CanaryRolloutSettings(gate={"metrics": [{"name": "tpot", "statistic": "p95"}]})


def engine(w: SignalWindows, pool: str, pod: str, first: float, last: float, slow: float = 1.0) -> None:
    """One engine's reports from `first` to `last`, TPOT `slow` times the old engines'."""
    t, i = first, 0
    while t <= last:
        wobble = 1 + 0.03 * ((i * 7 + len(pod)) % 5 - 2)
        for name, value in (("request_rate", 4.0), ("tpot_mean", 0.02 * slow * wobble), ("ttft_mean", 0.3 * wobble),
                            ("e2e_mean", 4.0 * slow * wobble), ("request_error_rate", 0.0)):
            w.add(t, f"engine/{pool}/{pod}/0", name, value)
        t, i = t + STEP, i + 1


def test_a_canary_deployments_earlier_pods_are_no_part_of_its_new_rollout() -> None:
    """The canary Deployment ran the stable revision for an hour, then got the new one: its old pod, gone a minute
    after the new one came, matches the pattern too. Counted from its first report, the rollout dated an hour back,
    its window was over at once, and the old pod's hour of good steps passed a canary 15 % slower."""
    s = CanaryRolloutSettings(canary_pods={"decode": r"decode-canary-.*"})
    for old_until in ("gone", "serving"):  # gone a minute after the new pod came, or still serving beside it
        w, now = fleet(1.0, pools=("decode",))
        engine(w, "decode", "decode-canary-5b8f-x2k4p", 0.0, CHANGE + 60 if old_until == "gone" else now)
        engine(w, "decode", "decode-canary-c7d9-q8z1m", CHANGE + 20, now, slow=1.15)
        [f] = run(w, now, {}, settings=s).findings
        assert f.severity is Severity.CRITICAL and [p.kind for p in f.proposals] == [ActionKind.ROLLBACK], old_until
        assert f.evidence["canary"] == ["decode-canary-c7d9-q8z1m"]


def test_a_rollout_past_its_window_holds_no_other_pool_back() -> None:
    """A canary slot kept at the stable revision all along is a rollout that never ends: it was always the first, and
    a real rollout of another pool got only a warning, however bad."""
    w, now = fleet(1.3, pools=("prefill",))
    for pod in ("decode-0", "decode-1", "decode-2"):
        engine(w, "decode", pod, 0.0, now)
    engine(w, "decode", "decode-canary-0", 0.0, now)
    s = CanaryRolloutSettings(canary_pods={"decode": r"decode-canary-.*"})
    by = {f.key.subject: f for f in run(w, now, {"prefill": CHANGE}, settings=s).findings}
    assert by["pool/prefill"].severity is Severity.CRITICAL and by["pool/prefill"].proposals
    assert "pool/decode" not in by


def test_one_pool_at_a_time_and_an_ended_rollout_resolves() -> None:
    w, now = fleet(1.3, pools=("decode", "prefill"), canary_from={"prefill": CHANGE + 300})
    res = run(w, now, {"decode": CHANGE, "prefill": CHANGE + 300})
    by = {f.key.subject: f for f in res.findings}
    assert by["pool/decode"].severity is Severity.CRITICAL
    assert by["pool/prefill"].severity is Severity.WARNING and "one pool at a time" in by["pool/prefill"].summary
    assert by["pool/prefill"].proposals == ()
    key = FindingKey(KIND, "pool/decode")
    rolled_back, _ = fleet(1.0, minutes=20)
    # after the rollback the canary is gone: only the three old engines report
    gone = SignalWindows(horizon_s=3 * 3600)
    for subject in rolled_back.subjects("request_rate"):
        if "7f9c" not in subject:
            for name in ("request_rate", "tpot_mean"):
                for ts, v in rolled_back.series(subject, name):
                    gone.add(ts, subject, name, v)
    res = run(gone, now, {"decode": CHANGE}, {key: OpenFinding(key, now - 600, {})})
    assert res.findings == [] and res.resolved[0][0] == key and "rollout ended" in res.resolved[0][1]


def test_a_canary_still_undecided_when_the_window_ends_goes_to_a_person() -> None:
    w, now = fleet(1.04, minutes=35)  # +4 %: below the allowed +5 %, near enough not to pass quickly
    s = CanaryRolloutSettings(gate={"max_window": "30m", "metrics": [{"name": "tpot", "critical": True,
                                                                       "allowed": 0.05}]})
    res = run(w, now, {"decode": CHANGE}, settings=s)
    if res.findings:
        [f] = res.findings
        assert f.severity is Severity.WARNING and "a person decides" in f.summary and f.proposals == ()


def test_a_decided_marginal_canary_is_told_before_its_rollout_can_finish() -> None:
    # The new revision answers at the old one's TPOT but writes longer answers: the end-to-end time, not critical, is
    # confidently worse. Argo's steps end well before the gate's window: told only at the window's end, never told.
    w, now = fleet(1.0, minutes=10, longer=1.3)
    [f] = run(w, now, {"decode": CHANGE}).findings
    assert f.severity is Severity.WARNING and "marginal" in f.summary and "a person decides" in f.summary
    assert f.proposals == () and f.evidence["result"] == "marginal" and f.evidence["decided"]


def canary_gone(w: SignalWindows, since: float) -> SignalWindows:
    """`w` with the canary engine reporting nothing from `since` on."""
    out = SignalWindows(horizon_s=3 * 3600)
    for subject in w.subjects("request_rate"):
        for name in ("request_rate", "tpot_mean", "ttft_mean", "e2e_mean", "request_error_rate"):
            for ts, v in w.series(subject, name):
                if "7f9c" not in subject or ts < since:
                    out.add(ts, subject, name, v)
    return out


def test_a_canary_that_stopped_reporting_is_no_longer_an_arm() -> None:
    w, now = fleet(1.3)
    stopped = canary_gone(w, now - 300)  # the canary was deleted five minutes ago
    key = FindingKey(KIND, "pool/decode")
    res = run(stopped, now, {"decode": CHANGE}, {key: OpenFinding(key, now - 900, {})})
    assert res.findings == [] and res.resolved and "rollout ended" in res.resolved[0][1]


def test_a_canary_that_crashed_while_the_pool_still_rolls_out_keeps_its_bad_steps() -> None:
    # The slow canary pod crashes (and restarts) mid-rollout: its history is the rollout's, and the rollback stands.
    w, now = fleet(1.3)
    crashed = canary_gone(w, now - 300)
    key = FindingKey(KIND, "pool/decode")
    pools = {"decode": PoolState("decode", "decode", 4, 3, 1, 8, rolling=True)}
    res = CanaryRegression().evaluate(PolicyInput(now, crashed, pools, {key: OpenFinding(key, now - 900, {})},
                                                  {"decode": CHANGE}))
    [f] = res.findings
    assert not res.resolved and f.severity is Severity.CRITICAL and f.evidence["canary"] == ["decode-7f9c-0"]


def test_a_canary_upgraded_past_the_per_request_tpot_is_judged_on_the_latency_both_arms_have() -> None:
    # Same speed per token; the canary's vLLM has the per-request TPOT histogram, the baseline's does not (its stored
    # TPOT is the inter-token latency). Read each on its own, the canary looks 40 % slower and would be rolled back.
    w, now = fleet(1.4)
    for subject in list(w.subjects("request_rate")):
        canary = "7f9c" in subject
        for ts, _ in w.series(subject, "request_rate"):
            w.add(ts + 0.5, subject, "tpot_per_request", 1.0 if canary else 0.0)
            w.add(ts + 0.5, subject, "itl_mean", 0.02)
            w.add(ts + 0.5, subject, "generation_tokens_rate", 200.0)
    s = CanaryRolloutSettings(gate={"metrics": [{"name": "tpot", "critical": True}]})
    assert run(w, now, {"decode": CHANGE}, settings=s).findings == []


def promoted(slow: float, load: float = 1.0, drained_early: int = 0) -> tuple[SignalWindows, float]:
    """Three old engines until ten minutes after the change (and `drained_early` more that left a minute after it),
    three new ones from the change on: a promotion; then fifteen minutes of the new revision alone, at `load` times
    the old per-engine load."""
    w = SignalWindows(horizon_s=3 * 3600)
    promoted_at, end = CHANGE + 600, CHANGE + 1500
    for pod, first, last, factor in [(f"decode-{i}", 0.0, promoted_at, 1.0) for i in range(3)] + \
                                    [(f"decode-{i}", 0.0, CHANGE + 60, 1.0) for i in range(3, 3 + drained_early)] + \
                                    [(f"decode-7f9c-{i}", CHANGE + 20, end, slow) for i in range(3)]:
        t, i = first, 0
        while t <= last:
            wobble = 1 + 0.03 * ((i * 7 + len(pod)) % 5 - 2)
            rate = 4.0 * (load if "7f9c" in pod and t > promoted_at else 1.0)
            subject = f"engine/decode/{pod}/0"
            for name, value in (("request_rate", rate), ("tpot_mean", 0.02 * factor * wobble),
                                ("ttft_mean", 0.3 * wobble), ("e2e_mean", 4.0 * wobble), ("request_error_rate", 0.0)):
                w.add(t, subject, name, value)
            t, i = t + STEP, i + 1
    return w, end


def test_after_a_promotion_it_keeps_watching_against_the_old_level_at_matched_load() -> None:
    w, now = promoted(1.15)
    [f] = run(w, now, {"decode": CHANGE}).findings
    assert f.severity is Severity.WARNING and f.proposals == () and f.evidence["post_promotion"]
    assert "since its promotion" in f.summary and "tpot" in f.summary and "no concurrent baseline" in f.cause
    assert run(*promoted(1.0), {"decode": CHANGE}).findings == []
    # old engines drained early in the rollout served less of the lookback: the load per engine is still matched
    assert run(*promoted(1.15, drained_early=2), {"decode": CHANGE}).findings
    # at twice the load per engine no step is comparable: nothing is concluded
    assert run(*promoted(1.15, load=2.0), {"decode": CHANGE}).findings == []
    # and the watch ends
    w, now = promoted(1.15)
    s = CanaryRolloutSettings(watch_after_promotion="10m")
    assert run(w, now, {"decode": CHANGE}, settings=s).findings == []
