"""The advisor wired to a fleet: its input from the fleet file and the stored signals, `fleetctl advise`.

Owns turning `pools[]` (engine profile, flags, GPU type, SLOs) into `PoolFacts`, a window of a
pool's stored signals into `PoolObserved` (means, the busy-minute quantiles, the fullest KV),
keeping every recommendation with its predicted effect, and scoring it once the fleet runs the
way it advised (changed by the control plane or by hand): from the first run that sees the fleet
file follow it, the metric it predicted, measured on the signals from then on (so nothing from
before the change), at the load it was advised for, and the error. The recommendations themselves
are `policies.advice`'s.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from controlplane.autoscaling import engine_curves
from controlplane.config import FleetConfig, Pool
from controlplane.store.base import Store
from controlplane.store.records import AdviceRecord, NewAdvice
from policies.advice import (
    AdviceKind,
    AdvisorInput,
    BusyTtftMinute,
    PoolFacts,
    PoolObserved,
    Recommendation,
    SpecFacts,
    advise,
)
from policies.ep_imbalance import pool_rank_skew
from policies.windows import SignalWindows, minute_means

__all__ = ["AdviceRun", "accuracy", "advise_and_score", "advisor_input", "followed", "observed",
           "pool_facts"]

MAX_POSITIONS = 16
MIN_MINUTES_AFTER = 10.0  # a change is judged on at least this much history after it


def pool_facts(pool: Pool) -> PoolFacts:
    """A pool of the fleet file as the advisor sees it."""
    e = pool.engine
    return PoolFacts(
        name=pool.name, role=str(pool.role), replicas=max(pool.replicas.min, 1), curves=engine_curves(e), gpu_type=e.gpu_type,
        ttft_p95_slo=pool.slo.ttft_p95, tpot_p95_slo=pool.slo.tpot_p95,
        spec=SpecFacts(e.speculative.method, e.speculative.num_speculative_tokens, e.native_mtp),
        kv_cache_dtype=e.kv_cache_dtype, kv_bytes_per_token=e.kv_bytes_per_token, tensor_parallel=e.tensor_parallel,
        kv_heads=e.kv_heads, expert_parallel=e.gpus if e.expert_parallel else 1, eplb=e.eplb)


def _mean(w: SignalWindows, subject: str, name: str, since: float) -> float | None:
    values = [v for _, v in w.series(subject, name, since=since) if math.isfinite(v)]
    return statistics.fmean(values) if values else None


def observed(w: SignalWindows, pool: str, since: float, quantile: float = 0.95) -> PoolObserved | None:
    """What a pool did since `since`, from its pool-level signals; None when it reported nothing."""
    subject = f"pool/{pool}"
    rates = w.series(subject, "request_rate", since=since)
    if not rates:
        return None
    finished = statistics.fmean(v for _, v in rates)

    @functools.cache
    def per_minute(name: str) -> dict[float, float]:
        """A series' per-minute means, by the minute's end."""
        return dict(minute_means((ts, v) for ts, v in w.series(subject, name, since=since) if math.isfinite(v)))

    def busy(name: str) -> float | None:
        """The quantile of a series' per-minute means: what the busy minutes saw."""
        means = list(per_minute(name).values())
        return float(np.quantile(means, quantile)) if means else None

    def mean(name: str) -> float | None:
        return _mean(w, subject, name, since)

    def engines_at_peak() -> float | None:
        """Engines reporting in the minute whose arrivals are the busy quantile."""
        arrivals, engines = per_minute("request_rate"), per_minute("engines_reporting")
        minutes = [m for m in arrivals if m in engines]
        return engines[_minute_at(arrivals, minutes, quantile)] if minutes else None

    prompt, gen = mean("prompt_tokens_rate") or 0.0, mean("generation_tokens_rate") or 0.0
    ttft_minute = _busy_ttft_minute(per_minute, quantile)
    engines = mean("engines_reporting") or 1.0
    kv_max = [v for _, v in w.series(subject, "kv_cache_usage_max", since=since)]
    positions = []
    for n in range(MAX_POSITIONS):
        p = mean(f"spec_acceptance_pos_{n}")
        if p is None:
            break
        positions.append(p)
    return PoolObserved(
        arrivals=finished, arrivals_peak=busy("request_rate") or finished,
        prompt_tokens=prompt / finished if finished > 0 else 0.0,
        output_tokens=gen / finished if finished > 0 else 0.0,
        hit_rate=min(1.0, max(0.0, mean("prefix_cache_hit_rate") or 0.0)), engines=engines,
        engines_peak=engines_at_peak(),
        running=(mean("requests_running") or 0.0) / max(engines, 1.0), kv_usage=mean("kv_cache_usage") or 0.0,
        kv_usage_max=float(np.quantile(kv_max, quantile)) if kv_max else 0.0,
        preemptions=mean("preemption_rate") or 0.0, ttft_p95=mean("ttft_p95"), tpot_p95=mean("tpot_p95"),
        ttft_p95_peak=busy("ttft_p95"), tpot_p95_peak=busy("tpot_p95"),
        tpot_mean_peak=busy("tpot_mean"), tpot_over_slo_peak=busy("tpot_over_slo"),
        itl_mean=mean("itl_mean"), spec_acceptance=mean("spec_acceptance_rate"),
        spec_length=mean("spec_mean_acceptance_length"), spec_yield=mean("spec_yield"),
        spec_positions=tuple(positions), prompt_p50=mean("prompt_len_p50"), prompt_p95=mean("prompt_len_p95"),
        output_p50=mean("output_len_p50"), output_p95=mean("output_len_p95"),
        rank_imbalance=pool_rank_skew(w, pool, since), minutes=(rates[-1][0] - rates[0][0]) / 60.0,
        ttft_minute=ttft_minute)


