"""Speculative-decoding collapse: detection, cause, proposals, hysteresis and re-baselining.

Series are generated from a small model of one pool: `c` of the request-steps carry a draft
whose per-position acceptance is `acc`; the collector's signals follow from it as vLLM's counters
would make them (yield = accepted / generated, drafts per generated token, per-position rates).
"""

from __future__ import annotations

import random

import pytest

from policies.spec_decode import SpecDecodeCollapse, SpecDecodeSettings
from policies.types import ActionKind, FindingKey, OpenFinding, PolicyInput, PoolState, Speculation
from policies.windows import SignalWindows
from tests.policies.ticking import Ticking

POOL = "pool/decode"
KEY = FindingKey("spec_decode_collapse", POOL)
STEP = 15.0
EAGLE = [0.8, 0.6, 0.4]  # acceptance per draft at positions 0..2: mean acceptance length 2.8
JSON = [0.35, 0.1, 0.02]  # grammar-constrained traffic: most drafts rejected


class Pool:
    """Appends one scrape of pool (and two engines') speculative signals per call."""

    def __init__(self, seed: int = 1) -> None:
        self.w = SignalWindows(horizon_s=3 * 3600)
        self.ts = 0.0
        self.rng = random.Random(seed)

    def tick(self, acc: list[float] | None, *, tpot: float = 0.030, coverage: float = 1.0, gen: float = 2000.0,
             n: int = 1) -> Pool:
        for _ in range(n):
            self.ts += STEP
            noisy_tpot = tpot * (1 + self.rng.gauss(0, 0.03))
            self._add("generation_tokens_rate", gen)
            self._add("tpot_p95", noisy_tpot)
            if acc is None:  # no speculative config: vLLM registers no spec counters
                continue
            acc_n = [min(1.0, max(0.0, a + self.rng.gauss(0, 0.02))) for a in acc]
            a = sum(acc_n)
            steps = gen / (1 + coverage * a)  # request-steps this interval
            drafts = coverage * steps
            self._add("spec_draft_rate", drafts)
            self._add("spec_yield", drafts * a / gen)
            if drafts > 0:
                self._add("spec_acceptance_rate", a / len(acc_n))
                self._add("spec_mean_acceptance_length", 1 + a)
                for i, v in enumerate(acc_n):
                    self._add(f"spec_acceptance_pos_{i}", v)
            for e in ("d0/0", "d1/0"):
                self.w.add(self.ts, f"engine/decode/{e}", "spec_yield", drafts * a / gen)
        return self

    def _add(self, name: str, value: float) -> None:
        self.w.add(self.ts, POOL, name, value)

    def run(self, open_findings: dict | None = None, slo: float | None = None,
            settings: SpecDecodeSettings | None = None):
        pools = {"decode": PoolState("decode", "decode", 2, 2, 1, 4, tpot_p95_slo=slo)}
        return SpecDecodeCollapse(settings).evaluate(PolicyInput(self.ts, self.w, pools, open_findings or {}))


def healthy(seed: int = 1, n: int = 40) -> Pool:
    return Pool(seed).tick(EAGLE, n=n)


def opened(pool: Pool) -> dict:
    [finding] = pool.run().findings
    return {KEY: OpenFinding(KEY, pool.ts, finding.evidence)}


@pytest.mark.parametrize("seed", range(5))
def test_noisy_healthy_speculation_stays_quiet(seed: int) -> None:
    pool = healthy(seed, n=120)
    for _ in range(40):
        assert not pool.tick(EAGLE).run().findings


def test_constrained_traffic_collapse_opens_with_cause_and_a_tuned_proposal() -> None:
    pool = healthy().tick(JSON, tpot=0.045, n=2)
    [f] = pool.run().findings
    assert f.key == KEY and f.runbook == "spec_decode_collapse" and f.severity == "critical"
    ev = f.evidence
    assert ev["cause"] == "acceptance_collapse"
    assert ev["baseline"] == pytest.approx(0.64, abs=0.03) and ev["value"] < 0.35
    assert ev["statistic"] > ev["threshold"] == 5.0
    assert ev["num_speculative_tokens"] == 3 and ev["speculation_costs_latency"]
    assert ev["acceptance_rate"] < ev["baseline_acceptance_rate"] / 3
    # Position 0 is still accepted in ~30 % of drafts, position 1 in ~10 %: keep one position.
    [p] = f.proposals
    assert (p.kind, p.pool, p.change, p.verify_signal, p.verify_lower_is_better) == (
        ActionKind.TUNE_SPECULATION, "decode", Speculation(1), "tpot_p95", True)
    assert "from 3 to 1" in p.reason and "revert" in p.reason
    assert ev["suggested_actions"] == [p.reason]


