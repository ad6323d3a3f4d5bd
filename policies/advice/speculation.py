"""Which speculative decoding suits a pool's traffic: keep, retune, switch method, or disable.

From what the pool measures: the acceptance of each draft position (so the tokens a step would yield
with fewer positions), and the step's cost (k draft tokens cost about 1 + k·(draft + verify) plain
steps; the ngram drafter drafts for free). The speed-up of k positions is (1 + d·Σ accepted) /
(1 + d·k·(draft + verify)), d the share of steps that carry a draft (every step for a draft model;
for ngram, the steps whose context repeats, from the yield: its acceptance is counted per draft); the pool is then
sized at its SLOs with the best choice against today's, and the engines saved are the effect.
Constrained traffic (JSON, tool calls) shows as acceptance that no number of positions makes pay:
disable. A KV-bound pool on a draft model is pointed at ngram (no draft weights or draft KV); a
model that ships MTP heads at MTP.
"""

from __future__ import annotations

from policies.advice.kv import kv_bound
from policies.advice.types import AdviceKind, AdviceSettings, AdvisorInput, Effect, PoolFacts, PoolObserved, Recommendation
from policies.advice.whatif import (
    calibrate,
    draft_share,
    engines_change,
    engines_effect,
    peak_load,
    per_token_cost,
    sized,
    step_cost,
)

__all__ = ["best_positions", "speculation"]


def best_positions(positions: tuple[float, ...], per_token_cost: float, share: float = 1.0) -> tuple[int, float]:
    """(positions, speed-up) that speculate best given each position's acceptance per draft and the share of steps
    that draft; (0, 1.0) when none pays."""
    best, best_k, accepted = 1.0, 0, 0.0
    for k, p in enumerate(positions, start=1):
        accepted += p
        speedup = (1.0 + share * accepted) / (1.0 + share * k * per_token_cost)
        if speedup > best:
            best, best_k = speedup, k
    return best_k, best


def speculation(inp: AdvisorInput, s: AdviceSettings) -> list[Recommendation]:
    """A recommendation per pool that speculates (or whose model ships MTP heads) and decodes."""
    out = []
    for facts in inp.pools.values():
        obs = inp.observed.get(facts.name)
        if obs is None or facts.role == "prefill" or obs.arrivals <= 0:
            continue
        if facts.spec.enabled and obs.spec_length is not None:
            out.append(_judge(facts, obs, s))
        elif facts.spec.native_mtp and not facts.spec.enabled:
            out.append(Recommendation(
                AdviceKind.SPECULATION, facts.name,
                f"{facts.name}'s model ships MTP heads: try --speculative-config method=mtp (the field reports "
                f"acceptance over 80 % out of the box) behind a canary", {"speculative": {"method": "mtp"}},
                Effect("tpot_p95", obs.tpot_p95 or 0.0, obs.tpot_p95 or 0.0), 0.3, {}, act=True))
    return out


def _judge(facts: PoolFacts, obs: PoolObserved, s: AdviceSettings) -> Recommendation:
    k = facts.spec.num_speculative_tokens
    unit = per_token_cost(facts, s)
    length = max(1.0, obs.spec_length or 1.0)
    share = draft_share(facts, obs)
    cost, tokens = step_cost(facts, obs, s)
    now_speedup = tokens / cost
    positions = obs.spec_positions[:k]
    # Whether drafting pays, and with how many positions, is judged where it drafts; how much it speeds the pool up, and
    # so its size, over every step (a drafter that rarely finds a draft still pays where it does).
    per_draft = length / (1.0 + k * unit)
    best_k, pays = best_positions(positions, unit) if positions else (k, per_draft)
    best_speedup = ((1.0 + share * sum(positions[:best_k])) / (1.0 + share * best_k * unit)) if positions \
        else now_speedup
    load = peak_load(obs)
    cal = calibrate(facts, obs, s)
    now = sized(facts.role, facts, load, s, cost=(cost, tokens), calibration=cal)
    if pays < s.spec_pays:
        choice, then = 0, sized(facts.role, facts, load, s, calibration=cal)
    else:
        choice = best_k
        then_tokens = 1.0 + share * sum(positions[:best_k]) if positions else tokens
        then = sized(facts.role, facts, load, s, cost=(1.0 + share * best_k * unit, then_tokens), calibration=cal)
    evidence = {"method": facts.spec.method, "num_speculative_tokens": k, "mean_acceptance_length": round(length, 3),
                "acceptance_rate": None if obs.spec_acceptance is None else round(obs.spec_acceptance, 3),
                "draft_share": round(share, 3), "tokens_per_step": round(tokens, 3),
                "per_position": [round(p, 3) for p in positions], "step_cost": round(cost, 3),
                "speedup_now": round(now_speedup, 3), "speedup_per_draft": round(per_draft, 3),
                "best_positions": best_k, "best_speedup": round(best_speedup, 3),
                "engines_now": now.as_dict(), "engines_then": then.as_dict(), "model_check": cal.as_dict()}
    effect = engines_effect(facts, now, then, s)
    stay = Effect("engines_needed", effect.before, effect.before)
    conf = round(min(1.0, obs.minutes / 60.0) * 0.85, 2)
    if choice == 0:
        return Recommendation(
            AdviceKind.SPECULATION, facts.name,
            f"disable speculative decoding on {facts.name}: {facts.spec.method} with {k} tokens yields {length:.2f} "
            f"tokens a draft for {1 + k * unit:.2f} steps' cost (x{per_draft:.2f}), no shorter draft pays "
            f"(constrained traffic rejects drafts); {engines_change(now, then)}",
            {"speculative": {"method": "none"}}, effect, conf, evidence)
    if choice < k and best_speedup > now_speedup * 1.02:
        return Recommendation(
            AdviceKind.SPECULATION, facts.name,
            f"retune {facts.name} to num_speculative_tokens={choice}: x{best_speedup:.2f} instead of "
            f"x{now_speedup:.2f}; {engines_change(now, then)}",
            {"speculative": {"method": facts.spec.method, "num_speculative_tokens": choice}}, effect, conf, evidence)
    if facts.spec.method in ("eagle", "eagle3") and kv_bound(obs, s):
        return Recommendation(
            AdviceKind.SPECULATION, facts.name,
            f"{facts.name} is KV-bound with a draft model: ngram speculation needs no draft weights or KV; "
            f"try it behind a canary (draft models pay x{now_speedup:.2f} now)",
            {"speculative": {"method": "ngram"}}, stay, 0.3, evidence)
    return Recommendation(
        AdviceKind.SPECULATION, facts.name,
        f"keep {facts.spec.method} with {k} tokens on {facts.name}: x{now_speedup:.2f} decode speed-up",
        {}, stay, conf, evidence, act=False)