_MINUTE_SHAPE = ("request_rate", "prompt_tokens_rate", "prefix_cache_hit_rate", "prompt_len_p50", "prompt_len_p95",
                 "engines_reporting")
MIN_MINUTE_REQUESTS = 20  # a minute with fewer finished requests has no p95 worth sizing for


def _minute_at(values: Mapping[float, float], minutes: Sequence[float], quantile: float) -> float:
    """The one of `minutes` whose value is the `quantile` of theirs: one that happened, the next one up, not a value
    between two."""
    target = float(np.quantile([values[m] for m in minutes], quantile, method="higher"))
    return next(m for m in minutes if values[m] == target)


def _busy_ttft_minute(per_minute: Callable[[str], Mapping[float, float]], quantile: float) -> BusyTtftMinute | None:
    """The minute whose mean TTFT p95 is the `quantile` of the window's minutes (one that happened: the next one up,
    not a value between two), with its own arrivals, request shape and engines (`per_minute`: a pool series' means by
    minute); None where no minute has both a TTFT and `MIN_MINUTE_REQUESTS` requests with their prompt tokens."""
    ttft = per_minute("ttft_p95")
    if not ttft:
        return None
    shape = {name: per_minute(name) for name in _MINUTE_SHAPE}
    minutes = [m for m in ttft if shape["request_rate"].get(m, 0.0) * 60.0 >= MIN_MINUTE_REQUESTS
               and m in shape["prompt_tokens_rate"]]
    if not minutes:
        return None
    m = _minute_at(ttft, minutes, quantile)
    rate = shape["request_rate"][m]
    return BusyTtftMinute(arrivals=rate, prompt_tokens=shape["prompt_tokens_rate"][m] / rate,
                          hit_rate=min(1.0, max(0.0, shape["prefix_cache_hit_rate"].get(m, 0.0))), ttft_p95=ttft[m],
                          prompt_p50=shape["prompt_len_p50"].get(m), prompt_p95=shape["prompt_len_p95"].get(m),
                          engines=shape["engines_reporting"].get(m))