def test_one_low_point_is_not_a_collapse() -> None:
    assert not healthy().tick(JSON, tpot=0.045).run().findings


def test_a_collapse_that_still_pays_for_its_cost_is_kept_with_the_reason() -> None:
    # JSON traffic: 1.47 tokens per step for a step that costs 1 + 3 x (0.10 + 0.03) = 1.39 plain ones.
    [f] = healthy().tick(JSON, tpot=0.030, n=2).run().findings
    assert f.severity == "info" and f.proposals == ()
    ev = f.evidence
    assert not ev["speculation_costs_latency"] and ev["speculation_pays"]
    assert ev["estimated_speedup"] == pytest.approx(1.47 / 1.39, abs=0.03)
    assert ev["baseline_estimated_speedup"] == pytest.approx(2.8 / 1.39, abs=0.05)
    assert "still pays for its cost" in f.cause and "kept" in f.cause


def test_a_collapse_that_no_longer_pays_is_changed_before_tpot_shows_it() -> None:
    [f] = healthy().tick([0.2, 0.05, 0.0], tpot=0.030, n=2).run().findings  # 1.25 tokens per 1.39-step
    assert f.severity == "warning" and not f.evidence["speculation_pays"]
    [p] = f.proposals
    assert p.kind in (ActionKind.TUNE_SPECULATION, ActionKind.DISABLE_SPECULATION)
    assert "no longer pays" in f.cause


def test_a_sustained_acceptance_fall_the_yield_hides_is_judged_on_cost() -> None:
    # A moderate share of constrained traffic: acceptance 40 % lower at every position. The yield,
    # which compresses such falls, drops by under 30 % and never opened a finding; now it is judged.
    mixed = [a * 0.6 for a in EAGLE]
    pool = healthy(n=60).tick(mixed, n=7)
    assert not pool.run().findings, "not sustained yet"
    [f] = pool.tick(mixed).run().findings
    ev = f.evidence
    assert (ev["baseline"] - ev["value"]) / ev["baseline"] < 0.30, "the yield alone would not have opened it"
    assert ev["acceptance_rate"] == pytest.approx(0.6 * ev["baseline_acceptance_rate"], rel=0.1)
    assert ev["speculation_pays"] and f.severity == "info" and f.proposals == ()
    assert "kept" in f.cause and f"{ev['estimated_speedup']:.2f}x" in f.cause


def test_tpot_above_the_slo_counts_as_a_cost() -> None:
    [f] = healthy().tick(JSON, tpot=0.031, n=2).run(slo=0.025).findings
    assert f.severity == "critical" and f.proposals


def test_vanishing_ngram_drafts_are_caught_by_the_yield_and_disable_speculation() -> None:
    # An n-gram drafter on sampled text: half the request-steps found a match before, none now.
    ngram = [0.5, 0.3, 0.2]
    pool = Pool().tick(ngram, coverage=0.5, n=40).tick(ngram, coverage=0.0, tpot=0.036, n=2)
    [f] = pool.run().findings
    assert f.evidence["acceptance_rate"] is None, "undefined without drafts; older values must not stand in"
    assert f.evidence["cause"] == "drafts_vanished" and not f.evidence["speculation_pays"]
    assert f.evidence["value"] == 0.0 and f.evidence["draft_share"] == 0.0
    [p] = f.proposals
    assert (p.kind, p.pool, p.verify_signal) == (ActionKind.DISABLE_SPECULATION, "decode", "tpot_p95")


def test_every_position_rejected_disables() -> None:
    [f] = healthy().tick([0.05, 0.01, 0.0], tpot=0.04, n=2).run().findings
    assert [p.kind for p in f.proposals] == [ActionKind.DISABLE_SPECULATION]


def test_idle_or_unspeculated_pools_are_not_judged() -> None:
    assert not healthy().tick(JSON, tpot=0.045, gen=1.0, n=3).run().findings
    assert not Pool().tick(None, n=60).run().findings


def test_too_little_history_is_not_judged() -> None:
    assert not Pool().tick(EAGLE, n=12).tick(JSON, tpot=0.045, n=2).run().findings


