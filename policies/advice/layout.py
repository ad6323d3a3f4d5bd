"""Parallel layout: EPLB for expert-parallel pools whose ranks stay unbalanced, decode context parallelism
where tensor parallelism duplicates the KV cache.

With fewer KV heads than tensor-parallel ranks every rank holds a copy of the heads it shares, so the
pool's KV capacity is tp / kv_heads times smaller than its HBM could hold; decode context parallelism
of that size shards the cache over the same GPUs instead (no new devices). Its effect is sized like
FP8's: the engines the pool needs at its SLOs with the larger cache.
"""

from __future__ import annotations

from dataclasses import replace

from policies.advice.kv import kv_bound
from policies.advice.types import AdviceKind, AdviceSettings, AdvisorInput, Effect, Recommendation
from policies.advice.whatif import calibrate, engines_change, engines_effect, peak_load, sized, step_cost

__all__ = ["parallel_layout"]


def parallel_layout(inp: AdvisorInput, s: AdviceSettings) -> list[Recommendation]:
    """EPLB and DCP recommendations, with the evidence that calls for them."""
    out = []
    for facts in inp.pools.values():
        obs = inp.observed.get(facts.name)
        if obs is None or obs.arrivals <= 0:
            continue
        conf = round(min(1.0, obs.minutes / 60.0) * 0.8, 2)
        skew = obs.rank_imbalance
        if facts.expert_parallel > 1 and not facts.eplb and skew is not None and skew >= s.imbalance:
            out.append(Recommendation(
                AdviceKind.PARALLEL_LAYOUT, facts.name,
                f"enable EPLB on {facts.name} (--enable-eplb): its {facts.expert_parallel} expert-parallel ranks run "
                f"{skew:.2f}x the mean load on the busiest, so the slowest rank sets every step",
                {"enable_eplb": True}, Effect("rank_imbalance", skew, 1.0 + (skew - 1.0) * 0.3), conf,
                {"rank_imbalance": round(skew, 3), "threshold": s.imbalance}))
        dup = facts.tensor_parallel // max(1, facts.kv_heads)
        # One parallel-layout change a pool at a time: each is measured on its own once followed (and they share
        # the advice's key, so two would replace each other every run).
        if out and out[-1].pool == facts.name:
            continue
        if facts.role != "prefill" and dup >= 2 and kv_bound(obs, s):
            load = peak_load(obs)
            cost = step_cost(facts, obs, s)
            cal = calibrate(facts, obs, s)
            now = sized(facts.role, facts, load, s, cost=cost, calibration=cal)
            then = sized(facts.role, facts, load, s, replace(facts.curves, kv_tokens=facts.curves.kv_tokens * dup),
                         cost=cost, calibration=cal)
            out.append(Recommendation(
                AdviceKind.PARALLEL_LAYOUT, facts.name,
                f"run {facts.name} with --decode-context-parallel-size {dup}: {facts.kv_heads} KV heads over "
                f"{facts.tensor_parallel} TP ranks hold {dup} copies of the cache; sharding it frees {dup}x the KV "
                f"({engines_change(now, then)}, no new GPUs)",
                {"decode_context_parallel_size": dup}, engines_effect(facts, now, then, s), conf,
                {"tensor_parallel": facts.tensor_parallel, "kv_heads": facts.kv_heads,
                 "kv_usage_max": round(obs.kv_usage_max, 3)}, act=then.limited_by != "none"))
    return out