def advisor_input(config: FleetConfig, windows: SignalWindows, now: float, since: float,
                  prefix_blocks: Mapping[str, Sequence[Sequence[int]]] | None = None,
                  pools: Sequence[str] = ()) -> AdvisorInput:
    """The advisor's input for the fleet file's pools (or the named ones) over `[since, now]`."""
    chosen = [p for p in config.pools if not pools or p.name in pools]
    facts = {p.name: pool_facts(p) for p in chosen}
    seen = {name: o for name in facts if (o := observed(windows, name, since, config.advisor.load_quantile))}
    # The pool's size is what reported, not the fleet file's bounds.
    facts = {name: replace(f, replicas=max(1, round(seen[name].engines))) if name in seen else f
             for name, f in facts.items()}
    split = [p for p in config.pools if str(p.role) in ("prefill", "decode")]
    models = {p.model for p in split if str(p.role) == "prefill"} & {p.model for p in split if str(p.role) == "decode"}
    peers = {p.name: tuple(q.name for q in split if q.model == p.model and q is not p) for p in split if p.model in models}
    return AdvisorInput(now=now, since=since, pools=facts, observed=seen, prefix_blocks=dict(prefix_blocks or {}),
                        kv_peers=peers)


@dataclass(slots=True)
class AdviceRun:
    """One run of the advisor over the store: what it advises now, and the earlier advice it scored."""

    recommendations: list[Recommendation]
    stored: list[AdviceRecord] = field(default_factory=list)
    scored: list[AdviceRecord] = field(default_factory=list)


def _arrivals(pools: Sequence[str], seen: Mapping[str, PoolObserved], role: Callable[[str], str]) -> float:
    """Requests a second into these pools: a split fleet counts each once, where it enters (the prefill pool), since
    both of its pools report every request."""
    entry = [p for p in pools if p in seen and role(p) != "decode"] or [p for p in pools if p in seen]
    return sum(seen[p].arrivals for p in entry)


def _new(rec: Recommendation, inp: AdvisorInput, fleet: Sequence[str]) -> NewAdvice:
    arrivals = _arrivals(rec.pool.split("+"), inp.observed, lambda p: inp.pools[p].role)
    return NewAdvice(rec.kind.value, rec.pool, rec.act, rec.advice, dict(rec.change), rec.effect.metric,
                     rec.effect.before, rec.effect.after, rec.effect.saving_per_day, rec.confidence,
                     {**rec.evidence, "advised_at_arrivals": round(arrivals, 4), "fleet_pools": sorted(fleet)})


def followed(rec: AdviceRecord, config: FleetConfig) -> list[str] | None:
    """The pools that now run the way `rec` advised, or None while the fleet file does not show it."""
    pools = {p.name: p for p in config.pools}
    change = rec.change
    names = rec.pool.split("+")
    kind = AdviceKind(rec.kind)
    # A split or a merge makes new pools: those the fleet file names now and did not when it was advised (a fleet's
    # other pools are not this change's). Advice kept before the pools were recorded with it takes every pool.
    then = set(rec.evidence.get("fleet_pools") or ())
    new = [p for p in config.pools if p.name not in then]
    if kind is AdviceKind.DISAGGREGATION and change.get("layout") == "disaggregated":
        split = [p.name for p in new if str(p.role) in ("prefill", "decode")]
        return split if rec.pool not in pools and {"prefill", "decode"} <= {str(pools[n].role) for n in split} else None
    if kind is AdviceKind.DISAGGREGATION and change.get("layout") == "unified":
        merged = [p.name for p in new if str(p.role) == "unified"]
        return merged if merged and not any(n in pools for n in names) else None
    if kind is AdviceKind.KV_PRECISION:
        # With the prefill pools a decode pool takes its KV from (one dtype at both ends of a transfer), all or none;
        # judged on the pool it was advised for, named first.
        dtype = change.get("kv_cache_dtype")
        return names[:1] if all(n in pools and pools[n].engine.kv_cache_dtype == dtype for n in names) else None
    pool = pools.get(rec.pool)
    if pool is None:
        return None
    e = pool.engine
    if kind is AdviceKind.SPECULATION and "speculative" in change:
        want = change["speculative"]
        k = want.get("num_speculative_tokens", e.speculative.num_speculative_tokens)
        same = e.speculative.method == want.get("method") and (want.get("method") == "none"
                                                                or e.speculative.num_speculative_tokens == k)
        return [pool.name] if same else None
    if kind is AdviceKind.PARALLEL_LAYOUT and change.get("enable_eplb") and e.eplb:
        return [pool.name]
    return None  # KV tiers, DCP and ratios are not in the fleet file: scored when they are