def test_open_finding_keeps_its_baseline_updates_and_resolves_with_hysteresis() -> None:
    pool = healthy().tick(JSON, tpot=0.045, n=2)
    opening = opened(pool)
    baseline = opening[KEY].evidence["baseline"]
    # A long incident: the frozen baseline holds although the window is now mostly collapsed.
    pool.tick(JSON, tpot=0.045, n=100)
    [f] = pool.run(opening).findings
    assert f.evidence["baseline"] == baseline and f.evidence["value"] < 0.35
    pool.tick(EAGLE, n=3)
    assert not pool.run(opening).resolved
    pool.tick(EAGLE)
    assert pool.run(opening).resolved == [(KEY, "speculative yield back near its baseline")]


def test_a_noisy_recovery_does_not_resolve() -> None:
    pool = healthy().tick(JSON, tpot=0.045, n=2)
    opening = opened(pool)
    pool.tick(EAGLE, n=2).tick(JSON, tpot=0.045).tick(EAGLE, n=2)
    result = pool.run(opening)
    assert not result.resolved and result.findings


def test_switching_speculation_off_resolves() -> None:
    pool = healthy().tick(JSON, tpot=0.045, n=2)
    opening = opened(pool)
    pool.tick(None, tpot=0.028, n=4)
    assert not pool.run(opening).resolved, "two minutes without yields are needed"
    pool.tick(None, tpot=0.028, n=5)
    [(key, why)] = pool.run(opening).resolved
    assert key == KEY and "switched off" in why
    assert not pool.run().findings, "old collapsed yields do not reopen it"


def test_a_lull_is_neither_a_switch_off_nor_a_recovery() -> None:
    """No tokens, so no yield (0 drafts over 0 steps): resolved then, the collapse would be its own baseline when the
    load came back."""
    pool = healthy().tick(JSON, tpot=0.045, n=2)
    opening = opened(pool)
    pool.tick(None, gen=0.0, n=12)  # three minutes idle
    assert not pool.run(opening).resolved
    pool.tick(JSON, tpot=0.045, n=2)
    assert not pool.run(opening).resolved, "still collapsed under load"


def test_retuning_resolves_once_tpot_is_back_and_rebaselines() -> None:
    pool = healthy().tick(JSON, tpot=0.045, n=2)
    opening = opened(pool)
    # num_speculative_tokens 3 -> 1: one position left, its yield is low but TPOT is back.
    pool.tick([0.3], tpot=0.030, n=4)
    [(_, why)] = pool.run(opening).resolved
    assert "from 3 to 1" in why
    # The yields of the old configuration no longer count as the baseline, so nothing reopens.
    for _ in range(40):
        assert not pool.tick([0.3], tpot=0.030).run().findings


def test_raising_the_draft_tokens_rebaselines_instead_of_reading_as_a_collapse() -> None:
    # num_speculative_tokens 2 -> 4: the mean acceptance per draft falls as the new positions accept less, with
    # nothing broken; the yields before the change belong to the old configuration.
    pool = Pool().tick([0.8, 0.6], n=120)
    for _ in range(40):
        assert not pool.tick([0.8, 0.6, 0.3, 0.1]).run().findings


def test_a_pool_that_stops_reporting_resolves() -> None:
    pool = healthy().tick(JSON, tpot=0.045, n=2)
    opening = opened(pool)
    pool.ts += 1000.0
    [(_, why)] = pool.run(opening).resolved
    assert "no longer reports" in why


def test_a_drop_in_acceptance_stays_open_while_the_yield_hides_it() -> None:
    """Acceptance 0.70 -> 0.46 with 3 draft tokens: the yield falls only to 0.58, above its own recovery bar, so a
    finding opened on the acceptance must not resolve on the yield and reopen a tick later."""
    w, rng, k, pool = SignalWindows(3 * 3600), random.Random(1), 3, "pool/p"
    ticking = Ticking(SpecDecodeCollapse(), w, {"p": PoolState("p", "decode", 2, 2, 1, 4)})
    t = 0.0
    for i in range(160):
        t += 15.0
        a = (0.70 if i < 120 else 0.46) + rng.gauss(0, 0.005)
        for name, value in (("spec_yield", a * k / (1 + a * k)), ("spec_acceptance_rate", a),
                            ("generation_tokens_rate", 1000.0), ("spec_draft_rate", 1000.0 / (1 + a * k)),
                            ("spec_mean_acceptance_length", 1 + a * k), ("tpot_p95", 0.03),
                            *((f"spec_acceptance_pos_{n}", a ** (n + 1)) for n in range(k))):
            w.add(t, pool, name, value)
        ticking.tick(t)
    assert len(ticking.events("open")) == 1 and ticking.events("resolve") == []
