"""One pool's what-if: the engines a layout needs at the pool's SLOs, the model checked against the pool itself.

Shared by every recommendation: the load a static size must carry (the busy-minute arrivals with the
window's request shape and prompt-length spread), the step cost of the pool's speculation, the
engine curves on another GPU type, and a calibration: the model's TTFT p95 and TPOT mean at the
pool's own size and busy-minute load against what the pool measured in its busy minutes. The queueing
parts of the model (a prompt's wait, a decode's prefill stalls) carry the difference, so a model
that runs optimistic on this traffic (routing imbalance, bursts within a minute) is held to what
the fleet showed, while what the profile fixes (a pass, a step) stays as measured. Where the pool
also reports the share of its requests over the TPOT objective (exact when the objective sits on a
histogram bound), that share and the mean together say how much of the difference is the steps'
and how much the stalls': the p95 against the objective turns on the split.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from scipy.optimize import brentq

from policies.advice.capacity import (
    NO_CALIBRATION,
    Calibration,
    Engine,
    Load,
    Sizing,
    TtftMinute,
    predict,
    size_pool,
)
from policies.advice.types import AdviceSettings, Effect, PoolFacts, PoolObserved
from policies.autoscale import EngineCurves
from policies.stats import lognormal_sigma

__all__ = ["calibrate", "draft_share", "engine", "fit_tail", "on_gpu", "peak_load", "per_token_cost", "sized",
           "step_cost"]

# How far the pool's own numbers may move the model, either way: a queueing part measured at a quarter of the model's
# (a router that spares decodes better than the model counts on) is as plausible as one at four times.
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0


def on_gpu(facts: PoolFacts, gpu_type: str, s: AdviceSettings) -> EngineCurves:
    """The pool's engine curves on another GPU type: times scaled by the types' relative speed, and the KV cache by
    their memory where both give it (kept as it is otherwise; 0 where the model leaves it none)."""
    here = s.gpu_types.get(facts.gpu_type)
    there = s.gpu_types.get(gpu_type)
    if here is None or there is None:
        return facts.curves
    kp, kd = here.relative_to(there)  # times scale by the inverse of speed
    c = facts.curves
    kv = there.kv_tokens_from(here, c.kv_tokens, facts.cache_bytes_per_token, facts.gpus, s.gpu_memory_utilization)
    return replace(c, prefill=(c.prefill[0] * kp, c.prefill[1] * kp, c.prefill[2] * kp),
                   decode=(c.decode[0] * kd, c.decode[1] * kd, c.decode[2] * kd),
                   kv_tokens=c.kv_tokens if kv is None else int(kv))


def peak_load(obs: PoolObserved) -> Load:
    """The load a static size must carry: the busy-minute arrivals with the window's request shape."""
    return Load(max(obs.arrivals_peak, obs.arrivals), obs.prompt_tokens, obs.output_tokens, obs.hit_rate,
                lognormal_sigma(obs.prompt_p50, obs.prompt_p95),
                output_sigma=lognormal_sigma(obs.output_p50, obs.output_p95))


def draft_share(facts: PoolFacts, obs: PoolObserved) -> float:
    """The share of decode steps that carry a draft. A draft model (EAGLE, MTP, Medusa) drafts on every step; the
    ngram drafter only where the context repeats itself, and vLLM counts a draft only where one is proposed, so the
    tokens a draft yields overstate what a step yields. For ngram, from the yield (accepted tokens per generated token:
    a step makes one token plus those accepted) and the tokens per draft; 1 where either is unknown."""
    y, length = obs.spec_yield, obs.spec_length
    if facts.spec.method != "ngram" or y is None or length is None or length <= 1.0 or not 0.0 <= y < 1.0:
        return 1.0
    return min(1.0, y / ((1.0 - y) * (length - 1.0)))


def per_token_cost(facts: PoolFacts, s: AdviceSettings) -> float:
    """What one draft position adds to a step, in plain steps: its verification, and a draft model's pass (the ngram
    drafter's lookup is free)."""
    return (0.0 if facts.spec.method == "ngram" else s.draft_cost) + s.verify_cost


def step_cost(facts: PoolFacts, obs: PoolObserved, s: AdviceSettings) -> tuple[float, float]:
    """(cost of a decode step in plain steps, tokens it yields) under the pool's speculation now, over every step:
    those without a draft cost and yield one."""
    if not facts.spec.enabled or obs.spec_length is None:
        return 1.0, 1.0
    k = facts.spec.num_speculative_tokens
    unit, share = per_token_cost(facts, s), draft_share(facts, obs)
    if share >= 1.0:
        return 1.0 + k * unit, max(1.0, obs.spec_length)
    return 1.0 + share * k * unit, 1.0 + share * (max(1.0, obs.spec_length) - 1.0)