def _measure(rec: AdviceRecord, pools: Sequence[str], config: FleetConfig,
             seen: Mapping[str, PoolObserved]) -> float | None:
    """The advised metric as the fleet shows it now, scaled to the load it was advised for."""
    obs = [seen[p] for p in pools if p in seen]
    if not obs or min(o.minutes for o in obs) < MIN_MINUTES_AFTER:
        return None
    then = float(rec.evidence.get("advised_at_arrivals") or 0.0)
    now = _arrivals(pools, seen, lambda p: str(config.pool(p).role))
    scale = then / now if then > 0 and now > 0 else 1.0
    if rec.metric == "gpu_dollars_per_hour":
        return scale * sum(seen[p].engines * config.pool(p).engine.gpus
                           * config.advisor.price(config.pool(p).engine.gpu_type) for p in pools if p in seen)
    if rec.metric == "engines_needed":
        return scale * sum(o.engines for o in obs)
    if rec.metric == "prefix_cache_hit_rate":
        return statistics.fmean(o.hit_rate for o in obs)
    if rec.metric == "rank_imbalance":
        skews = [o.rank_imbalance for o in obs if o.rank_imbalance is not None]
        return max(skews) if skews else None
    if rec.metric == "tpot_p95":
        values = [o.tpot_p95 for o in obs if o.tpot_p95 is not None]
        return max(values) if values else None
    return None


async def advise_and_score(config: FleetConfig, store: Store, now: float, since: float, *, pools: Sequence[str] = (),
                           prefix_blocks: Mapping[str, Sequence[Sequence[int]]] | None = None,
                           prefix_block_tokens: int = 16, record: bool = True) -> AdviceRun:
    """Mark the open advice the fleet file now follows, score the followed advice with enough history since, then
    advise on `[since, now]` and keep the advice. With `record` off nothing is written: no advice, no scores."""
    windows = SignalWindows(now - since + 60.0)
    windows.extend((s.ts, s.subject, s.name, s.value) for s in await store.load_signals(since))
    scored = []
    if record:
        for rec in await store.advice(states=("open",)):
            if rec.act and followed(rec, config) is not None:
                # The fleet file says nothing of when it changed: what it shows is judged from now on.
                await store.follow_advice(rec.id, now)
        for rec in await store.advice(states=("followed",)):
            if (done := followed(rec, config)) is None:
                # Changed back before it was judged: open again, its time taken afresh once followed again (or
                # superseded, where newer advice of its kind for its pool is open).
                await store.unfollow_advice(rec.id, now)
                continue
            start = max(since, rec.applied_at if rec.applied_at is not None else now)
            after = {p: o for p in done if (o := observed(windows, p, start, config.advisor.load_quantile))}
            measured = _measure(rec, done, config, after)
            if measured is None:
                continue
            # A prediction of zero (nothing known to predict from) has no relative error to count.
            error = (measured - rec.predicted) / rec.predicted if rec.predicted else None
            await store.score_advice(rec.id, measured, error, now)
            scored.append(replace(rec, state="applied", measured=measured, error=error))
    inp = advisor_input(config, windows, now, since, prefix_blocks, pools)
    recs = advise(inp, config.advisor, prefix_block_tokens=prefix_block_tokens)
    fleet = [p.name for p in config.pools]  # every pool, whichever were advised on: a split's are those it adds
    stored = await store.record_advice([_new(r, inp, fleet) for r in recs], now) if record and recs else []
    return AdviceRun(recs, stored, scored)


def accuracy(records: Sequence[AdviceRecord]) -> dict[str, Any]:
    """How far the advisor's predictions were from what the fleet showed: per kind, the scored count and the
    median absolute error."""
    out: dict[str, Any] = {}
    for kind in sorted({r.kind for r in records if r.error is not None}):
        errors = sorted(abs(r.error) for r in records if r.kind == kind and r.error is not None)
        out[kind] = {"scored": len(errors), "median_abs_error": round(statistics.median(errors), 4)}
    return out
