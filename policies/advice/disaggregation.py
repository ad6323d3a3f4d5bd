"""Disaggregate or not, and the prefill:decode ratio: one pool against two, each right-sized at the SLOs.

The field's rule: measure prefill GPU-seconds against decode GPU-seconds on the real traffic and
compare with what decode- and prefill-class GPUs cost; split when right-sizing each phase on its own
pool saves more than moving the KV cache costs, and not where two pools of one engine would be worse
than one pool of two. Both layouts are sized by `capacity.size_pool` for the pool's load at its
busy-minute quantile; the saving is their difference in GPU cost per day. A split fleet is judged the
other way round: would one pool of its engines do for less?
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from policies.advice.capacity import Load, Sizing, prefill_cost, transfer_seconds
from policies.advice.types import (
    AdviceKind,
    AdviceSettings,
    AdvisorInput,
    Effect,
    PoolFacts,
    PoolObserved,
    Recommendation,
)
from policies.advice.whatif import calibrate, on_gpu, peak_load, sized, step_cost

__all__ = ["disaggregation", "pool_pairs"]


def pool_pairs(inp: AdvisorInput) -> Iterator[tuple[PoolFacts, PoolFacts]]:
    """(prefill, decode) pools that serve together: in a fleet file, every prefill pool with every decode pool."""
    prefill = [p for p in inp.pools.values() if p.role == "prefill"]
    decode = [p for p in inp.pools.values() if p.role == "decode"]
    for p in prefill:
        for d in decode:
            yield p, d


def _confidence(obs: PoolObserved) -> float:
    return round(min(1.0, obs.minutes / 60.0) * 0.9, 2)


def disaggregation(inp: AdvisorInput, s: AdviceSettings) -> list[Recommendation]:
    """A recommendation per unified pool (split it?) and per prefill/decode pair (merge it? what ratio?)."""
    out: list[Recommendation] = []
    for facts in inp.pools.values():
        obs = inp.observed.get(facts.name)
        if facts.role == "unified" and obs is not None and obs.arrivals > 0:
            out.append(_split(inp, facts, obs, s))
    for p, d in pool_pairs(inp):
        po, do = inp.observed.get(p.name), inp.observed.get(d.name)
        if po is not None and do is not None and po.arrivals > 0:
            out.extend(_pair(inp, p, d, po, do, s))
    return out


def _phases(facts: PoolFacts, load: Load, sizing: Sizing, cost: tuple[float, float]) -> tuple[float, float]:
    """Engine-seconds per second of traffic spent in prefill and in decode, at the sized batch."""
    c = facts.curves
    prefill = load.arrivals * prefill_cost(c, load).mean
    b = max(1.0, sizing.batch)
    decode = load.arrivals * load.output_tokens * c.step_seconds(b, load.context) * cost[0] / cost[1] / b
    return prefill, decode


def _split(inp: AdvisorInput, facts: PoolFacts, obs: PoolObserved, s: AdviceSettings) -> Recommendation:
    load = peak_load(obs)
    cost = step_cost(facts, obs, s)
    cal = calibrate(facts, obs, s)
    one = sized("unified", facts, load, s, cost=cost, calibration=cal)
    p_gpu, d_gpu = s.prefill_gpu or facts.gpu_type, s.decode_gpu or facts.gpu_type
    xfer = transfer_seconds(load.prompt_tokens, facts.cache_bytes_per_token, s.link_gbps)
    p_curves, d_curves = on_gpu(facts, p_gpu, s), on_gpu(facts, d_gpu, s)
    if full := sorted({gpu for gpu, c in ((p_gpu, p_curves), (d_gpu, d_curves)) if c.kv_tokens < load.context}):
        now_cost = facts.replicas * facts.gpus * s.price(facts.gpu_type)
        return Recommendation(
            AdviceKind.DISAGGREGATION, facts.name,
            f"no advice on splitting {facts.name} onto {' and '.join(full)}: what the model leaves of its memory holds "
            f"less KV than one mean request's {load.context:.0f} tokens", {"layout": "unified"},
            Effect("gpu_dollars_per_hour", now_cost, now_cost), _confidence(obs),
            {"kv_tokens_per_engine": {"prefill": p_curves.kv_tokens, "decode": d_curves.kv_tokens}}, act=False)
    pre = sized("prefill", facts, load, s, p_curves, transfer_s=xfer, calibration=cal)
    # What a unified pool's TPOT shows beyond the model's steps is its prefill's (a chunk in a step slows every decode
    # in it); a decode pool runs none, so its steps are the profile's.
    dec = sized("decode", facts, load, s, d_curves, cost=cost, calibration=replace(cal, tpot_stall=1.0, tpot_scale=1.0))
    g = facts.gpus
    one_cost = one.engines * g * s.price(facts.gpu_type)
    two_cost = pre.engines * g * s.price(p_gpu) + dec.engines * g * s.price(d_gpu)
    saving = 24.0 * (one_cost - two_cost)
    gpu_h = 24.0 * g * (one.engines - pre.engines - dec.engines)
    split = one_cost > 0 and (one_cost - two_cost) >= s.min_saving * one_cost
    prefill_s, decode_s = _phases(facts, load, one, cost)
    ratio = f"1:{dec.engines / pre.engines:.1f}" if pre.engines else "-"
    evidence = {
        "load": {"arrivals_peak": round(load.arrivals, 3), "arrivals_mean": round(obs.arrivals, 3),
                 "prompt_tokens": round(load.prompt_tokens), "output_tokens": round(load.output_tokens),
                 "hit_rate": round(load.hit_rate, 3)},
        "prefill_to_decode_gpu_seconds": round(prefill_s / decode_s, 3) if decode_s > 0 else None,
        "decode_to_prefill_gpu_price": round(s.price(d_gpu) / s.price(p_gpu), 3),
        "one_pool": {**one.as_dict(), "gpu": facts.gpu_type, "dollars_per_hour": round(one_cost, 2)},
        "prefill_pool": {**pre.as_dict(), "gpu": p_gpu},
        "decode_pool": {**dec.as_dict(), "gpu": d_gpu},
        "two_pools_dollars_per_hour": round(two_cost, 2),
        "kv_transfer_s_per_request": round(xfer, 4),
        "kv_transfer_gbps": round(load.arrivals * load.prompt_tokens * facts.cache_bytes_per_token * 8 / 1e9, 2),
        "current_engines": facts.replicas,
        "model_check": cal.as_dict(),
    }
    unsized = [name for name, z in (("one pool", one), ("prefill pool", pre), ("decode pool", dec))
               if z.limited_by == "none"]
    if unsized:  # a layout no size of which meets the SLOs has no cost to compare (its size is `size_pool`'s limit)
        now_cost = facts.replicas * g * s.price(facts.gpu_type)
        return Recommendation(
            AdviceKind.DISAGGREGATION, facts.name,
            f"no advice on splitting {facts.name}: the {' and the '.join(unsized)} would meet the SLOs at no size "
            "at this load (a lone request already misses them)", {"layout": "unified"},
            Effect("gpu_dollars_per_hour", now_cost, now_cost), _confidence(obs), evidence, act=False)
    change = {"layout": "disaggregated", "prefill": {"replicas": pre.engines, "gpu": p_gpu},
              "decode": {"replicas": dec.engines, "gpu": d_gpu}}
    effect = Effect("gpu_dollars_per_hour", one_cost, two_cost if split else one_cost, saving_per_day=saving,
                    gpu_hours_per_day=gpu_h)
    if split:
        advice = (f"split {facts.name} into {pre.engines} prefill and {dec.engines} decode engines ({ratio}): "
                  f"${saving:,.0f}/day ({gpu_h:+.0f} GPU-h/day) less than the {one.engines} engines one pool needs "
                  f"at the SLOs")
    else:
        why = ("two pools would cost more" if saving < 0 else
               f"it would save only ${saving:,.0f}/day, under {s.min_saving:.0%} of the pool's cost")
        advice = (f"keep {facts.name} as one pool: {one.engines} engines meet the SLOs, a split needs "
                  f"{pre.engines} prefill + {dec.engines} decode; {why}")
    return Recommendation(AdviceKind.DISAGGREGATION, facts.name, advice, change if split else {"layout": "unified"},
                          effect, _confidence(obs), evidence, act=split)


def _pair(inp: AdvisorInput, p: PoolFacts, d: PoolFacts, po: PoolObserved, do: PoolObserved,
          s: AdviceSettings) -> list[Recommendation]:
    load = replace(peak_load(po), output_tokens=do.output_tokens or po.output_tokens)
    cost = step_cost(d, do, s)
    xfer = transfer_seconds(load.prompt_tokens, p.cache_bytes_per_token, s.link_gbps)
    p_cal, d_cal = calibrate(p, po, s), calibrate(d, do, s)
    pre = sized("prefill", p, load, s, transfer_s=xfer, calibration=p_cal)
    dec = sized("decode", d, load, s, cost=cost, calibration=d_cal)
    one = sized("unified", d, load, s, cost=cost,
                calibration=replace(p_cal, tpot_stall=d_cal.tpot_stall, tpot_scale=d_cal.tpot_scale))
    price_p, price_d = s.price(p.gpu_type), s.price(d.gpu_type)
    two_cost = pre.engines * p.gpus * price_p + dec.engines * d.gpus * price_d
    one_cost = one.engines * d.gpus * price_d
    now_cost = p.replicas * p.gpus * price_p + d.replicas * d.gpus * price_d
    pair = f"{p.name}+{d.name}"
    conf = _confidence(po)
    out = []
    merge = one_cost < two_cost * (1.0 - s.min_saving) and one.limited_by != "none"
    evidence = {"prefill_pool": pre.as_dict(), "decode_pool": dec.as_dict(), "one_pool": one.as_dict(),
                "kv_transfer_s_per_request": round(xfer, 4),
                "model_check": {p.name: p_cal.as_dict(), d.name: d_cal.as_dict()}}
    unsized = [f"{r} pool" for r, z in (("prefill", pre), ("decode", dec)) if z.limited_by == "none"]
    if unsized:  # no size to resize to, and no split cost to weigh a merge against
        return [Recommendation(
            AdviceKind.DISAGGREGATION, pair, f"no advice on {pair}'s layout or ratio: the {' and the '.join(unsized)} "
            "would meet the SLOs at no size at this load (a lone request already misses them)",
            {"layout": "disaggregated"}, Effect("gpu_dollars_per_hour", now_cost, now_cost), conf, evidence, act=False)]
    one_needs = "no size of one pool would meet them" if one.limited_by == "none" else \
        f"the {one.engines} one pool would need"
    out.append(Recommendation(
        AdviceKind.DISAGGREGATION, pair,
        (f"merge {pair} into one pool of {one.engines} engines: ${24 * (two_cost - one_cost):,.0f}/day less than "
         f"{pre.engines} + {dec.engines} right-sized split engines") if merge else
        (f"keep {pair} split: {pre.engines} prefill + {dec.engines} decode engines cost ${24 * (one_cost - two_cost):,.0f}"
         f"/day less than {one_needs}") if one.limited_by != "none" else
        f"keep {pair} split: {pre.engines} prefill + {dec.engines} decode engines meet the SLOs; {one_needs}",
        {"layout": "unified", "replicas": one.engines} if merge else {"layout": "disaggregated"},
        Effect("gpu_dollars_per_hour", two_cost, one_cost if merge else two_cost,
               saving_per_day=24 * (two_cost - one_cost) if one.limited_by != "none" else None,
               gpu_hours_per_day=24 * (pre.engines * p.gpus + dec.engines * d.gpus - one.engines * d.gpus)
               if one.limited_by != "none" else None),
        conf, evidence, act=merge))
    lo, hi = s.chat_ratio
    per = dec.engines / pre.engines if pre.engines else float("inf")
    now = d.replicas / p.replicas if p.replicas else float("inf")
    shape = ("within" if lo <= per <= hi else "below" if per < lo else "above")
    resize = (pre.engines, dec.engines) != (p.replicas, d.replicas)
    out.append(Recommendation(
        AdviceKind.POOL_RATIO, pair,
        (f"run {pair} at {pre.engines}:{dec.engines} (1:{per:.1f}, {shape} the chat first cut of 1:{lo:g} to 1:{hi:g}); "
         f"now {p.replicas}:{d.replicas} (1:{now:.1f})"),
        {p.name: {"replicas": pre.engines}, d.name: {"replicas": dec.engines}},
        Effect("gpu_dollars_per_hour", now_cost, two_cost, saving_per_day=24 * (now_cost - two_cost),
               gpu_hours_per_day=24 * (p.replicas * p.gpus + d.replicas * d.gpus - pre.engines * p.gpus
                                       - dec.engines * d.gpus)),
        conf, {**evidence, "why": _ratio_why(load, pre, dec)}, act=resize))
    return out


def _ratio_why(load: Load, pre: Sizing, dec: Sizing) -> str:
    return (f"{load.arrivals:.2f} req/s of {load.prompt_tokens:.0f} prompt tokens ({load.hit_rate:.0%} cached) need "
            f"{pre.engines} prefill engines ({pre.limited_by}-bound at {pre.utilisation:.0%} busy); "
            f"{load.output_tokens:.0f} output tokens each need {dec.engines} decode engines at a batch of "
            f"{dec.batch:.0f} ({dec.limited_by}-bound)")