def engine(role: str, curves: EngineCurves, s: AdviceSettings, cost: tuple[float, float] = (1.0, 1.0)) -> Engine:
    """An engine of `role` with these curves, under speculation of this (step cost, tokens per step), as the advisor's
    settings size it."""
    return Engine(role, curves, cost[0], cost[1], s.kv_usage_max, s.max_utilization, s.load_aware_routing)


def sized(role: str, facts: PoolFacts, load: Load, s: AdviceSettings, curves: EngineCurves | None = None, *,
          cost: tuple[float, float] = (1.0, 1.0), transfer_s: float = 0.0,
          calibration: Calibration = NO_CALIBRATION) -> Sizing:
    """`size_pool` with the pool's SLOs, the advisor's settings and the pool's calibration; where the engines prefill,
    the busy TTFT minute (its own load and factors) is sized for TTFT too, and the larger size is the answer."""
    eng = engine(role, curves or facts.curves, s, cost)
    busy = size_pool(load, eng, ttft_slo=facts.ttft_p95_slo, tpot_slo=facts.tpot_p95_slo, margin=s.margin,
                     transfer_s=transfer_s, calibration=calibration)
    at = calibration.ttft_minute
    if at is None or facts.ttft_p95_slo is None or busy.limited_by == "none" or not eng.prefills(at.load):
        return busy
    # What the layout changes in the load (a tier's hits, the answers a merged pool decodes) changes that minute's too.
    hit_rate = min(1.0, max(0.0, at.load.hit_rate + load.hit_rate - at.beside_hit_rate))
    minute_load = replace(at.load, hit_rate=hit_rate, output_tokens=load.output_tokens, output_sigma=load.output_sigma)
    transfer = transfer_s * at.load.prompt_tokens / load.prompt_tokens if load.prompt_tokens > 0 else transfer_s
    minute = size_pool(minute_load, eng, ttft_slo=facts.ttft_p95_slo, tpot_slo=None, margin=s.margin,
                       transfer_s=transfer, calibration=at.calibration)
    # A minute no size carries (a lone prompt of it already misses) leaves the busy load's answer.
    if minute.limited_by == "none" or minute.engines <= busy.engines:
        return busy
    shown = predict(minute.engines, load, eng, transfer_s=transfer_s, calibration=calibration)
    return replace(shown, ttft_p95=minute.ttft_p95, limited_by=minute.limited_by, one_fewer=minute.one_fewer,
                   at_ttft_minute=True)


def saved_engines(now: Sizing, then: Sizing) -> int | None:
    """Engines a change saves at the SLOs; None where either layout meets them at no size (`size_pool`'s "none"),
    so there is no count to compare (its `limit` is no pool's size)."""
    return None if "none" in (now.limited_by, then.limited_by) else now.engines - then.engines


def engines_effect(facts: PoolFacts, now: Sizing, then: Sizing, s: AdviceSettings) -> Effect:
    """The engines a change takes the pool from and to, and what that saves a day. A layout that meets the SLOs at no
    size counts as the pool's size now, and the saving is not stated: there is no count to compare."""
    saved = saved_engines(now, then)
    before = facts.replicas if now.limited_by == "none" else now.engines
    after = before if then.limited_by == "none" else then.engines
    price = s.price(facts.gpu_type) * facts.gpus
    return Effect("engines_needed", before, after, saving_per_day=None if saved is None else 24 * price * saved,
                  gpu_hours_per_day=None if saved is None else 24 * facts.gpus * saved)


def engines_change(now: Sizing, then: Sizing) -> str:
    """`N -> M engines at the SLOs`, or which layout meets them at no size."""
    if now.limited_by == "none" and then.limited_by == "none":
        return "no size meets the SLOs at this load, before or after"
    if now.limited_by == "none":
        return f"no size meets the SLOs now, {then.engines} engines would"
    if then.limited_by == "none":
        return "no size would meet the SLOs after it"
    return f"{now.engines} -> {then.engines} engines at the SLOs"


