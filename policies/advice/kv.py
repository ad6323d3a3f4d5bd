"""KV-cache advice: whether a larger tiered prefix cache would pay, and what FP8 KV cache frees.

Tiering: where the prompts' prefix-block hashes are known, an LRU replay answers exactly how the hit
rate grows with the cache (one pass: LRU is a stack algorithm, so a block hits in every cache at
least as large as its reuse distance; a prompt hits its leading blocks up to the first miss, as
vLLM's prefix cache does). The replay at today's capacity is the baseline; the gain of a cache
`factor` times larger (an LMCache-style DRAM/NVMe tier) is added to the hit rate the pool measures.
Without hashes, only a KV-bound pool earns a note that a replay is needed.

Precision: FP8 KV cache halves the bytes per token, so a KV-bound pool holds twice the batch; the
engines it would need at its SLOs with twice the KV tokens, against today. The pools it moves KV
with change with it (a decode pool's prefill pools, and their other decode pools): NIXL moves KV
only between caches of one dtype (vLLM's handshake refuses others), so the advice names them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from policies.advice.capacity import Load
from policies.advice.types import AdviceKind, AdviceSettings, AdvisorInput, Effect, PoolFacts, PoolObserved, Recommendation
from policies.advice.whatif import calibrate, engines_change, engines_effect, peak_load, saved_engines, sized, step_cost

__all__ = ["kv_precision", "kv_tiering", "lru_hit_rates"]

FP8_CAVEAT = ("FP8 KV cache costs a little accuracy on most tasks (the field calls it usually acceptable); "
              "check it on your own evaluation set before rolling it out")


class _Fenwick:
    def __init__(self, n: int) -> None:
        self.tree = [0] * (n + 1)

    def add(self, i: int, v: int) -> None:
        i += 1
        while i < len(self.tree):
            self.tree[i] += v
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of positions [0, i)."""
        s = 0
        while i > 0:
            s += self.tree[i]
            i -= i & -i
        return s


def lru_hit_rates(prompts: Sequence[Sequence[int]], capacities: Sequence[int]) -> list[float]:
    """Share of prompt blocks found in an LRU prefix cache of each capacity (in blocks), prompts in order."""
    total = sum(len(p) for p in prompts)
    if total == 0:
        return [0.0 for _ in capacities]
    tree = _Fenwick(total)
    last: dict[int, int] = {}
    hits = [0] * len(capacities)
    t = 0
    for blocks in prompts:
        distances: list[int | None] = []
        for h in blocks:
            prev = last.get(h)
            if prev is None:
                distances.append(None)
            else:
                # Distinct blocks touched since this one's last use, itself included.
                distances.append(tree.prefix(t) - tree.prefix(prev + 1) + 1)
                tree.add(prev, -1)
            tree.add(t, 1)
            last[h] = t
            t += 1
        for i, cap in enumerate(capacities):
            n = 0
            for d in distances:
                if d is None or d > cap:
                    break
                n += 1
            hits[i] += n
    return [h / total for h in hits]


def kv_bound(obs: PoolObserved, s: AdviceSettings) -> bool:
    """The pool runs out of KV: its fullest engine near full, or preemptions."""
    return obs.kv_usage_max >= s.kv_bound_usage or obs.preemptions > 0.01