def fit_tail(steps: np.ndarray, stalls: np.ndarray, mean: float, share: float, objective: float) -> tuple[float, float] | None:
    """(stall factor, step factor) with which the drawn TPOTs' mean is `mean` and `share` of them exceed `objective`;
    None where no pair within the factors' bounds gives both, or where the share does not move with the split (the
    tail is the steps' alone). The mean alone cannot tell steps from stalls; the tail can: stalls come in lumps, a
    few requests' worth, where the steps slow every request alike."""
    step_mean, stall_mean = float(steps.mean()), float(stalls.mean())
    if step_mean <= 0 or stall_mean <= 0 or not 0.0 < share < 1.0:
        return None

    def step_factor(q: float) -> float:
        return (mean - q * stall_mean) / step_mean

    def excess(q: float) -> float:
        return float(np.mean(step_factor(q) * steps + q * stalls > objective)) - share

    # Where both factors stay within bounds; the share over the objective grows as the stalls take more of the mean.
    lo = max(MIN_FACTOR, (mean - MAX_FACTOR * step_mean) / stall_mean)
    hi = min(MAX_FACTOR, (mean - MIN_FACTOR * step_mean) / stall_mean)
    if lo >= hi or excess(lo) >= 0 or excess(hi) <= 0:
        return None
    q = float(brentq(excess, lo, hi, xtol=1e-3))
    return q, step_factor(q)


def _factors(measured: float | None, fixed: float, queueing: float) -> tuple[float, float]:
    """(queueing factor, whole factor): the queueing part carries the difference where it is a fifth of the prediction
    or more; otherwise the whole prediction is scaled."""
    model = fixed + queueing
    if measured is None or measured <= 0 or model <= 0:
        return 1.0, 1.0
    if queueing >= 0.2 * model:
        return min(MAX_FACTOR, max(MIN_FACTOR, (measured - fixed) / queueing)), 1.0
    return 1.0, min(MAX_FACTOR, max(MIN_FACTOR, measured / model))


def _ttft_minute(facts: PoolFacts, obs: PoolObserved, eng: Engine) -> TtftMinute | None:
    """The busy TTFT minute as a load (its own arrivals and prompts, the window's answers), with the model's TTFT factors
    at the pool's own size there (none, where the model has that load not fit); None where the pool has no TTFT
    objective or no such minute."""
    m = obs.ttft_minute
    if m is None or facts.ttft_p95_slo is None or m.arrivals <= 0:
        return None
    sigma = lognormal_sigma(m.prompt_p50 or obs.prompt_p50, m.prompt_p95 or obs.prompt_p95)
    load = replace(peak_load(obs), arrivals=m.arrivals, prompt_tokens=m.prompt_tokens, hit_rate=m.hit_rate,
                   prompt_sigma=sigma)
    # At the engines that served that minute: fewer than the window's (one restarting, an autoscaled pool) make its
    # TTFT, not a slower model.
    at = predict(max(1, round(m.engines or facts.replicas)), load, eng)
    # Where the model has that minute not fit at all, it is checked as the model has it, unscaled.
    factors = (1.0, 1.0) if at.ttft_p95 is None else _factors(m.ttft_p95, at.ttft_floor, at.ttft_queue)
    return TtftMinute(load, Calibration(*factors), beside_hit_rate=obs.hit_rate)


def calibrate(facts: PoolFacts, obs: PoolObserved, s: AdviceSettings) -> Calibration:
    """The pool's TTFT p95 and TPOT mean in its busy minutes over the model's at its own size and busy-minute load;
    with the share of requests over the TPOT objective, the steps and the stalls apart; and the TTFT of its busy TTFT
    minute over the model's at that minute's own load."""
    eng = engine(facts.role, facts.curves, s, step_cost(facts, obs, s))
    at = predict(max(1, round(obs.engines_peak or facts.replicas)), peak_load(obs), eng)
    tq, ts = _factors(obs.ttft_p95_peak or obs.ttft_p95, at.ttft_floor, at.ttft_queue)
    # TPOT on its mean: its p95 read from vLLM's coarse buckets is an interpolation, high whenever the true p95
    # lies inside one; the sum over the count is exact.
    pq, ps = _factors(obs.tpot_mean_peak, at.tpot_base, at.tpot_stall)
    share, mean, objective = obs.tpot_over_slo_peak, obs.tpot_mean_peak, facts.tpot_p95_slo
    if share is not None and mean is not None and objective is not None and at.tpot_draws is not None:
        pq, ps = fit_tail(*at.tpot_draws, mean, share, objective) or (pq, ps)
    return Calibration(tq, ts, pq, ps, _ttft_minute(facts, obs, eng))