def kv_tiering(inp: AdvisorInput, s: AdviceSettings, block_tokens: int = 16) -> list[Recommendation]:
    """Per pool that computes prompts: the hit rate with a cache 2x, 5x, 10x larger, and whether a tier pays."""
    out = []
    for facts in inp.pools.values():
        obs = inp.observed.get(facts.name)
        if obs is None or facts.role == "decode" or obs.arrivals <= 0:
            continue
        prompts = inp.prefix_blocks.get(facts.name)
        if not prompts:
            if kv_bound(obs, s):
                out.append(Recommendation(
                    AdviceKind.KV_TIERING, facts.name,
                    f"{facts.name} evicts its prefix cache (KV {obs.kv_usage_max:.0%} full); record prefix-block "
                    f"hashes (llm-d KV events, LMCache) so the gain of a tier can be measured",
                    {}, Effect("prefix_cache_hit_rate", obs.hit_rate, obs.hit_rate), 0.2,
                    {"kv_usage_max": round(obs.kv_usage_max, 3), "hit_rate": round(obs.hit_rate, 3)}, act=False))
            continue
        free = max(0.05, 1.0 - obs.kv_usage)
        base = max(1, int(max(obs.engines, 1.0) * free * facts.curves.kv_tokens / block_tokens))
        caps = [base] + [int(base * f) for f in s.tier_factors]
        rates = lru_hit_rates(prompts, caps)
        gains = {f: rates[i + 1] - rates[0] for i, f in enumerate(s.tier_factors)}
        pick = next((f for f in s.tier_factors if gains[f] >= s.min_hit_gain), None)
        after = min(1.0, obs.hit_rate + (gains[pick] if pick else 0.0))
        load = peak_load(obs)
        cost = step_cost(facts, obs, s)
        cal = calibrate(facts, obs, s)
        now = sized(facts.role, facts, load, s, cost=cost, calibration=cal)
        then = sized(facts.role, facts, replace(load, hit_rate=after), s, cost=cost, calibration=cal)
        evidence = {"replayed_prompts": len(prompts), "cache_blocks": base, "block_tokens": block_tokens,
                    "lru_hit_rate": {f"{f:g}x": round(r, 3) for f, r in zip((1.0, *s.tier_factors), rates, strict=True)},
                    "measured_hit_rate": round(obs.hit_rate, 3), "engines_now": now.engines,
                    "engines_with_tier": then.engines, "limited_by": [now.limited_by, then.limited_by]}
        if pick:
            advice = (f"add a KV tier {pick:g}x the HBM prefix cache to {facts.name}: hit rate "
                      f"{obs.hit_rate:.0%} -> {after:.0%}, {engines_change(now, then)}")
        else:
            best = max(gains.values(), default=0.0)
            advice = (f"no KV tier for {facts.name}: even {max(s.tier_factors):g}x the cache adds {best:.1%} hits, "
                      f"under {s.min_hit_gain:.0%}")
        out.append(Recommendation(AdviceKind.KV_TIERING, facts.name, advice,
                                  {"kv_tier_factor": pick} if pick else {},
                                  replace(engines_effect(facts, now, then, s), metric="prefix_cache_hit_rate",
                                          before=obs.hit_rate, after=after),
                                  round(min(1.0, len(prompts) / 2000) * 0.9, 2), evidence, act=pick is not None))
    return out


def kv_precision(inp: AdvisorInput, s: AdviceSettings) -> list[Recommendation]:
    """Per KV-bound pool on a 16-bit cache: the engines FP8 KV cache would save at its SLOs."""
    out = []
    for facts in inp.pools.values():
        obs = inp.observed.get(facts.name)
        if (obs is None or facts.kv_cache_dtype == "fp8" or facts.role == "prefill" or obs.arrivals <= 0
                or not kv_bound(obs, s)):
            continue
        out.append(_fp8(facts, obs, s, inp.kv_peers.get(facts.name, ())))
    return out


def _fp8(facts: PoolFacts, obs: PoolObserved, s: AdviceSettings, peers: Sequence[str]) -> Recommendation:
    """FP8 for one pool and the pools it moves KV with (`peers`), sized on the pool's own engines."""
    load: Load = peak_load(obs)
    cost = step_cost(facts, obs, s)
    cal = calibrate(facts, obs, s)
    now = sized(facts.role, facts, load, s, cost=cost, calibration=cal)
    fp8_curves = replace(facts.curves, kv_tokens=facts.curves.kv_tokens * 2)
    then = sized(facts.role, facts, load, s, fp8_curves, cost=cost, calibration=cal)
    saved = saved_engines(now, then)
    # Where no size meets the SLOs with a 16-bit cache (a lone context barely fits) and FP8 makes one, FP8 is the fix,
    # with no saving to state: today's pool misses its SLOs at any size.
    fixes = now.limited_by == "none" and then.limited_by != "none"
    act = fixes or (saved is not None and saved > 0 and saved >= s.min_saving * now.engines)
    evidence = {"kv_usage_max": round(obs.kv_usage_max, 3), "preemptions_per_s": round(obs.preemptions, 3),
                "bf16": now.as_dict(), "fp8": then.as_dict(), "kv_tokens_per_engine": facts.curves.kv_tokens,
                "model_check": cal.as_dict(),
                "caveat": FP8_CAVEAT}
    both = f" and {', '.join(peers)}, the pools it moves KV with (NIXL moves KV only between caches of one dtype)," \
        if peers else ""
    advice = (f"serve {facts.name}{both} with --kv-cache-dtype fp8: a batch of {then.batch:.0f} instead of "
              f"{now.batch:.0f} per engine, {engines_change(now, then)} ({FP8_CAVEAT})"
              if act else
              f"FP8 KV cache would not shrink {facts.name} ({engines_change(now, then)}): "
              f"it is {now.limited_by}-bound")
    effect = engines_effect(facts, now, then, s)
    return Recommendation(AdviceKind.KV_PRECISION, "+".join((facts.name, *peers)), advice,
                          {"kv_cache_dtype": "fp8", "replicas": then.engines} if act else {},
                          effect if act else replace(effect, after=effect.before),
                          round(min(1.0, obs.minutes / 60.0) * 0.85, 2), evidence, act=act)
